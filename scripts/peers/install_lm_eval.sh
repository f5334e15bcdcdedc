#!/bin/bash
# EleutherAI's lm-evaluation-harness in a venv of its own, never in the project's (an outside
# client of the server, not a dependency):   bash scripts/peers/install_lm_eval.sh /tmp/peers/lm_eval
# Its API models need the [api] extra; transformers reads the model folder's tokenizer (no torch needed).
set -euo pipefail
VENV=${1:-/tmp/peers/lm_eval}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "lm_eval[api]==0.4.13" transformers
"$VENV/bin/lm_eval" --help > /dev/null && echo "lm_eval installed in $VENV"
