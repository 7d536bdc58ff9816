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
