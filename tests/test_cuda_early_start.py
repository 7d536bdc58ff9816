"""The CUDA context and cuBLAS started on a thread while the engine config is made
(CudaPlatform.start_device_in_background), only where the worker runs in this process.

The GPU cases run in a fresh interpreter: whether CUDA is initialized is per process.
Run them with `python -m pytest -m gpu tests/test_cuda_early_start.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from spindle.platforms.cuda import CudaPlatform

# Makes the engine config, then reports whether this process has started CUDA (after
# waiting for the start thread, if there is one).
_SCRIPT = r"""
import json, sys, threading
import torch
from spindle.config import EngineArgs
from spindle.platforms import resolve_platform

backend = sys.argv[2]
config = EngineArgs(model=sys.argv[1], device="cuda", distributed_executor_backend=backend,
                    device_ids=[int(sys.argv[3])]).create_engine_config()
threads = [t.name for t in threading.enumerate() if t.name.startswith("spindle-start-")]
resolve_platform("cuda").wait_for_device_start(torch.device("cuda", int(sys.argv[3])))
print("RESULT " + json.dumps({"threads": threads, "initialized": torch.cuda.is_initialized()}))
"""


def _run(path: Path, backend: str, device_id: int = 0, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), backend, str(device_id)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=Path(__file__).resolve().parent.parent)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


@pytest.mark.gpu  # (conftest skips it where there is no CUDA device)
def test_an_in_process_worker_has_its_device_started_while_the_config_is_made(tiny_model):
    last = torch.cuda.device_count() - 1  # (the start follows device_ids)
    result = _run(tiny_model(arch="qwen3"), "uni", last)
    assert result["initialized"], result
    assert result["threads"] in ([], [f"spindle-start-cuda:{last}"]), result


@pytest.mark.gpu  # (conftest skips it where there is no CUDA device)
def test_no_cuda_in_the_engine_process_when_workers_run_elsewhere(tiny_model):
    """mp workers drive the device from their own processes: the engine's process makes
    no context (it would hold device memory, and a forked worker could not use CUDA)."""
    result = _run(tiny_model(arch="qwen3"), "mp")
    assert not result["initialized"] and not result["threads"], result


@pytest.mark.gpu  # (conftest skips it where there is no CUDA device)
def test_the_switch_leaves_the_start_to_the_worker(tiny_model):
    result = _run(tiny_model(arch="qwen3"), "uni", SPINDLE_CUDA_EARLY_START="0")
    assert not result["initialized"] and not result["threads"], result


@pytest.mark.parametrize("initialized,switch,starts", [(False, None, True), (True, None, False),
                                                         (False, "0", False)])
def test_a_start_only_in_a_process_without_cuda_and_with_the_switch_on(
        monkeypatch, initialized, switch, starts):
    """Where the process uses CUDA already, a start's cuBLAS handle would stay beside the
    one in use, with its own workspace, for good: none starts then."""
    began = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(threading.Thread, "start", lambda self: began.append(self.name))
    if switch is None:
        monkeypatch.delenv("SPINDLE_CUDA_EARLY_START", raising=False)
    else:
        monkeypatch.setenv("SPINDLE_CUDA_EARLY_START", switch)
    CudaPlatform().start_device_in_background(torch.device("cuda", 1))
    assert began == (["spindle-start-cuda:1"] if starts else []), began
