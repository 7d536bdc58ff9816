"""How the multi-process executor starts workers (fork or spawn), tested with real
script files run as subprocesses: a script without `if __name__ == "__main__":` works
with forked CPU workers and matches the uni executor, also after torch's OpenMP pool
and the tokenizers' pool ran in the parent; with spawn forced, the same script fails
fast with a message saying what to add, and leaves no process and no shared memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from spindle.config import EngineArgs, ParallelConfig
from spindle.distributed.shm_broadcast import SHM_PREFIX
from spindle.entrypoints.cli_args import add_engine_args, engine_args_from
from spindle.executor.start_method import resolve_start_method
from spindle.platforms.cpu import CpuPlatform

# No main guard, on purpose: how many scripts written for vLLM look.
_UNGUARDED_SCRIPT = """
import json
import sys

import torch

from spindle import LLM, SamplingParams

path, method = sys.argv[1], sys.argv[2]
greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
prompts = ["the quick brown fox", "hello world", "a b c d e f g"]
uni = LLM(path, device="cpu", max_model_len=128)
expected = [o.outputs[0].token_ids for o in uni.generate(prompts, greedy, use_tqdm=False)]
uni.get_tokenizer()(prompts * 50)  # the tokenizers library's pool has run here now
uni.shutdown()
torch.ones(512, 512) @ torch.ones(512, 512)  # and so has torch's OpenMP pool


def matmul_in_worker(worker):
    return torch.get_num_threads(), float((torch.ones(512, 512) @ torch.ones(512, 512)).sum())


runs = {}
for tp in (1, 2):  # one worker gets every core: its parallel regions need a live pool
    llm = LLM(path, device="cpu", tensor_parallel_size=tp, distributed_executor_backend="mp",
              max_model_len=128, worker_start_method=method)
    executor = llm.engine.core.executor
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    runs[tp] = {"method": executor.start_method,
                "tokens": [o.outputs[0].token_ids for o in outputs],
                "matmul": executor.collective_rpc(matmul_in_worker, timeout=60)}
    llm.shutdown()
print(json.dumps({"expected": expected, "runs": runs}))
"""

_UNGUARDED_SPAWN_SCRIPT = """
import sys

from spindle import LLM

llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2, distributed_executor_backend="mp",
          max_model_len=128, worker_start_method=sys.argv[2])
print("engine ready")
"""


def _run_script(tmp_path: Path, text: str, model: Path, method: str, timeout: float) -> dict:
    """Run a script: its returncode, stdout, stderr, pid, seconds and the marker in the
    environment of every process it starts."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(text))
    marker = uuid.uuid4().hex
    env = dict(os.environ, SPINDLE_TEST_MARKER=marker)
    env.pop("TOKENIZERS_PARALLELISM", None)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script), str(model), method], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"returncode": proc.returncode, "stdout": stdout, "stderr": stderr, "pid": proc.pid,
            "seconds": time.monotonic() - start, "marker": marker}


def _processes_with(marker: str) -> list[int]:
    pids = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("SPINDLE_TEST_MARKER") == marker and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return pids


def _shm_of(pid: int) -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"{SHM_PREFIX}*_{pid}_*")}


def test_an_unguarded_script_forks_cpu_workers_and_matches_uni(tiny_model, tmp_path):
    run = _run_script(tmp_path, _UNGUARDED_SCRIPT, tiny_model(arch="llama"), "auto",
                      timeout=300)
    print(f"ran in {run['seconds']:.1f}s; stderr tail: {run['stderr'][-400:]}")
    assert run["returncode"] == 0, run["stderr"][-3000:]
    result = json.loads(run["stdout"].strip().splitlines()[-1])
    cores = len(os.sched_getaffinity(0))
    for tp, engine in result["runs"].items():
        assert engine["method"] == "fork"
        assert engine["tokens"] == result["expected"], tp
        assert engine["matmul"] == [[max(1, cores // int(tp)), 512.0 ** 3]] * int(tp)
    for noise in ("bootstrapping", "huggingface/tokenizers", "Traceback"):
        assert noise not in run["stderr"] + run["stdout"]
    assert _processes_with(run["marker"]) == []
    assert _shm_of(run["pid"]) == set()


def test_spawn_with_an_unguarded_script_fails_fast_saying_what_to_add(tiny_model, tmp_path):
    run = _run_script(tmp_path, _UNGUARDED_SPAWN_SCRIPT, tiny_model(arch="llama"), "spawn",
                      timeout=240)
    print(f"failed after {run['seconds']:.1f}s; stderr tail: {run['stderr'][-600:]}")
    assert run["returncode"] == 1
    last = run["stderr"].strip().splitlines()[-1]
    assert last.startswith("spindle.executor.errors.ExecutorFailedError: the worker processes "
                           "could not start: they are spawned (worker_start_method='spawn')")
    assert str(tmp_path / "unguarded.py") in last
    assert 'under `if __name__ == "__main__":`' in last
    assert "bootstrapping" not in run["stderr"]  # multiprocessing's own error never shows
    assert "engine ready" not in run["stdout"]
    assert _processes_with(run["marker"]) == []  # no worker left behind, none hung
    assert _shm_of(run["pid"]) == set()


# ---- the choice, and the knobs --------------------------------------------------------------
class _FakeCuda(CpuPlatform):
    device_type = "cuda"
    workers_may_fork = False


def test_auto_forks_cpu_workers_and_spawns_cuda_workers(monkeypatch):
    assert resolve_start_method("auto", CpuPlatform())[0] == "fork"
    assert resolve_start_method("spawn", CpuPlatform()) == ("spawn",
                                                            "worker_start_method='spawn'")
    method, why = resolve_start_method("auto", _FakeCuda())
    assert method == "spawn" and "cuda workers are always spawned" in why
    with pytest.raises(ValueError, match="worker_start_method='fork' cannot start cuda workers"):
        resolve_start_method("fork", _FakeCuda())
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    method, why = resolve_start_method("auto", CpuPlatform())
    assert method == "spawn" and "CUDA context" in why
    with pytest.raises(ValueError, match="holds a CUDA context"):
        resolve_start_method("fork", CpuPlatform())


def test_start_method_and_step_timeout_are_checked_config_fields():
    parallel = ParallelConfig.create(EngineArgs())
    assert (parallel.worker_start_method, parallel.step_timeout_s) == ("auto", 900.0)
    with pytest.raises(ValueError, match=r"worker_start_method must be one of \('auto', "
                                         r"'fork', 'spawn'\), got 'forkserver'"):
        ParallelConfig.create(EngineArgs(worker_start_method="forkserver"))
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="step_timeout_s must be a finite number"):
            ParallelConfig.create(EngineArgs(step_timeout_s=bad))
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--worker-start-method", "spawn", "--step-timeout-s", "30"])
    args = engine_args_from(ns)
    assert (args.worker_start_method, args.step_timeout_s) == ("spawn", 30.0)
