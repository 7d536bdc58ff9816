"""batch_invariant=True on CUDA (bf16, decode in CUDA graphs): a request's tokens and
logprobs are the same bits alone, among 1..63 others, chunked, and after a prefix-cache
hit (the checks of test_batch_invariant.py); the default kernels show differences on
the same comparison; float32 still equals transformers."""

from __future__ import annotations

import pytest
from test_batch_invariant import GREEDY, MAX_NEW, SAMPLED, differing, engine, prompts, variants
from test_generate_vs_hf import hf_greedy

pytestmark = pytest.mark.gpu
# Wider than the CPU tests' model, so the GEMM and attention tiles are several wide;
# a vocabulary that is not a multiple of 64 (the sampler pads it).
SHAPE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
             intermediate_size=512, vocab_size=1000)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded-sample"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_request_is_the_same_bits_whatever_its_batch(tiny_model, arch, params):
    results = variants(tiny_model(arch, **SHAPE), "bfloat16", True, params, device="cuda")
    assert differing(results) == []


def test_without_the_flag_the_same_comparison_sees_differences(tiny_model):
    results = variants(tiny_model("qwen3", **SHAPE), "bfloat16", False, GREEDY, device="cuda")
    assert differing(results), "the default path happened to be batch-invariant here"


def test_decode_replays_cuda_graphs_and_float32_equals_transformers(tiny_model):
    path = tiny_model("qwen3", **SHAPE)
    target, sharer, others = prompts()
    batch = [target, sharer] + others[:6]
    expected = hf_greedy(path, batch, MAX_NEW)
    with engine(path, "float32", True, device="cuda", max_num_batched_tokens=24) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY,
                               use_tqdm=False)
        replays = sum(llm.engine.core.executor.worker.runner.graph_runner.num_replays.values())
    assert replays > 0
    for output, (tokens, logprobs) in zip(outputs, expected):
        assert output.outputs[0].token_ids == tokens
        got = [d[t].logprob for d, t in zip(output.outputs[0].logprobs, tokens)]
        assert got == pytest.approx(logprobs, abs=1e-3)
