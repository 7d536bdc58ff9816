"""Triton kernels: all compiled during warm-up, on threads, and none after the engine is
ready (runner/compile_ahead.py), on CUDA.

Each case runs in a fresh interpreter: compiled kernels live in a process's memory, so
an engine started earlier in the same process would have compiled variants for it.
Run with `python -m pytest -m gpu tests/test_compile_gpu.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Started in a fresh interpreter: an engine, the compiled-variant count at ready, a
# varied workload, the count again. Prints one JSON line.
_SCRIPT = r"""
import json, sys
from spindle import LLM
from spindle.attention.backends.triton_attn import TritonAttentionBackend
from spindle.runner.compile_ahead import triton_variants
from spindle.tools.varied_workload import run_varied_workload

split, choose = [], TritonAttentionBackend._single_token_requests
def counting(self, meta):  # (mixed steps' layers that attend in two kernels)
    chosen = choose(self, meta)
    split.append(chosen is not None)
    return chosen
TritonAttentionBackend._single_token_requests = counting

path, dtype, eager = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
max_seqs, max_len = 24, 512
llm = LLM(path, device="cuda", dtype=dtype, max_model_len=max_len, max_num_seqs=max_seqs,
          max_num_batched_tokens=256, enforce_eager=eager)
runner = llm.engine.core.executor.worker.runner
at_ready = triton_variants()
split.clear()  # (the warm-up's)
# Batch sizes 1..max_num_seqs, prompts of 1 token to past the step budget (chunked),
# block tables of 1, 2..15, 16 and more blocks, every sampling option.
run_varied_workload(llm, (1, 2, 3, 8, 9, 17, max_seqs),
                    (1, 2, 7, 15, 16, 17, 33, 100, 255, 256, 300, 480), 400)
print("RESULT " + json.dumps({"at_ready": at_ready, "after": triton_variants(),
                              "ahead": runner.kernels_compiled_ahead,
                              "plan_used": runner.kernel_plan.used,
                              "split_calls": sum(split)}))
llm.shutdown()
"""


def _run(path: Path, dtype: str, enforce_eager: bool, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(path), dtype, "1" if enforce_eager else "0"],
        capture_output=True, text=True, timeout=600, env={**os.environ, **env},
        cwd=Path(__file__).resolve().parent.parent)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


@pytest.mark.parametrize("dtype,enforce_eager", [("bfloat16", False), ("bfloat16", True),
                                                 ("float32", False)],
                         ids=["bf16-graphs", "bf16-eager", "fp32-graphs"])
def test_every_kernel_compiles_ahead_and_none_after_ready(tiny_model, dtype, enforce_eager):
    result = _run(tiny_model(arch="qwen3"), dtype, enforce_eager)
    assert result["after"] == result["at_ready"], result  # nothing compiled once ready
    # Every variant in the process came through the warm-up's threads.
    assert result["ahead"] == result["at_ready"] > 0, result


def test_without_compiling_ahead_nothing_compiles_after_ready_either(tiny_model):
    result = _run(tiny_model(arch="llama"), "bfloat16", False, SPINDLE_COMPILE_AHEAD="0")
    assert result["ahead"] == 0, result
    assert result["after"] == result["at_ready"] > 0, result


def test_mixed_steps_split_between_the_kernels_compile_nothing_after_ready(tiny_model):
    """With the bound for sending a mixed step's single-token requests to the decode
    kernel within the workload's reach (SPINDLE_DECODE_TARGET_PROGRAMS=16: 8 such
    requests of a model with 2 KV heads), steps take that path, and the warm-up's mixed
    steps compiled what it runs."""
    result = _run(tiny_model(arch="qwen3"), "bfloat16", False,
                  SPINDLE_DECODE_TARGET_PROGRAMS="16")
    assert result["split_calls"] > 0, result
    assert result["after"] == result["at_ready"], result
    assert result["ahead"] == result["at_ready"] > 0, result


def test_a_second_start_loads_every_kernel_from_its_plan(tiny_model, tmp_path):
    """The first start (an empty Triton cache) compiles ahead and saves its kernel plan;
    the second loads the plan's kernels on threads, runs no compile-only pass, and still
    compiles nothing once ready."""
    path, cache = tiny_model(arch="qwen3"), tmp_path / "triton"
    first = _run(path, "bfloat16", False, TRITON_CACHE_DIR=str(cache))
    assert not first["plan_used"] and first["ahead"] == first["at_ready"], first
    assert len(list((cache / "spindle_plans").glob("*.json"))) == 1
    second = _run(path, "bfloat16", False, TRITON_CACHE_DIR=str(cache))
    assert second["plan_used"], second
    assert second["after"] == second["at_ready"] == first["at_ready"] > 0, (first, second)
    assert second["ahead"] == second["at_ready"], second  # every variant from the plan
