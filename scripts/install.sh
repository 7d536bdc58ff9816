#!/usr/bin/env bash
# Install spindle and its test dependencies into the current Python environment.
# torch is installed first, pinned to the CPU build, unless a torch is already
# present (e.g. a CUDA build on a GPU machine): an unpinned resolve could pull a
# multi-GB CUDA wheel onto a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -e ".[dev]"
