"""A model pool on CUDA (the cumem backend): requests to two models interleaved, each
equal to that model's own engine, and the driver's view of memory: while one model
is awake the other's workers hold only their CUDA context (benchmarks/model_pool_swap.py
measures the 0.6B and 8B shapes)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from spindle import LLM, SamplingParams
from spindle.config import EngineArgs
from spindle.engine.model_pool import ModelPool, PoolModel

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 13, 2, 7] * 6, [11, 3, 8] * 20, list(range(20, 60))]
KV_BYTES = 1 << 30


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_two_models_take_turns_on_the_gpu(tiny_model):
    paths = {"qwen": tiny_model("qwen3"), "llama": tiny_model("llama")}
    reference = {}
    for name, path in paths.items():
        llm = LLM(str(path), device="cuda", kv_cache_memory_bytes=KV_BYTES, max_num_seqs=8)
        reference[name] = [o.outputs[0].token_ids
                           for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                 _params(), use_tqdm=False)]
        llm.shutdown()
    pool = ModelPool([PoolModel(n, EngineArgs(model=str(p), device="cuda",
                                              kv_cache_memory_bytes=KV_BYTES, max_num_seqs=8))
                      for n, p in paths.items()], time_slice_s=0.2).start()

    async def one(name, prompt):
        async for out in pool.generate(name, {"prompt_token_ids": prompt}, _params()):
            pass
        return out.outputs[0].token_ids

    async def interleaved():
        jobs = [(n, i) for i in range(len(PROMPTS)) for n in paths] * 2
        results = await asyncio.gather(*[one(n, PROMPTS[i]) for n, i in jobs])
        return jobs, results

    async def free_after_using(name):
        await one(name, PROMPTS[0])
        state = await pool.engine(name).call(lambda engine: engine.core.sleep_state())
        other = next(n for n in paths if n != name)
        asleep = await pool.engine(other).call(lambda engine: engine.core.sleep_state())
        return torch.cuda.mem_get_info()[0], state, asleep

    try:
        jobs, results = asyncio.run(interleaved())
        for (name, i), tokens in zip(jobs, results):
            assert tokens == reference[name][i], (name, i)
        free_llama, awake, asleep = asyncio.run(free_after_using("llama"))
        assert pool.config("llama").memory.sleep_mode_backend == "cumem"
        assert awake["workers"][0]["device_bytes"]["kv_cache"] > KV_BYTES // 2
        assert sum(asleep["workers"][0]["device_bytes"].values()) == 0
        free_qwen, _, _ = asyncio.run(free_after_using("qwen"))
        # One awake model's KV cache (1 GiB) in use at a time, whichever it is.
        assert abs(free_llama - free_qwen) < 256 * 2**20
        assert sum(s["stats"]["wakes"] for s in pool.status()) >= 2
    finally:
        pool.shutdown()
