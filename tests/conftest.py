"""Shared fixtures."""

from __future__ import annotations

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
