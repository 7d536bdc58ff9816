"""The fused C++ CPU kernels (spindle/csrc/cpu_kernels.cpp, bf16) against the torch
ops they replace and a float64 reference, on fresh random inputs; then whole bf16
models with the kernels on and off, both against transformers in float32.

They are built on first use (scripts/install.sh builds them ahead). Without a C++
compiler they cannot be, and these tests are skipped with that reason; with one, a
failed build fails them."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from spindle.layers import cpu_kernels

BF16 = torch.bfloat16
if shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler: the fused CPU kernels cannot be built here",
                allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def built():
    try:
        cpu_kernels.kernels()
    except cpu_kernels.CPUKernelsUnavailable as e:
        pytest.fail(f"a compiler is present but the kernels did not build: {e}")


def one_rounding_apart(out: torch.Tensor, ref: torch.Tensor, equal_share: float = 0.99):
    """bf16 results of two float32 summation orders: at most one bf16 step apart, and
    nearly all bits equal."""
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=8e-3)
    assert (out == ref).float().mean().item() >= equal_share


@pytest.mark.parametrize("hidden", [576, 1000, 64])
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm_equals_the_torch_layer(hidden, rows):
    from spindle.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(hidden + rows)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen)
    norm = norm.to(BF16)
    wide = torch.randn(rows, hidden + 24, generator=gen).to(BF16)
    x = wide[:, 8:8 + hidden]  # rows with a stride, as slices of a wider tensor
    residual = torch.randn(rows, hidden, generator=gen).to(BF16)
    out, new_residual = cpu_kernels.rms_norm(x, norm.weight, 1e-5, residual)
    assert torch.equal(new_residual, residual + x)  # the add rounds as torch's
    one_rounding_apart(out, norm._norm(residual + x))
    one_rounding_apart(cpu_kernels.rms_norm(x, norm.weight, 1e-5), norm._norm(x))


@pytest.mark.parametrize("width", [1536, 1000, 8])
def test_silu_and_mul_equals_torch(width):
    from spindle.layers.activation import _silu_and_mul

    x = (torch.randn(9, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(BF16)
    one_rounding_apart(cpu_kernels.silu_and_mul(x), _silu_and_mul(x), equal_share=0.999)


@pytest.mark.parametrize("head_dim,num_q,num_k", [(64, 9, 3), (128, 4, 1), (16, 4, 2)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_and_store(head_dim, num_q, num_k, with_norm):
    from spindle.layers.norm import RMSNorm
    from spindle.layers.rotary import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(head_dim + num_q)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    tokens = 29
    qkv = torch.randn(tokens, (num_q + 2 * num_k) * head_dim, generator=gen).to(BF16)
    q = qkv[:, :num_q * head_dim].view(tokens, num_q, head_dim)
    k = qkv[:, num_q * head_dim:(num_q + num_k) * head_dim].view(tokens, num_k, head_dim)
    v = qkv[:, (num_q + num_k) * head_dim:].view(tokens, num_k, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q_norm, k_norm = RMSNorm(head_dim).to(BF16), RMSNorm(head_dim).to(BF16)
    q_norm.weight.data = torch.randn(head_dim, generator=gen).to(BF16)
    k_norm.weight.data = torch.randn(head_dim, generator=gen).to(BF16)
    cos, sin = rope(positions, BF16)
    rq, rk = (q_norm(q), k_norm(k)) if with_norm else (q, k)
    ref_q, ref_k, ref_v = apply_rotary(rq, cos, sin), apply_rotary(rk, cos, sin), v.clone()

    cache = torch.full((2, 4, 16, num_k, head_dim), 7.0, dtype=BF16)
    slots = torch.randperm(64, generator=gen)[:tokens]
    slots[3] = -1  # a padding token: not stored
    cpu_kernels.qk_norm_rope_(q, k, positions, rope.cos_cache, rope.sin_cache,
                              q_norm.weight if with_norm else None,
                              k_norm.weight if with_norm else None, 1e-6, v, cache, slots)
    if with_norm:  # (the per-head norm sums in another order)
        one_rounding_apart(q, ref_q, 0.98)
        one_rounding_apart(k, ref_k, 0.98)
    else:  # no sums: the same bits as apply_rotary
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, ref_v)
    stored = slots >= 0
    keys = cache[0].view(-1, num_k, head_dim)
    values = cache[1].view(-1, num_k, head_dim)
    assert torch.equal(keys[slots[stored]], k[stored])
    assert torch.equal(values[slots[stored]], v[stored])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[stored]] = False
    assert (keys[untouched] == 7).all() and (values[untouched] == 7).all()


def reference_decode(q, keys, values, tables, lens, block_size, scale, window, cap):
    """float64, one request at a time, straight from the definition."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // keys.shape[1]
    for b in range(q.shape[0]):
        n = int(lens[b])
        first = max(0, n - window) if window else 0
        pos = torch.arange(first, n)
        slots = tables[b].long()[pos // block_size] * block_size + pos % block_size
        k = keys[slots].double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = values[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[b].double(), k) * scale
        if cap:
            scores = torch.tanh(scores / cap) * cap
        out[b] = torch.einsum("hs,shd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 3.0)])
# Query heads per KV head: 3, 1, 2 (head_dim 80: the kernels' portable paths), 8 and 5
# (the values summed for 4 heads at once, then the rest).
@pytest.mark.parametrize("head_dim,num_q,num_k", [(64, 9, 3), (128, 8, 8), (80, 4, 2), (64, 16, 2),
                                                  (128, 10, 2)])
def test_decode_attention_equals_the_definition(window, cap, head_dim, num_q, num_k):
    gen = torch.Generator().manual_seed(head_dim * num_q + (window or 0))
    block_size, blocks = 16, 40
    cache = torch.randn(2, blocks, block_size, num_k, head_dim, generator=gen).to(BF16)
    keys = cache[0].view(-1, num_k, head_dim)
    values = cache[1].view(-1, num_k, head_dim)
    lens = torch.tensor([1, 17, 200, 33, 64], dtype=torch.int32)
    # Each request's blocks scattered over the cache, rows padded as the runner pads them.
    order = torch.randperm(blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), 14, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens.tolist()):
        count = math.ceil(n / block_size)
        tables[b, :count] = order[used:used + count] if used + count <= blocks else order[:count]
        used = (used + count) % blocks
    q = torch.randn(len(lens), num_q, head_dim, generator=gen).to(BF16)
    scale = head_dim ** -0.5
    out = cpu_kernels.decode_attention(q, keys, values, tables, lens, block_size, scale,
                                       window, cap)
    ref = reference_decode(q, keys, values, tables, lens, block_size, scale, window, cap)
    assert out.dtype == BF16 and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=8e-3, rtol=8e-3)


def test_bad_inputs_are_refused_by_name():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        cpu_kernels.rms_norm(x, torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_kernels.rms_norm(x.to(BF16), torch.ones(32, dtype=BF16), 1e-6)
    cache = torch.zeros(2, 2, 16, 1, 64, dtype=BF16)
    q = torch.zeros(1, 2, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.decode_attention(q, cache[0].view(-1, 1, 64), cache[1].view(-1, 1, 64),
                                     torch.tensor([[5]], dtype=torch.int32),
                                     torch.tensor([3], dtype=torch.int32), 16, 0.1)
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        cpu_kernels.decode_attention(q, cache[0].view(-1, 1, 64), cache[1].view(-1, 1, 64),
                                     torch.tensor([[0]], dtype=torch.int32),
                                     torch.tensor([40], dtype=torch.int32), 16, 0.1)
    qkv = torch.zeros(1, 3, 64, dtype=BF16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        cpu_kernels.qk_norm_rope_(qkv[:, :2], qkv[:, 2:], torch.tensor([9]),
                                  torch.zeros(4, 64), torch.zeros(4, 64), None, None, 1e-6)


def test_the_switch_turns_them_off(monkeypatch):
    x = torch.zeros(1, 8, dtype=BF16)
    assert cpu_kernels.applies(x)
    assert not cpu_kernels.applies(x.float())
    monkeypatch.setenv(cpu_kernels.SWITCH_ENV, "0")
    assert not cpu_kernels.applies(x)


# ---------------------------------------------------------------- whole models

PROMPTS = [[1, 5, 9, 200, 17, 3], [4] * 40, [7, 8, 9], list(range(30, 62))]
NEW = 12


def greedy(path, **options):
    from spindle import LLM, SamplingParams

    with LLM(str(path), device="cpu", dtype="bfloat16", enable_prefix_caching=False,
             **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch,kwargs", [("llama", {}), ("qwen3", {}), ("qwen2", {}),
                                         ("mistral", {"sliding_window": 8}), ("gemma2", {})])
def test_bf16_models_with_and_without_the_kernels(tiny_model, monkeypatch, arch, kwargs):
    """The kernels on (and used: counted) against the torch ops (switched off), each
    run's greedy tokens scored by transformers in float32: how much logprob each token
    gives up against transformers' own best choice at its position. Both stay within
    bf16's reach of float32, the kernels no farther than the torch ops."""
    path = tiny_model(arch, **kwargs)
    module = cpu_kernels.kernels()
    calls: dict[str, int] = {}

    def counting(name):
        inner = getattr(module, name)

        def call(*args, **kw):
            calls[name] = calls.get(name, 0) + 1
            return inner(*args, **kw)
        return call

    class Counting:
        def __getattr__(self, name):
            return counting(name)

    monkeypatch.setattr(cpu_kernels, "kernels", lambda: Counting())
    fused = greedy(path)
    # Gemma's norms and GeGLU are its own torch code; Llama-family layers run decode
    # steps as one decode_layer call each, prefill through the single kernels.
    expected = {"decode_attention"} if arch == "gemma2" else \
        {"decode_layer", "rms_norm", "silu_and_mul", "qk_norm_rope_"}
    assert expected <= set(calls), calls
    monkeypatch.setenv(cpu_kernels.SWITCH_ENV, "0")
    calls.clear()
    plain = greedy(path)
    assert calls == {}

    def mean_gap(sequences):
        """Mean float32 logprob the greedy token loses against transformers' own
        greedy choice at that position (0 when they agree)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        gaps = []
        with torch.no_grad():
            for prompt, tokens in zip(PROMPTS, sequences):
                logprobs = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
                for i, t in enumerate(tokens):
                    row = logprobs[len(prompt) - 1 + i]
                    gaps.append((row.max() - row[t]).item())
        return sum(gaps) / len(gaps)

    fused_gap, plain_gap = mean_gap(fused), mean_gap(plain)
    assert fused_gap < 0.05, (fused_gap, plain_gap)
    assert fused_gap <= plain_gap + 0.02, (fused_gap, plain_gap)


def greedy_logprobs(path, prompts, new, **options):
    from spindle import LLM, SamplingParams

    with LLM(str(path), device="cpu", enable_prefix_caching=False, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=new, logprobs=0,
                                           ignore_eos=True), use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("arch,kwargs", [("llama", {}), ("qwen3", {}), ("qwen2", {}),
                                         ("mistral", {"sliding_window": 8})])
def test_a_decode_layer_call_is_the_modules_bit_for_bit(tiny_model, monkeypatch, arch, kwargs):
    """decode_layer runs the layer modules' own operations (the same kernels, the same
    matmuls, in the same order): tokens and logprobs identical to the modules' path."""
    from spindle.models.llama import LlamaDecoderLayer

    path = tiny_model(arch, **kwargs)
    fused = greedy_logprobs(path, PROMPTS, NEW, dtype="bfloat16")
    monkeypatch.setattr(LlamaDecoderLayer, "cpu_decode", lambda self, *args: None)
    assert greedy_logprobs(path, PROMPTS, NEW, dtype="bfloat16") == fused


def test_the_real_gguf_model_through_decode_layer(monkeypatch):
    """SmolLM2's GGUF (int4 matmuls, one and two planes) the same with decode_layer as
    through the modules, and through decode_layer on every decode step."""
    from spindle.models.gguf import GGUFUnavailable, check_requirements
    from spindle.models.llama import LlamaDecoderLayer
    from spindle.tools.smollm2 import SmolLM2Unavailable, gguf_path

    try:
        check_requirements()
        gguf = gguf_path()
    except (SmolLM2Unavailable, GGUFUnavailable) as e:
        pytest.skip(str(e))
    prompts = [[1, 504, 3000, 17, 29], list(range(100, 140))]
    calls = []
    inner = LlamaDecoderLayer.cpu_decode

    def counted(self, *args):
        out = inner(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(LlamaDecoderLayer, "cpu_decode", counted)
    # (bf16, the default where the CPU computes in bf16: its layers are the fused ones)
    fused = greedy_logprobs(gguf, prompts, 6, max_model_len=256, dtype="bfloat16")
    # Every layer of each decode step (5, and the start's warm-up ones) fused; prefill not.
    steps = [calls[i:i + 30] for i in range(0, len(calls), 30)]
    assert all(len(set(step)) == 1 for step in steps)
    assert sum(step[0] for step in steps) >= 5
    monkeypatch.setattr(LlamaDecoderLayer, "cpu_decode", lambda self, *args: None)
    assert greedy_logprobs(gguf, prompts, 6, max_model_len=256, dtype="bfloat16") == fused


# ---------------------------------------------------------------- bf16 GEMM for a few rows

def _uses_own_gemm(x, weight) -> bool:
    return cpu_kernels.kernels().bf16_dot_applies(x, weight)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 32])
@pytest.mark.parametrize("n,k", [(960, 576), (7, 1536), (13, 40), (33, 8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_equals_a_float64_product(rows, n, k, with_bias):
    """Fresh random inputs, K with and without a tail past whole 32-value chunks, N not
    a multiple of the 4-row tile, rows from 1 to the limit: the one rounding of a
    float32 sum apart from the float64 product rounded to bf16, as torch's bf16 GEMM."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    weight = torch.randn(n, k, generator=gen).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16) if with_bias else None
    out = cpu_kernels.bf16_linear(x, weight, bias)
    ref = x.double() @ weight.double().T + (bias.double() if with_bias else 0.0)
    assert out.dtype == BF16 and out.shape == (rows, n)
    # A float32 sum of k products is off by at most ~k * 2^-24 of the magnitudes summed;
    # then one bf16 rounding (2^-8 relative).
    bound = ref.abs().to(torch.bfloat16).double() * 2.0 ** -8 \
        + (x.double().abs() @ weight.double().abs().T) * k * 2.0 ** -24
    assert ((out.double() - ref).abs() <= bound + 1e-30).all()
    torch_out = torch.nn.functional.linear(x, weight, bias)
    one_rounding_apart(out, torch_out, equal_share=0.9)


def test_bf16_linear_runs_its_own_kernel_where_it_should():
    """Its own kernel for 1-32 rows of bf16 (when the CPU has AVX-512 BF16), torch's
    GEMM past that, for other dtypes and for a non-contiguous weight: the results of
    torch's GEMM there, bit for bit."""
    if not _uses_own_gemm(torch.zeros(1, 64, dtype=BF16), torch.zeros(8, 64, dtype=BF16)):
        pytest.skip("this CPU has no AVX-512 BF16 instructions: torch's GEMM serves")
    weight = torch.randn(64, 96).to(BF16)
    assert _uses_own_gemm(torch.zeros(32, 96, dtype=BF16), weight)
    assert not _uses_own_gemm(torch.zeros(33, 96, dtype=BF16), weight)
    assert not _uses_own_gemm(torch.zeros(4, 96), weight.float())
    wide = torch.randn(96, 64).to(BF16).T
    assert not _uses_own_gemm(torch.zeros(4, 96, dtype=BF16), wide)
    for x, w in [(torch.randn(40, 96).to(BF16), weight), (torch.randn(4, 96).to(BF16), wide)]:
        assert torch.equal(cpu_kernels.bf16_linear(x, w), torch.nn.functional.linear(x, w))
    # A non-contiguous x (a view of every other row) reads the right rows.
    x = torch.randn(8, 96).to(BF16)
    assert torch.equal(cpu_kernels.bf16_linear(x[::2], weight),
                       cpu_kernels.bf16_linear(x[::2].contiguous(), weight))


def test_bf16_linear_refuses_a_bias_of_the_wrong_size():
    if not _uses_own_gemm(torch.zeros(1, 64, dtype=BF16), torch.zeros(8, 64, dtype=BF16)):
        pytest.skip("this CPU has no AVX-512 BF16 instructions: torch's GEMM serves")
    with pytest.raises(RuntimeError, match="bias must have 8 values"):
        cpu_kernels.bf16_linear(torch.zeros(2, 64, dtype=BF16), torch.zeros(8, 64, dtype=BF16),
                                torch.zeros(5, dtype=BF16))


def test_bf16_linear_switched_off_is_torchs_gemm():
    """SPINDLE_CPU_BF16_GEMM=0 (read once per process: a fresh interpreter) gives
    torch's GEMM, bit for bit."""
    script = ("import torch; from spindle.layers import cpu_kernels as c; "
              "x = torch.randn(4, 96).to(torch.bfloat16); w = torch.randn(64, 96).to(torch.bfloat16); "
              "print(c.kernels().bf16_dot_applies(x, w), "
              "torch.equal(c.bf16_linear(x, w), torch.nn.functional.linear(x, w)))")
    assert _printed_with_switch_off(script, "SPINDLE_CPU_BF16_GEMM") == ["False", "True"]


def _printed_with_switch_off(script: str, switch: str) -> list[str]:
    """What script prints (split) in a fresh interpreter with switch=0 (the kernels
    read their switches once per process)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, switch: "0"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


# ---------------------------------------------------------------- greedy argmax

@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 15), (16, 49152), (5, 151936), (7, 1000)])
def test_argmax_rows_equals_torch_argmax(rows, n, dtype):
    gen = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=gen).to(dtype)  # (bf16: many ties)
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_argmax_rows_ties_nan_and_infinities_as_torch(dtype):
    """The first maximum of a tie wins (also 0.0 against -0.0), the first NaN beats
    any number, and rows of -inf or +inf behave as torch's argmax."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 1000, generator=gen)
    x[0, [17, 40, 999]] = 50.0                  # a three-way tie, across vector lanes
    x[1, [3, 700]] = float("nan")               # two NaNs: the first one
    x[1, 500] = 1e30
    x[2, 999] = float("nan")                    # a NaN in the scalar tail
    x[3] = float("-inf")                        # no finite value at all
    x[4, [5, 6]] = float("inf")
    x[5] = 0.0
    x[5, 2] = -0.0                              # -0.0 == 0.0: index 0 is first
    x[6, :] = -1.0
    x[6, 998] = 0.0                             # the maximum in the tail only
    x[7, 0] = 100.0                             # the first element
    x[8, 992] = float("nan")                    # first lane of the last full vector
    x = x.to(dtype)
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_reads_a_view_and_refuses_bad_inputs():
    x = torch.randn(6, 300)
    assert torch.equal(cpu_kernels.argmax_rows(x[::2, 7:]), x[::2, 7:].argmax(dim=-1))
    assert torch.equal(cpu_kernels.argmax_rows(x.to(BF16)[1:4]), x.to(BF16)[1:4].argmax(-1))
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        cpu_kernels.argmax_rows(x.half())
    with pytest.raises(RuntimeError, match=r"must be \[rows, n\] with n > 0"):
        cpu_kernels.argmax_rows(torch.zeros(3, 0))
    with pytest.raises(RuntimeError, match=r"must be \[rows, n\] with n > 0"):
        cpu_kernels.argmax_rows(torch.zeros(10))


def test_the_sampler_takes_its_greedy_rows_from_argmax_rows(monkeypatch):
    from spindle.runner.sample.sampler import greedy_sample

    x = torch.randn(4, 500)
    x[2, [10, 20]] = 9.0
    calls = []
    monkeypatch.setattr(cpu_kernels, "argmax_rows",
                        lambda t: calls.append(t) or cpu_kernels.kernels().argmax_rows(t))
    assert torch.equal(greedy_sample(x), x.argmax(dim=-1))
    assert len(calls) == 1
    assert torch.equal(greedy_sample(x.to(BF16)), x.to(BF16).argmax(dim=-1))
    assert len(calls) == 2
    # float16 logits, or the kernels switched off: torch's argmax.
    greedy_sample(x.half())
    monkeypatch.setenv(cpu_kernels.SWITCH_ENV, "0")
    assert torch.equal(greedy_sample(x), x.argmax(dim=-1))
    assert len(calls) == 2


# ---------------------------------------------------------------- int4 GEMM for a few rows

def _packed_int4(n: int, k: int, gen: torch.Generator):
    """torch's packed int4 weight of random codes with random bf16 scales and zeros, and
    its float64 dequantization w = (q - 8) * s + z."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale_zero = torch.randn(k // 32, n, 2, generator=gen).mul(0.05).to(BF16)
    scale_zero[..., 0] = scale_zero[..., 0].abs() + 0.01
    s = scale_zero[..., 0].double().T.repeat_interleave(32, 1)
    z = scale_zero[..., 1].double().T.repeat_interleave(32, 1)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    return packed, scale_zero, (codes.double() - 8) * s + z


def _uses_own_int4(x, packed, scale_zero) -> bool:
    return cpu_kernels.kernels().int4_dot_applies(x, packed, scale_zero)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 32])
@pytest.mark.parametrize("n,k", [(64, 32), (960, 576), (576, 1536), (128, 96)])
def test_int4_linear_equals_a_float64_product(rows, n, k):
    """Fresh random codes, scales, zeros and inputs: the float64 product of the
    dequantized weight rounded to bf16, within one rounding of a float32 sum, and
    within one bf16 step of torch's own int4 kernel."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    packed, scale_zero, w = _packed_int4(n, k, gen)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    out = cpu_kernels.int4_linear(x, packed, scale_zero)
    assert out.dtype == BF16 and out.shape == (rows, n)
    ref = x.double() @ w.T
    bound = ref.abs().to(BF16).double() * 2.0 ** -8 \
        + (x.double().abs() @ w.abs().T) * k * 2.0 ** -24
    assert ((out.double() - ref).abs() <= bound + 1e-30).all()
    one_rounding_apart(out, torch._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero),
                       equal_share=0.9)


def test_int4_linear_runs_its_own_kernel_where_it_should():
    """Its own kernel for 1-32 bf16 rows and whole 64-row blocks (with AVX-512 BF16 and
    torch's 64-row packing), torch's kernel otherwise: its results there, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    packed, scale_zero, _ = _packed_int4(128, 64, gen)
    if not _uses_own_int4(torch.zeros(1, 64, dtype=BF16), packed, scale_zero):
        pytest.skip("this CPU or torch packs int4 weights otherwise: torch's kernel serves")
    assert _uses_own_int4(torch.zeros(32, 64, dtype=BF16), packed, scale_zero)
    assert not _uses_own_int4(torch.zeros(33, 64, dtype=BF16), packed, scale_zero)
    odd, odd_sz, _ = _packed_int4(80, 64, gen)  # a last block of 16 rows
    assert not _uses_own_int4(torch.zeros(4, 64, dtype=BF16), odd, odd_sz)
    for x, p, sz in [(torch.randn(40, 64, generator=gen).to(BF16), packed, scale_zero),
                     (torch.randn(4, 64, generator=gen).to(BF16), odd, odd_sz)]:
        assert torch.equal(cpu_kernels.int4_linear(x, p, sz),
                           torch._weight_int4pack_mm_for_cpu(x, p, 32, sz))
    # A non-contiguous x reads the right rows.
    x = torch.randn(8, 64, generator=gen).to(BF16)
    assert torch.equal(cpu_kernels.int4_linear(x[::2], packed, scale_zero),
                       cpu_kernels.int4_linear(x[::2].contiguous(), packed, scale_zero))


def test_int4_linear_switched_off_is_torchs_kernel():
    """SPINDLE_CPU_INT4_GEMM=0 (read once per process: a fresh interpreter) gives
    torch's int4 kernel, bit for bit."""
    script = ("import torch; from spindle.layers import cpu_kernels as c; "
              "q = torch.randint(0, 16, (128, 64), dtype=torch.int32); "
              "p = torch._convert_weight_to_int4pack_for_cpu(q, 1); "
              "sz = torch.rand(2, 128, 2).to(torch.bfloat16); "
              "x = torch.randn(4, 64).to(torch.bfloat16); "
              "print(c.kernels().int4_dot_applies(x, p, sz), "
              "torch.equal(c.int4_linear(x, p, sz), torch._weight_int4pack_mm_for_cpu(x, p, 32, sz)))")
    assert _printed_with_switch_off(script, "SPINDLE_CPU_INT4_GEMM") == ["False", "True"]


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 32])
@pytest.mark.parametrize("n,k", [(960, 576), (7, 1536), (13, 32), (130, 16)])
def test_fp8_matmul_is_the_exact_product_rounded_once(rows, n, k):
    """float8 e4m3fn codes (every code but NaN, subnormals included) times float8-valued
    rows: the float64 product, exact here, rounded once to float32, whatever the tiling
    (N not a multiple of the row tiles, row blocks of 8 and a remainder)."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x42  # (no NaN codes)
    codes[0, :2] = torch.tensor([0x01, 0x81], dtype=torch.uint8)  # the smallest subnormals
    weight = codes.view(torch.float8_e4m3fn)
    x = (torch.randn(rows, k, generator=gen) * 4).to(torch.float8_e4m3fn).float()
    out = cpu_kernels.fp8_matmul(x, codes)
    expected = (x.double() @ weight.double().T).float()
    assert out.dtype == torch.float32 and torch.equal(out, expected)


def test_fp8_matmul_refuses_what_it_cannot_read():
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.fp8_matmul(torch.zeros(2, 32, dtype=BF16), codes)
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_kernels.fp8_matmul(torch.zeros(2, 32), codes.to(torch.int8))
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.fp8_matmul(torch.zeros(2, 16), codes)
    with pytest.raises(RuntimeError, match="multiple of"):
        cpu_kernels.fp8_matmul(torch.zeros(2, 20), torch.zeros(4, 20, dtype=torch.uint8))


def test_fp8_linear_takes_the_kernel_for_a_few_rows(monkeypatch):
    """layers/fp8.py's CPU product: the kernel up to CPU_KERNEL_MAX_ROWS rows (its exact
    sum, scaled as torch's float8 GEMM scales), torch's float8 GEMM past them or with
    the kernels switched off (float32 sums: within their rounding of that)."""
    from spindle.layers import fp8

    gen = torch.Generator().manual_seed(9)
    q, scale = fp8.quantize_rows(torch.randn(48, 64, generator=gen))
    calls = []
    real = cpu_kernels.fp8_matmul
    monkeypatch.setattr(cpu_kernels, "fp8_matmul", lambda *a: calls.append(1) or real(*a))
    for rows, launches in ((1, 1), (fp8.CPU_KERNEL_MAX_ROWS, 1), (fp8.CPU_KERNEL_MAX_ROWS + 1, 0)):
        calls.clear()
        x = torch.randn(rows, 64, generator=gen)
        got = fp8.fp8_linear(x, q, scale)
        assert len(calls) == launches
        xq, x_scale = fp8.quantize_rows(x)
        exact = (xq.double() @ q.double().T).float() * (x_scale[:, None] * scale[None, :])
        if launches:
            assert torch.equal(got, exact)
        monkeypatch.setenv("SPINDLE_CPU_KERNELS", "0")
        torch.testing.assert_close(fp8.fp8_linear(x, q, scale), exact, rtol=1e-5, atol=1e-5)
        monkeypatch.delenv("SPINDLE_CPU_KERNELS")
