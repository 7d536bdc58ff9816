"""Tensor parallelism over NCCL on two CUDA devices: TP=2 greedy output equals TP=1.

Skipped unless at least two CUDA devices are visible (run on a GPU machine with
`python -m pytest -m gpu tests/test_multiproc_gpu.py`).
"""

from __future__ import annotations

import pytest
import torch

from spindle import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA devices"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def _prompts() -> list[list[int]]:
    base = [(7 * i + 3) % 500 + 5 for i in range(70)]
    return [base + [11, 12], base + [13], base[:40] + [99, 98, 97], base[:17],
            [(5 * i + 1) % 500 + 5 for i in range(90)]]


def _engine_kwargs(enforce_eager: bool) -> dict:
    # A pinned KV budget: the TP=1 engine's cached allocator memory on device 0 must not
    # starve the TP=2 worker that starts there next.
    return dict(device="cuda", dtype="float32", max_model_len=256, max_num_batched_tokens=32,
                enable_chunked_prefill=True, enable_prefix_caching=True,
                kv_cache_memory_bytes=64 * 2**20, enforce_eager=enforce_eager)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_tp2_nccl_greedy_matches_tp1_qwen3(tiny_model, enforce_eager):
    path = str(tiny_model(arch="qwen3", num_kv_heads=1))  # one KV head, replicated on both
    kwargs = _engine_kwargs(enforce_eager)
    with LLM(path, **kwargs) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY,
                                                                  use_tqdm=False)]
    torch.cuda.empty_cache()
    with LLM(path, tensor_parallel_size=2, **kwargs) as llm:
        executor = llm.engine.core.executor
        assert executor.collective_rpc(lambda w: str(w.device)) == ["cuda:0", "cuda:1"]
        assert executor.collective_rpc(
            lambda w: torch.distributed.get_backend()) == ["nccl", "nccl"]
        for _ in range(2):  # the second pass hits the prefix cache
            got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY,
                                                                 use_tqdm=False)]
            assert got == expected


def test_device_ids_pin_workers_to_devices(tiny_model):
    path = str(tiny_model(arch="qwen3", num_kv_heads=1))
    with LLM(path, tensor_parallel_size=2, device_ids=[1, 0], **_engine_kwargs(True)) as llm:
        devices = llm.engine.core.executor.collective_rpc(lambda w: str(w.device))
        assert devices == ["cuda:1", "cuda:0"]
    bad = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"device_ids \\[0, {bad}\\]"):
        LLM(path, tensor_parallel_size=2, device_ids=[0, bad], **_engine_kwargs(True))


def test_pp2_mp_greedy_matches_tp1(tiny_model):
    path = str(tiny_model(arch="qwen3", num_kv_heads=1))
    kwargs = _engine_kwargs(True)
    with LLM(path, **kwargs) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY,
                                                                  use_tqdm=False)]
    torch.cuda.empty_cache()
    with LLM(path, pipeline_parallel_size=2, distributed_executor_backend="mp", **kwargs) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
    assert got == expected


def test_tp2_sleep_level1_returns_memory_on_every_gpu(tiny_model):
    path = str(tiny_model(arch="qwen3", num_kv_heads=1))
    kwargs = dict(_engine_kwargs(False), kv_cache_memory_bytes=4 * 2**30)
    with LLM(path, tensor_parallel_size=2, enable_sleep_mode=True, **kwargs) as llm:
        executor = llm.engine.core.executor

        def used():
            return executor.collective_rpc(
                lambda w: (lambda f, t: t - f)(*torch.cuda.mem_get_info(w.device)))

        expected = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY,
                                                                  use_tqdm=False)]
        captures = executor.collective_rpc(lambda w: w.runner.num_graph_captures)
        awake = used()
        llm.sleep(1)
        asleep = used()
        assert all(a - s >= 4 * 2**30 for a, s in zip(awake, asleep)), (awake, asleep)
        llm.wake_up()
        assert all(abs(u - a) <= 0.01 * a for u, a in zip(used(), awake))
        got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]
        assert got == expected
        assert executor.collective_rpc(lambda w: w.runner.num_graph_captures) == captures
        print(f"TP=2 sleep level 1: used per GPU awake {[a >> 20 for a in awake]} MiB, "
              f"asleep {[s >> 20 for s in asleep]} MiB")
