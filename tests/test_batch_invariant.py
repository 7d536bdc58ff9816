"""batch_invariant=True: a request's tokens and logprobs are the same bits alone, among
1..63 other requests, with its prompt chunked, and after a prefix-cache hit; and the
mode still equals transformers (float32). The same checks without the flag show
differences, so the comparison can see them."""

from __future__ import annotations

import random

import pytest
import torch

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_greedy

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=3, max_tokens=MAX_NEW,
                         ignore_eos=True, logprobs=5)


def prompts(vocab: int = 512):
    """The request under test (37 tokens: three 16-token blocks, the last partial), a
    prompt sharing its first 32 tokens, and 63 others of 1-89 tokens."""
    rng = random.Random(0)
    target = [rng.randrange(vocab) for _ in range(37)]
    sharer = target[:32] + [rng.randrange(vocab) for _ in range(9)]
    others = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 90))] for _ in range(63)]
    return target, sharer, others


def signature(output):
    """Tokens, and every position's logprobs as exact floats."""
    c = output.outputs[0]
    return c.token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in c.logprobs]


def run(llm: LLM, target, mates, params: SamplingParams):
    """The target's signature, generated with mates (other requests, mixed greedy and
    sampled) in the same batch."""
    mate_params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=MAX_NEW + i % 5,
                                  ignore_eos=True, logprobs=i % 3) for i in range(len(mates))]
    batch = [{"prompt_token_ids": target}] + [{"prompt_token_ids": p} for p in mates]
    outputs = llm.generate(batch, [params] + mate_params, use_tqdm=False)
    return signature(outputs[0])


def engine(path, dtype: str, invariant: bool, device: str = "cpu", **kwargs) -> LLM:
    return LLM(str(path), device=device, dtype=dtype, max_model_len=256,
               batch_invariant=invariant, **kwargs)


def variants(path, dtype: str, invariant: bool, params: SamplingParams, **kwargs) -> dict:
    """The target's signature alone and in each setting, by name."""
    target, sharer, others = prompts()
    out = {}
    with engine(path, dtype, invariant, enable_prefix_caching=False, **kwargs) as llm:
        out["alone"] = run(llm, target, [], params)
        for n in (1, 7, 63):
            out[f"with {n} others"] = run(llm, target, others[:n], params)
    with engine(path, dtype, invariant, enable_prefix_caching=False,
                max_num_batched_tokens=16, **kwargs) as llm:
        out["chunked by 16, with 7 others"] = run(llm, target, others[:7], params)
    with engine(path, dtype, invariant, enable_prefix_caching=True, **kwargs) as llm:
        llm.generate([{"prompt_token_ids": sharer}], GREEDY, use_tqdm=False)
        out["32 tokens from the prefix cache, with 7 others"] = run(llm, target, others[:7],
                                                                   params)
        assert llm.engine.core.scheduler.prefix_cache_stats.hits >= 32
    return out


def differing(results: dict) -> list[str]:
    return [name for name, sig in results.items() if sig != results["alone"]]


@pytest.mark.parametrize("arch,dtype,params", [
    ("llama", "bfloat16", GREEDY), ("llama", "bfloat16", SAMPLED),
    ("qwen3", "bfloat16", GREEDY), ("llama", "float32", SAMPLED)],
    ids=["llama-bf16-greedy", "llama-bf16-seeded-sample", "qwen3-bf16-greedy",
         "llama-fp32-seeded-sample"])
def test_a_request_is_the_same_bits_whatever_its_batch(tiny_model, arch, dtype, params):
    results = variants(tiny_model(arch), dtype, True, params)
    assert differing(results) == []


def test_without_the_flag_the_same_comparison_sees_differences(tiny_model):
    """The control: the default kernels adapt to the batch, and the last bits move. (A
    wider model than the others': at hidden size 64-256 the CPU's default decode path
    happens to give the same bits for any batch, since its attention runs each row on
    its own; at 512 the bf16 matmuls pick other blockings as the batch grows where the
    CPU computes in bf16 (AVX512-BF16, AMX). Where it does not (AVX2 only), torch's bf16
    matmuls give the same bits for any batch, and float32's blockings move instead: the
    control passes when either dtype shows a difference.)"""
    path = tiny_model("llama", hidden_size=512, intermediate_size=1536)
    seen = {dtype: differing(variants(path, dtype, False, GREEDY))
            for dtype in ("bfloat16", "float32")}
    assert any(seen.values()), f"the default path happened to be batch-invariant here: {seen}"


def test_tensor_parallel_is_invariant_too(tiny_model):
    target, _, others = prompts()
    with engine(tiny_model("llama"), "bfloat16", True, tensor_parallel_size=2,
                enable_prefix_caching=False) as llm:
        alone = run(llm, target, [], GREEDY)
        assert run(llm, target, others[:15], GREEDY) == alone


def test_greedy_tokens_still_equal_transformers(tiny_model):
    path = tiny_model("qwen3")
    target, sharer, others = prompts()
    batch = [target, sharer] + others[:6]
    expected = hf_greedy(path, batch, MAX_NEW)
    with engine(path, "float32", True, max_num_batched_tokens=24) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY,
                               use_tqdm=False)
    for output, (tokens, logprobs) in zip(outputs, expected):
        assert output.outputs[0].token_ids == tokens
        got = [d[t].logprob for d, t in zip(output.outputs[0].logprobs, tokens)]
        assert got == pytest.approx(logprobs, abs=1e-4)


def test_what_it_cannot_serve_is_refused_by_name(tiny_model):
    path = tiny_model("llama")
    with pytest.raises(ValueError, match="speculative_config"):
        engine(path, "float32", True, speculative_config={"method": "ngram",
                                                          "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="attention_backend"):
        engine(path, "float32", True, attention_backend="torch_sdpa")
    with pytest.raises(ValueError, match="decoder model"):
        engine(tiny_model("bamba"), "float32", True)
    with pytest.raises(ValueError, match="task='generate'"):
        engine(path, "float32", True, task="embed")
    with pytest.raises(ValueError, match="sliding-window"):
        engine(tiny_model("mistral", sliding_window=8), "float32", True)


def test_the_cpu_linear_is_row_by_row_exact():
    """invariant_linear on CPU: each row alone gives the same bits as inside any batch."""
    from spindle.layers.batch_invariant import invariant_linear

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    x = torch.randn(33, 80, generator=gen).to(torch.bfloat16)
    full = invariant_linear(x, weight, bias)
    for i in (0, 7, 32):
        assert torch.equal(invariant_linear(x[i:i + 1], weight, bias)[0], full[i])
        assert torch.equal(invariant_linear(x[i:i + 5], weight, bias)[0], full[i])
    reference = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(full.double(), reference, atol=0.1, rtol=0.02)
