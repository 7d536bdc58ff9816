"""Speculative decoding on CUDA: Triton attention, verifying steps replayed from CUDA
graphs, greedy tokens equal to transformers; sampled outputs against the torch path."""

from __future__ import annotations

import json

import pytest
import torch

from spindle import LLM, SamplingParams
from test_spec_decode import _prompts
from test_cuda_e2e import _hf_greedy

pytestmark = pytest.mark.gpu

MAX_NEW = 32


@pytest.fixture(scope="module")
def target(tiny_model):
    path = tiny_model(arch="llama", max_position_embeddings=2048)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab)
    return path, prompts, [t for t, _ in _hf_greedy(path, prompts, MAX_NEW, torch.float32, "cuda")]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("batch", ["together", "one_by_one"])
def test_float32_greedy_with_speculation_matches_transformers(target, tiny_model, method, batch):
    path, prompts, expected = target
    draft = tiny_model(arch="qwen3", seed=3, max_position_embeddings=2048)
    spec = ({"method": "ngram", "num_speculative_tokens": 3} if method == "ngram" else
            {"method": "draft_model", "num_speculative_tokens": 3, "model": str(path)})
    spec["disable_by_batch_size"] = 64  # speculate in the batch of all prompts too
    if method == "draft_model" and batch == "one_by_one":
        spec["model"] = str(draft)  # a draft that disagrees: rejections on the GPU path
    llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=1024,
              speculative_config=spec)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        if batch == "together":
            outs = llm.generate(prompts, params, use_tqdm=False)
        else:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        graphs = llm.engine.core.executor.worker.runner.graph_runner
        stats = llm.engine.core.scheduler.spec_decode_stats
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert stats.num_draft_tokens > 0
    verify_replays = sum(n for (q, *_), n in graphs.num_replays.items() if q == 4)
    if method == "draft_model" or batch == "one_by_one":
        # (every request verifies k drafts: a draft model always proposes k, and
        # lookups are padded to k; a batch where only some requests have drafts runs
        # eagerly)
        assert verify_replays > 0, "verifying steps must replay their CUDA graphs"
