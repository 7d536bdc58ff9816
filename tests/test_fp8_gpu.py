"""FP8 weights on a GPU with float8 GEMMs (compute capability 8.9+), bf16.

The float8 GEMM of batches over skinny_gemm.max_rows() rows (per-token activation scales,
torch._scaled_mm) against the float32 product of the same rounded operands, on fresh
random inputs, and replayed from a CUDA graph; the engine with quantization="fp8"
decoding in CUDA graphs equal to its eager decode; and the real SmolLM2-135M-Instruct
answering as bf16 does at nearly every position (teacher-forced top-1 agreement), where
it is installed. (The skinny float8 path, at most max_rows() rows, is tested in
test_skinny_gemm.py.)
"""

from __future__ import annotations

import random

import pytest
import torch

from spindle import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a GPU with float8 GEMMs (compute capability 8.9+)"),
]


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3 with one scale per row (its max / 448), in float32."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def _inputs(m, n, k, seed, with_bias=True):
    from spindle.layers.fp8 import quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5
    b = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16) if with_bias else None
    q, scale = quantize_rows(w)
    return x, q, scale, b


def _reference(x, q, scale, b):
    """The float32 product; the activations rounded per token as fp8_linear rounds
    them above skinny_gemm.max_rows() rows (up to it, the skinny GEMM takes them as they
    are)."""
    from spindle.layers.skinny_gemm import max_rows

    xs = round_rows(x) if x.shape[0] > max_rows() else x.float()
    ref = xs @ (q.float() * scale[:, None]).T
    return ref + b.float() if b is not None else ref


def _check(out, ref):
    """bf16 output of a float32 accumulation of the same float8 operands."""
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.to(torch.bfloat16).float(), rtol=1.6e-2,
                               atol=1e-2)
    assert (out.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [17, 64, 333, 2048])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)])
def test_scaled_mm_path(m, n, k, with_bias):
    from spindle.layers.fp8 import fp8_linear

    x, q, scale, b = _inputs(m, n, k, seed=m * 7 + n + k, with_bias=with_bias)
    _check(fp8_linear(x, q, scale, b), _reference(x, q, scale, b))


def test_a_wrong_scale_fails_the_check():
    from spindle.layers.fp8 import fp8_linear

    x, q, scale, b = _inputs(64, 1024, 1024, seed=1)
    bad = scale.clone()
    bad[5] *= 1.05
    with pytest.raises(AssertionError):
        _check(fp8_linear(x, q, bad, b), _reference(x, q, scale, b))


@pytest.mark.parametrize("m", [4, 48])  # the skinny path and the scaled_mm path
def test_cuda_graph_replays(m):
    from spindle.layers.fp8 import fp8_linear
    from spindle.layers.linear import new_split_counters

    x, q, scale, b = _inputs(m, 1024, 2048, seed=m)
    counters = new_split_counters(1024, "cuda")
    fp8_linear(x, q, scale, b, counters)  # warm-up outside the graph, as the runner does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, q, scale, b, counters)
    for seed in range(3):
        x.copy_(_inputs(m, 1024, 2048, seed=100 + seed)[0])
        y.fill_(float("nan"))
        graph.replay()
        _check(y, _reference(x, q, scale, b))


def _prompts(n=6):
    rng = random.Random(2)
    return [[rng.randrange(512) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def test_graph_decode_equals_eager(tiny_model):
    path = str(tiny_model("qwen3", dtype="bfloat16"))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = []
    for eager in (False, True):
        with LLM(path, dtype="bfloat16", quantization="fp8", enforce_eager=eager,
                 max_model_len=256) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                                use_tqdm=False)
            runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write a haiku about the sea.", "Tell me a fun fact about octopuses.",
             "How do I boil an egg?", "What is 12 times 7?"]


def test_real_model_agrees_with_bf16(smollm2):
    """SmolLM2 answers each question greedily in bf16; at every position of those
    answers the fp8 model's top token is the bf16 one at least 85% of the time
    (measured 91%: docs/benchmarks.md)."""
    from spindle.tools.agreement import top1_agreement

    result = top1_agreement(str(smollm2), QUESTIONS, 48, dict(dtype="bfloat16"),
                            dict(dtype="bfloat16", quantization="fp8"))
    assert result["baseline_self_agreement"] == 1.0, result
    assert result["top1_agreement"] >= 0.85, result
