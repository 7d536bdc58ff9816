"""Gemma, Gemma 2 and Gemma 3 (text) against transformers (eager attention, which applies the
attention soft cap) on tiny random checkpoints, CPU float32: greedy tokens equal and
logprobs within 1e-4, with the soft caps (Gemma 2), q/k norms and a rotary table per
layer type (Gemma 3, one of them linearly scaled) and the alternating sliding window
acting (prompts past the window), chunked prefill, and tensor parallelism. (The
Triton kernels' soft cap: test_triton_attention.py and, on a GPU, test_cuda_e2e.py.)"""

from __future__ import annotations

import random

import pytest

from spindle import LLM, SamplingParams
from test_generate_vs_hf import hf_greedy

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(512) for _ in range(n)] for n in (2, 7, 9, 30)]


def hf_eager_greedy(path, batch, max_new):
    """transformers' greedy answers with eager attention (its SDPA path has no cap)."""
    return hf_greedy(path, batch, max_new, attn_implementation="eager")


@pytest.fixture(scope="module", params=[("gemma", True), ("gemma2", False), ("gemma2", True),
                                        ("gemma3", True)],
                ids=["gemma-tied", "gemma2-untied", "gemma2-tied", "gemma3"])
def reference(tiny_model, request):
    arch, tied = request.param
    path = tiny_model(arch, tie_word_embeddings=tied)
    return path, hf_eager_greedy(path, prompts(), MAX_NEW)


def check(outputs, expected):
    for output, (tokens, logprobs) in zip(outputs, expected):
        answer = output.outputs[0]
        assert answer.token_ids == tokens
        got = [d[t].logprob for d, t in zip(answer.logprobs, tokens)]
        assert got == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 8, "block_size": 4},
                                           {"tensor_parallel_size": 2}],
                         ids=["default", "chunked", "tp2"])
def test_greedy_equals_transformers(reference, engine_kwargs):
    path, expected = reference
    with LLM(str(path), device="cpu", dtype="float32", max_model_len=256, **engine_kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                               use_tqdm=False)
    check(outputs, expected)


def test_the_soft_caps_matter(tiny_model):
    """The same weights without the caps answer differently: the comparison above
    would see a cap left out."""
    capped = tiny_model("gemma2")
    uncapped = tiny_model("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)
    assert [t for t, _ in hf_eager_greedy(capped, prompts(), MAX_NEW)] != \
        [t for t, _ in hf_eager_greedy(uncapped, prompts(), MAX_NEW)]

