#!/usr/bin/env bash
# Install torch before everything else, so that pip never pulls a multi-GB CUDA
# build onto a machine that has no GPU.
#   GPU present        -> the ordinary PyPI build (CUDA).
#   no GPU             -> a CPU build: a local wheel if pip is configured with one
#                         (our CI machines have torch 2.13.0 on disk), else PyTorch's
#                         CPU index, else plain PyPI (macOS wheels are CPU/MPS anyway).
# Always the version constraints.txt pins (the one the book was run with).
set -euo pipefail
PY="${1:-python3}"
PIP=("$PY" -m pip install --disable-pip-version-check -q)
TORCH="$(grep -E '^torch==' "$(dirname "$0")/../constraints.txt")"   # torch==2.13.0

if "$PY" -c "import torch" 2>/dev/null; then
    echo "[install] torch $("$PY" -c 'import torch; print(torch.__version__)') already present"
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[install] GPU found: installing the default (CUDA) torch build"
    "${PIP[@]}" "$TORCH"
elif "${PIP[@]}" --no-index --no-deps "$TORCH" 2>/dev/null; then
    "${PIP[@]}" "$TORCH"   # its dependencies, from the index
    echo "[install] installed the local CPU wheel of $TORCH"
elif [ "$(uname -s)" = "Linux" ] && "${PIP[@]}" --index-url https://download.pytorch.org/whl/cpu "$TORCH" 2>/dev/null; then
    echo "[install] installed $TORCH from PyTorch's CPU index"
else
    echo "[install] installing $TORCH from PyPI"
    "${PIP[@]}" "$TORCH"
fi
