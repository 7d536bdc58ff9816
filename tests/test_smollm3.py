"""SmolLM3 against transformers on tiny random checkpoints: Llama's layers with every
other one (here) without rotary (NoPE), with and without sliding windows, chunked prefill
and two tensor-parallel ranks (CPU float32: tokens equal, logprobs within 1e-4); in bf16
the CPU's fused kernels must leave the NoPE layers unrotated too."""

from __future__ import annotations

import random

import pytest

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
SHAPES = {"nope": dict(num_layers=4, no_rope_layer_interval=2),
          "nope-windows": dict(num_layers=4, no_rope_layer_interval=2, use_sliding_window=True,
                               sliding_window=8)}


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(512) for _ in range(n)] for n in (3, 17, 40)]


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(tiny_model, request):
    path = tiny_model("smollm3", **SHAPES[request.param])
    return path, hf_greedy(path, prompts(), MAX_NEW)


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 8},
                                           {"tensor_parallel_size": 2}],
                         ids=["default", "chunked", "tp2"])
def test_greedy_equals_transformers(reference, engine_kwargs):
    path, expected = reference
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=256,
             **engine_kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                               use_tqdm=False)
    for output, (tokens, logprobs) in zip(outputs, expected):
        answer = output.outputs[0]
        assert answer.token_ids == tokens
        got = [d[t].logprob for d, t in zip(answer.logprobs, tokens)]
        assert got == pytest.approx(logprobs, abs=1e-4)


def test_bf16_on_the_cpu_keeps_close_to_float32(reference):
    """bf16 runs the fused CPU kernels (rotary inside the KV store, a decode layer per
    C++ call) on the rotating layers only: the answers start as transformers' float32."""
    path, expected = reference
    with LLM(str(path), device="cpu", dtype="bfloat16", max_model_len=256) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                               use_tqdm=False)
    agree = [o.outputs[0].token_ids[:3] == tokens[:3] for o, (tokens, _) in zip(outputs, expected)]
    assert sum(agree) >= 2, agree
