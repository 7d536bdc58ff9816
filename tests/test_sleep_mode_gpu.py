"""Sleep mode on CUDA: the cumem backend keeps addresses and CUDA graphs, gives the
device memory back (driver's free memory), and wakes to identical output; the
portable backend recaptures graphs. The 0.6B-shape figures come from
benchmarks/sleep_mode.py."""

from __future__ import annotations

import pytest
import torch

from spindle import LLM, SamplingParams
from spindle.memory.sleep_backend import KV_CACHE, WEIGHTS

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 13, 2, 7] * 6, [11, 3, 8] * 20, [4] * 7, list(range(20, 60))]


def outputs(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def runner_of(llm: LLM):
    return llm.engine.core.executor.worker.runner


@pytest.fixture(scope="module")
def cumem_llm(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), device="cuda", enable_sleep_mode=True,
              kv_cache_memory_bytes=1 << 30, max_num_seqs=8)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_cumem_round_trip_keeps_addresses_graphs_and_output(cumem_llm, level):
    llm = cumem_llm
    runner = runner_of(llm)
    assert llm.config.memory.sleep_mode_backend == "cumem"
    expected = outputs(llm)
    captures = runner.num_graph_captures
    assert captures > 0 and runner.graph_runner is not None
    addresses = [t.data_ptr() for t in runner.tagged_tensors(WEIGHTS) + runner.tagged_tensors(KV_CACHE)]
    before = used()
    llm.sleep(level)
    state = llm.sleep_state()["workers"][0]
    assert state["device_bytes"] == {"weights": 0, "kv_cache": 0}
    assert before - used() >= (1 << 30)  # at least the KV cache went back to the driver
    if level == 2:
        llm.wake_up(["weights"])
        llm.wake_up(["kv_cache"])
        llm.wake_up(["scheduling"])
    else:
        llm.wake_up()
    assert [t.data_ptr() for t in runner.tagged_tensors(WEIGHTS)
            + runner.tagged_tensors(KV_CACHE)] == addresses
    assert outputs(llm) == expected
    assert runner.num_graph_captures == captures  # replayed, not recaptured


def test_portable_backend_on_cuda_recaptures_graphs(tiny_model):
    with LLM(str(tiny_model("qwen3")), device="cuda", enable_sleep_mode=True,
             sleep_mode_backend="portable", kv_cache_memory_bytes=1 << 28,
             max_num_seqs=8) as llm:
        runner = runner_of(llm)
        expected = outputs(llm)
        captures = runner.num_graph_captures
        llm.sleep(1)
        assert runner.graph_runner is None
        llm.wake_up()
        assert runner.num_graph_captures == 2 * captures
        assert outputs(llm) == expected


def test_cumem_allocator_without_sleep_mode_serves_the_engine(tiny_model):
    with LLM(str(tiny_model("qwen3")), device="cuda", enable_cumem_allocator=True,
             kv_cache_memory_bytes=1 << 28, max_num_seqs=8) as llm:
        worker = llm.engine.core.executor.worker
        segments = worker.cumem_allocator.segments
        assert segments.mapped_bytes("weights") > 0 and segments.mapped_bytes("kv_cache") >= 1 << 28
        assert len(outputs(llm)) == len(PROMPTS)
    assert not segments.segments  # shutdown gave every segment back


# Run in a fresh interpreter: the defect these guard against is a segfault, which would
# take pytest down with it. Engine A outlives its use in two ways (dropped without
# shutdown(), or a weight tensor kept past it); engine B then sleeps, wakes and shuts
# down, which empties torch's cache, and with it whatever A's pools still held.
_TWO_ENGINES = r"""
import gc, json, sys
import torch
from spindle import LLM, SamplingParams

path, how = sys.argv[1], sys.argv[2]
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

def engine():
    return LLM(path, device="cuda", enable_sleep_mode=True, kv_cache_memory_bytes=1 << 28,
               max_num_seqs=8)

def tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate([[5, 9, 13] * 5], params,
                                                         use_tqdm=False)]

def used():
    free, total = torch.cuda.mem_get_info()
    return total - free

x = torch.ones(64, 64, device="cuda")
x @ x  # the baseline has the CUDA context and cuBLAS
baseline = used()
a = engine()
expected = tokens(a)
kept = None
if how == "dropped":
    del a
else:
    kept = next(a.engine.core.executor.worker.runner.model.parameters())
    a.shutdown()
    del a
gc.collect()
b = engine()
b.sleep(1)
b.wake_up()
same = tokens(b) == expected
b.shutdown()
del b, kept
gc.collect()
torch.cuda.empty_cache()
print(json.dumps({"same": same, "left_mib": (used() - baseline) / 2**20}))
"""


@pytest.mark.parametrize("how", ["dropped", "tensor_kept"])
def test_an_engine_outliving_its_use_does_not_crash_the_next_one(tiny_model, how):
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _TWO_ENGINES, str(tiny_model("qwen3")), how],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["same"]
    # Both engines' memory went back to the driver: each held over 256 MiB (what stays
    # is the kernels they loaded).
    assert report["left_mib"] < 200, report
