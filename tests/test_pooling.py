"""Pooling: the segment pooling ops, reading sentence-transformers configs, the
scheduler's handling of pooling requests and of models without a KV cache, and a
decoder used as an embedding model (last-token pooling) against transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from spindle import LLM, PoolingParams, SamplingParams
from spindle.config import CacheConfig, SchedulerConfig
from spindle.engine.request import Request, RequestStatus
from spindle.engine.scheduler import Scheduler
from spindle.pooler_config import PoolerConfig
from spindle.runner.pool import pool_hidden_states
from spindle.step_messages import ModelRunnerOutput

POOL = PoolingParams()
PLACEHOLDER = SamplingParams(temperature=0.0, max_tokens=1)


# ---- pooling ops ---------------------------------------------------------------------
@pytest.mark.parametrize("pooling_type", ["mean", "cls", "last"])
def test_pool_hidden_states_matches_a_loop(pooling_type):
    gen = torch.Generator().manual_seed(0)
    lens = [3, 1, 7, 2]
    hidden = torch.randn(sum(lens), 8, generator=gen)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    normalize = [True, False, True, False]
    pooled = pool_hidden_states(hidden, starts, lens, pooling_type, normalize)
    for i, (s, n) in enumerate(zip(starts, lens)):
        seg = hidden[s:s + n]
        expected = {"mean": seg.mean(0), "cls": seg[0], "last": seg[-1]}[pooling_type]
        if normalize[i]:
            expected = F.normalize(expected, dim=0)
        torch.testing.assert_close(pooled[i], expected)


# ---- sentence-transformers configs ------------------------------------------------------
def write_st_config(path, pooling: dict, modules=("Transformer", "Pooling", "Normalize"),
                    bert_config: dict | None = None):
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize",
             "Dense": "2_Dense"}
    entries = [{"idx": i, "name": str(i), "path": paths[m],
                "type": f"sentence_transformers.models.{m}"} for i, m in enumerate(modules)]
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if bert_config is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps(bert_config))


@pytest.mark.parametrize("pooling,expected", [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode": "lasttoken"}, "last"),
    ({"pooling_mode": ["cls"]}, "cls"),
    ({}, "mean"),
])
def test_pooling_mode_read_from_sentence_transformers(tmp_path, pooling, expected):
    write_st_config(tmp_path, {"word_embedding_dimension": 8, **pooling},
                    bert_config={"max_seq_length": 128, "do_lower_case": True})
    config = PoolerConfig.create(tmp_path, "encoder", max_model_len=512)
    assert (config.pooling_type, config.normalize, config.max_seq_len, config.do_lower_case,
            config.source) == (expected, True, 128, True, "sentence-transformers")


def test_without_normalize_module_and_capped_max_seq_len(tmp_path):
    write_st_config(tmp_path, {"pooling_mode": "mean"}, modules=("Transformer", "Pooling"),
                    bert_config={"max_seq_length": 1024})
    config = PoolerConfig.create(tmp_path, "encoder", max_model_len=512)
    assert (config.normalize, config.max_seq_len) == (False, 512)


@pytest.mark.parametrize("pooling,modules,match", [
    ({"pooling_mode": "max"}, ("Transformer", "Pooling"), "pooling mode"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
     ("Transformer", "Pooling"), "pooling mode"),
    ({"pooling_mode": "mean", "include_prompt": False}, ("Transformer", "Pooling"),
     "include_prompt"),
    ({"pooling_mode": "mean"}, ("Transformer", "Pooling", "Dense"), "Dense"),
])
def test_pipelines_spindle_cannot_reproduce_are_refused(tmp_path, pooling, modules, match):
    write_st_config(tmp_path, pooling, modules=modules)
    with pytest.raises(ValueError, match=match):
        PoolerConfig.create(tmp_path, "encoder", max_model_len=512)


def test_defaults_by_kind_and_overrides(tmp_path):
    assert PoolerConfig.create(tmp_path, "encoder", 512).pooling_type == "cls"
    decoder = PoolerConfig.create(tmp_path, "decoder", 512)
    assert (decoder.pooling_type, decoder.normalize, decoder.source) == ("last", True, "defaults")
    custom = PoolerConfig.create(tmp_path, "decoder", 512, pooling_type="mean", normalize=False)
    assert (custom.pooling_type, custom.normalize) == ("mean", False)
    with pytest.raises(ValueError, match="pooling_type"):
        PoolerConfig.create(tmp_path, "decoder", 512, pooling_type="max")


# ---- scheduling ---------------------------------------------------------------------------
def make_scheduler(num_blocks: int, budget: int = 32, caching: bool = True) -> Scheduler:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64,
                            enable_chunked_prefill=True)
    cache = CacheConfig(block_size=4, enable_prefix_caching=caching, kv_cache_memory_bytes=None,
                        gpu_memory_utilization=0.9)
    return Scheduler(sched, cache, num_blocks)


def pooling_request(rid: str, n: int, first: int = 1) -> Request:
    return Request(rid, list(range(first, first + n)), PLACEHOLDER, 1, pooling_params=POOL)


def test_zero_kv_blocks_schedule_whole_prompts_and_finish_with_embeddings():
    sched = make_scheduler(num_blocks=0, budget=32)
    for rid, n in [("a", 20), ("b", 10), ("c", 5)]:
        sched.add_request(pooling_request(rid, n))
    out = sched.schedule()
    # "c" would fit a chunk of 2 tokens, but pooling prompts are never chunked.
    assert out.num_scheduled_tokens == {"a": 20, "b": 10}
    assert [n.block_ids for n in out.new_requests] == [[], []]
    assert out.new_requests[0].pooling_params is POOL
    runner = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[], []],
                               logprobs=[[], []], pooled_outputs=[[1.0, 0.0], [0.0, 1.0]])
    results = sched.update_from_output(out, runner)
    assert [(r.req_id, r.pooled_output, r.finish_reason) for r in results] == \
        [("a", [1.0, 0.0], "stop"), ("b", [0.0, 1.0], "stop")]
    assert sched.num_running == 0 and sched.kv_cache_usage == 0.0
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"c": 5} and second.finished_req_ids == {"a", "b"}


def test_pooling_prompt_longer_than_the_budget_is_aborted_not_chunked():
    sched = make_scheduler(num_blocks=0, budget=16)
    request = pooling_request("long", 20)
    sched.add_request(request)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {}
    results = sched.update_from_output(out, ModelRunnerOutput())
    assert [(r.req_id, r.finish_reason) for r in results] == [("long", "abort")]
    assert request.status == RequestStatus.FINISHED_ABORTED


def test_pooling_requests_take_no_prefix_cache_hits():
    sched = make_scheduler(num_blocks=32, budget=64)
    sched.add_request(Request("gen", list(range(1, 17)), SamplingParams(max_tokens=4), 4))
    sched.update_from_output(sched.schedule(), ModelRunnerOutput())
    sched.add_request(pooling_request("pool", 16))  # same 16 tokens: 3 full cached blocks
    out = sched.schedule()
    assert out.num_scheduled_tokens["pool"] == 16
    assert [n.num_computed_tokens for n in out.new_requests] == [0]


# ---- a decoder as an embedding model ---------------------------------------------------------
@pytest.fixture(scope="module")
def decoder_dir(tiny_model):
    return tiny_model(arch="qwen3")


def hf_hidden_states(path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).last_hidden_state[0]


def test_decoder_embeddings_match_transformers(decoder_dir):
    prompts = [list(range(5, 5 + n)) for n in (40, 7, 33, 60)]
    # A budget of 100 holds two of these prompts at a time; chunked prefill stays on,
    # and none of them may be split.
    llm = LLM(str(decoder_dir), task="embed", device="cpu", max_model_len=100,
              max_num_batched_tokens=100)
    try:
        assert llm.config.pooler.pooling_type == "last"
        last = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        unnormalized = llm.embed([{"prompt_token_ids": prompts[0]}],
                                 PoolingParams(normalize=False), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, last):
        expected = F.normalize(hf_hidden_states(decoder_dir, prompt)[-1], dim=0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected,
                                   atol=1e-4, rtol=0)
    raw = torch.tensor(unnormalized[0].outputs.embedding)
    torch.testing.assert_close(raw, hf_hidden_states(decoder_dir, prompts[0])[-1],
                               atol=1e-4, rtol=1e-4)


def test_task_mismatches_are_named(decoder_dir):
    llm = LLM(str(decoder_dir), device="cpu", max_model_len=64)
    try:
        with pytest.raises(ValueError, match="task='embed'"):
            llm.embed("hello", use_tqdm=False)
        with pytest.raises(ValueError, match="task='embed'"):
            llm.engine.add_request("hello", PoolingParams())
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(decoder_dir), task="embed", device="cpu", max_model_len=64,
            max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="PoolingParams.normalize"):
        PoolingParams(normalize="yes")
