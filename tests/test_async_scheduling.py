"""Async scheduling (step N+1 launched before step N's tokens are read back) must
not change any output: compare against the synchronous engine, token for token."""

from __future__ import annotations

import random

import pytest
import torch

from spindle import LLM, SamplingParams


def _run(path, prompts, params, **kwargs):
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=512, **kwargs)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        core = llm.engine.core
        return ([o.outputs[0].token_ids for o in outputs], core.async_scheduling,
                core.scheduler.num_preemptions)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def setup(tiny_model):
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 9, 40, 130, 17, 64)]
    return tiny_model(arch="qwen3"), prompts


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    # Penalties and min_tokens read the outputs so far: the runner must collect the
    # previous step before sampling.
    SamplingParams(temperature=0.9, seed=5, max_tokens=24, repetition_penalty=1.3,
                   frequency_penalty=0.5, presence_penalty=0.3),
    SamplingParams(temperature=0.0, max_tokens=24, min_tokens=10,
                   stop_token_ids=list(range(0, 512, 3))),
    SamplingParams(temperature=1.0, seed=11, top_k=20, top_p=0.9, max_tokens=30, logprobs=2),
], ids=["greedy", "penalties", "min_tokens", "top_k_top_p"])
def test_async_equals_sync(setup, params):
    path, prompts = setup
    sync, sync_mode, _ = _run(path, prompts, params, async_scheduling=False)
    fast, async_mode, _ = _run(path, prompts, params, async_scheduling=True)
    assert (sync_mode, async_mode) == (False, True)
    assert fast == sync


def test_async_under_preemption_and_chunking(setup):
    """A small KV budget (preemption) and a small step budget (chunked prefill)."""
    path, prompts = setup
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * tokens * kv heads * head_dim * fp32
    # 32 blocks (the least max_model_len=512 allows) for about 34 blocks of work.
    kwargs = dict(kv_cache_memory_bytes=32 * block_bytes, block_size=16, max_num_batched_tokens=48)
    sync, _, _ = _run(path, prompts, params, async_scheduling=False, **kwargs)
    fast, _, preemptions = _run(path, prompts, params, async_scheduling=True, **kwargs)
    assert preemptions > 0, "the KV budget must force preemption"
    assert fast == sync


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=5, max_tokens=24, repetition_penalty=1.3,
                   frequency_penalty=0.5, presence_penalty=0.3),
], ids=["greedy", "penalties"])
def test_async_over_worker_processes_equals_sync(setup, params):
    """The mp executor (TP=2): step N+1 is sent while the workers compute step N."""
    path, prompts = setup
    kwargs = dict(tensor_parallel_size=2, kv_cache_memory_bytes=2**22)
    sync, sync_mode, _ = _run(path, prompts, params, async_scheduling=False, **kwargs)
    fast, async_mode, _ = _run(path, prompts, params, async_scheduling=True, **kwargs)
    assert (sync_mode, async_mode) == (False, True)
    assert fast == sync


def test_pending_output_maps_rows_to_requests():
    """The next step's in-flight inputs come from these rows: one copy when the rows
    follow that step's requests one to one, the request -> row map otherwise (a
    request that sampled nothing, one verifying drafts, a changed batch)."""
    from types import SimpleNamespace

    import numpy as np

    from spindle.runner.async_output import PendingOutput

    def pending(req_ids, rows):
        batch = SimpleNamespace(req_ids=req_ids, sample_rows=np.array(rows, dtype=np.int64))
        return PendingOutput(None, batch, None)

    decode = pending(["a", "b", "c"], [1, 1, 1])
    assert decode.rows_follow(["a", "b", "c"])
    assert not decode.rows_follow(["a", "c"]) and not decode.rows_follow(["b", "a", "c"])
    assert decode.sample_row == {"a": 0, "b": 1, "c": 2}
    mixed = pending(["a", "b", "c"], [1, 0, 3])  # b mid-prompt, c verifying 2 drafts
    assert not mixed.rows_follow(["a", "b", "c"])
    assert mixed.sample_row == {"a": 0, "c": 1}


def test_the_runner_reads_outputs_only_while_a_request_needs_them():
    """InputBatch.needs_outputs (whether sampling must wait for the last step's tokens)
    answers from a count of the held requests with penalties or min_tokens: it must
    follow requests coming and going."""
    from spindle.runner.input_batch import InputBatch
    from spindle.sampling_params import SamplingParams
    from spindle.step_messages import NewRequestData

    batch = InputBatch(4, 64, 16, 100, torch.device("cpu"))

    def add(rid, **params):
        batch.add_request(NewRequestData(rid, [1, 2, 3], 3, SamplingParams(**params),
                                         [[0]], 0))

    add("plain")
    assert not batch.needs_outputs(["plain"])
    add("penalised", presence_penalty=0.5)
    add("min", min_tokens=2)
    assert batch.needs_outputs(["plain", "penalised"]) and batch.needs_outputs(["min"])
    assert not batch.needs_outputs(["plain"])
    batch.remove_request("penalised")
    batch.remove_request("min")
    assert batch.num_output_readers == 0 and not batch.needs_outputs(["plain"])


def test_block_tables_version_counts_their_writes():
    """InputBatch.tables_version (a CUDA graph step copies block tables only when it
    moved, runner/cuda_graph.py) moves with every write to a block table: a new request,
    new blocks, a request taking a freed row; and not for a step without new blocks."""
    from spindle.runner.input_batch import InputBatch
    from spindle.sampling_params import SamplingParams
    from spindle.step_messages import NewRequestData

    batch = InputBatch(4, 64, 16, 100, torch.device("cpu"))

    def add(rid, blocks):
        batch.add_request(NewRequestData(rid, [1, 2, 3], 3, SamplingParams(), [blocks], 0))

    versions = [batch.tables_version]
    add("a", [0])
    versions.append(batch.tables_version)
    batch.append_blocks("a", [[]])
    assert batch.tables_version == versions[-1]
    assert batch.prepare({"a": 3}).tables_version == versions[-1]
    batch.append_blocks("a", [[5]])
    versions.append(batch.tables_version)
    assert batch.block_tables[0][batch.requests["a"].row, :2].tolist() == [0, 5]
    batch.remove_request("a")
    add("b", [7])
    versions.append(batch.tables_version)
    assert batch.prepare({"b": 3}).tables_version == versions[-1]
    assert versions == sorted(set(versions)), versions
