"""The skinny (decode-sized) Triton GEMM against a float32 torch reference, on fresh
random inputs with poisoned outputs, in bf16 and fp16; and when the layers use it."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import DEVICE, HALF, INTERPRETED, KernelStub, pick

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]
# (The interpreter gives the kernel float32 dot operands: see skinny_linear. Its bf16
# path therefore checks the loads, masks and stores, not the bf16 products.)
DTYPES = [torch.bfloat16, torch.float16]
# Qwen3-0.6B's qkv, gate_up, o_proj and down_proj (the last two split K), then shapes
# whose N is not a multiple of the 64-row tile.
QWEN_SHAPES = [(4096, 1024), (6144, 1024), (1024, 2048), (1024, 3072)]
TAIL_SHAPES = pick([(1000, 256), (1000, 1024), (151936, 1024)], [(1000, 256), (200, 1024)])
# The interpreter runs a Qwen-sized launch in about a second: small shapes take the
# same paths there (one tile row per program, split K by a power of two and by 3).
SMALL_SHAPES = [(256, 1024), (192, 768)]


def _inputs(m, n, k, dtype, with_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5  # outputs of order one, as in a model
    b = torch.randn(n, generator=gen) if with_bias else None
    to = dict(dtype=dtype, device=DEVICE)
    return x.to(**to), w.to(**to), (b.to(**to) if b is not None else None)


def _reference(x, w, b):
    ref = x.float().cpu() @ w.float().cpu().T
    return ref + b.float().cpu() if b is not None else ref


def _check(out, ref, dtype):
    """bf16/fp16 output of a float32 accumulation: one rounding step from the reference
    rounded the same way (rtol 1.6e-2), and a relative norm error under 1e-2."""
    out = out.float().cpu()
    assert not out.isnan().any(), "unwritten (NaN-poisoned) outputs"
    torch.testing.assert_close(out, ref.to(dtype).float(), rtol=1.6e-2, atol=1e-2)
    assert (out - ref).norm() / ref.norm() < 1e-2


def _run(x, w, b, **kwargs):
    from spindle.layers.skinny_gemm import new_split_counters, skinny_linear

    kwargs.setdefault("counters", new_split_counters(w.shape[0], x.device))
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    y = skinny_linear(x, w, b, out=out, **kwargs)
    assert y.data_ptr() == out.data_ptr()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", pick(QWEN_SHAPES, SMALL_SHAPES) + TAIL_SHAPES)
@pytest.mark.parametrize("m", pick([1, 2, 3, 4, 8, 12, 16], [1, 3, 8, 16]))
def test_skinny_linear(m, n, k, dtype, with_bias):
    x, w, b = _inputs(m, n, k, dtype, with_bias, seed=hash((m, n, k, with_bias)) % 1000)
    _check(_run(x, w, b), _reference(x, w, b), dtype)


@pytest.mark.parametrize("n,k", pick(QWEN_SHAPES, SMALL_SHAPES) + TAIL_SHAPES)
@pytest.mark.parametrize("m", pick([17, 24, 32, 33, 64, 100, 128, 129, 200, 256], [17, 100, 200]))
def test_skinny_linear_row_blocks(m, n, k):
    """More than 16 rows: row blocks of 32 to 128 (block_m), several of them past 128,
    each with its split-K counters (they are left at zero for the next launch)."""
    from spindle.layers.skinny_gemm import new_split_counters

    x, w, b = _inputs(m, n, k, HALF, True, seed=hash((m, n, k)) % 1000)
    counters = new_split_counters(n, x.device)
    _check(_run(x, w, b, counters=counters), _reference(x, w, b), HALF)
    assert not counters.any()


def test_block_m_follows_the_rows():
    from spindle.layers.skinny_gemm import MAX_M, block_m

    assert [block_m(m) for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, MAX_M)] == [
        16, 16, 32, 32, 64, 64, 128, 128, 128, 128]


@pytest.mark.parametrize("rows_block,split", [(16, 2), (64, 1), (256, 1), (256, 2)])
def test_a_configs_row_block_replaces_the_engines(monkeypatch, rows_block, split):
    """SkinnyConfig.block_m (a measuring knob): 100 rows in blocks of 16 (seven, the
    last partly masked), 64 or one block of 256, K split or not; each output tile's
    counter left at zero."""
    from spindle.layers import skinny_gemm
    from spindle.layers.skinny_gemm import SkinnyConfig, row_blocks

    m_tiles = -(-100 // rows_block)
    assert row_blocks(100, rows_block) == {"rows_block": rows_block, "m_tiles": m_tiles}
    stub = KernelStub(skinny_gemm._skinny_gemm_kernel)
    monkeypatch.setattr(skinny_gemm, "_skinny_gemm_kernel", stub)
    x, w, b = _inputs(100, 192, 256, HALF, True, seed=rows_block + split)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    cfg = SkinnyConfig(block_n=64, block_k=64, split_k=split, num_warps=4, num_stages=2,
                       block_m=rows_block)
    _check(_run(x, w, b, config=cfg, counters=counters), _reference(x, w, b), HALF)
    assert [grid for grid, _ in stub.launches] == [(m_tiles, 3, split)]
    assert not counters.any()


@pytest.mark.parametrize("rows_block", [0, 8, 48, 512])
def test_a_row_block_must_be_a_power_of_two_within_the_kernels(rows_block):
    from spindle.layers.skinny_gemm import SkinnyConfig

    x, w, b = _inputs(4, 64, 64, HALF, False, seed=0)
    with pytest.raises(ValueError, match="row block must be a power of two from 16 to 256"):
        _run(x, w, b, config=SkinnyConfig(block_m=rows_block))


@pytest.mark.skipif(INTERPRETED, reason="too slow for the interpreter: the small shapes "
                    "take the same paths there")
@pytest.mark.parametrize("n,k", QWEN_SHAPES)
def test_skinny_linear_qwen_shapes(n, k):
    """The real shapes once each (all of them run in test_skinny_linear on a GPU)."""
    m, dtype = 3, torch.bfloat16
    x, w, b = _inputs(m, n, k, dtype, True, seed=n + k)
    _check(_run(x, w, b), _reference(x, w, b), dtype)


@pytest.mark.parametrize("split_k,block_k,k", [(3, 128, 512), (4, 64, 272), (1, 128, 272),
                                               (5, 32, 1024)])
def test_skinny_linear_masked_k(split_k, block_k, k):
    """Splits and K that do not divide into whole blocks: the K tail is masked, and a
    split past the end of K contributes zeros."""
    from spindle.layers.skinny_gemm import SkinnyConfig

    x, w, b = _inputs(4, 200, k, torch.bfloat16, True, seed=k + split_k)
    out = _run(x, w, b, config=SkinnyConfig(block_n=32, block_k=block_k, split_k=split_k))
    _check(out, _reference(x, w, b), torch.bfloat16)


def test_split_k_is_deterministic_and_rearms_its_counters():
    """The last split sums the partials in split order, so repeated launches agree
    bit for bit; and it leaves the arrival counters at zero, as a graph replay needs."""
    from spindle.layers.skinny_gemm import SkinnyConfig, new_split_counters

    # (One row block; two, each output tile with its own counter.)
    for m, k, split in ((8, 2048, 8), (200, 512, 4)):
        x, w, _ = _inputs(m, pick(1024, 256), k, torch.bfloat16, False, seed=7)
        cfg = SkinnyConfig(split_k=split)
        counters = new_split_counters(w.shape[0], x.device)
        first = _run(x, w, None, config=cfg, counters=counters)
        for _ in range(3):
            assert torch.equal(_run(x, w, None, config=cfg, counters=counters), first)
        assert not counters.any()
        _check(first, _reference(x, w, None), torch.bfloat16)


def test_strided_and_3d_inputs():
    from spindle.layers.skinny_gemm import skinny_linear

    x, w, b = _inputs(3, 192, 256, torch.bfloat16, True, seed=3)
    wide = torch.randn(3, 512, dtype=x.dtype, device=x.device)
    wide[:, :256] = x
    _check(skinny_linear(wide[:, :256], w, b), _reference(x, w, b), torch.bfloat16)
    y = skinny_linear(x.reshape(1, 3, 256), w, b)
    assert y.shape == (1, 3, 192)
    _check(y[0], _reference(x, w, b), torch.bfloat16)


def test_check_rejects_a_wrong_output():
    """The tolerance is tight enough to fail: one output off by a bf16 step of 0.1, or
    a result that dropped one of eight K splits."""
    x, w, b = _inputs(2, 256, 1024, torch.bfloat16, False, seed=11)
    ref = _reference(x, w, b)
    out = _run(x, w, b)
    _check(out, ref, torch.bfloat16)
    bad = out.clone()
    bad[1, 17] += 0.1
    with pytest.raises(AssertionError):
        _check(bad, ref, torch.bfloat16)
    with pytest.raises(AssertionError):
        _check(_run(x[:, 128:], w[:, 128:].contiguous(), b), ref, torch.bfloat16)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", pick([(1024, 3072), (1000, 272)], [(192, 768), (200, 272)]))
@pytest.mark.parametrize("m", pick([1, 3, 8, 16], [1, 3, 16]))
def test_silu_and_mul_applied_as_it_loads(m, n, k, with_bias):
    """silu_and_mul=True on [gate | up]: bit for bit the activation kernel then the
    GEMM (split K and a masked K tail included), and close to the float32 definition."""
    from spindle.layers.fused_kernels import silu_and_mul

    gate_up, w, b = _inputs(m, n, 2 * k, HALF, with_bias, seed=m + n + k)
    w = w[:, :k].contiguous() * 2 ** 0.5  # (outputs of order one again)
    fused = _run(gate_up, w, b, silu_and_mul=True)
    assert torch.equal(fused, _run(silu_and_mul(gate_up), w, b))
    h = gate_up.float().cpu()
    act = torch.nn.functional.silu(h[:, :k]) * h[:, k:]
    _check(fused, _reference(act, w, b), HALF)


def test_silu_and_mul_needs_twice_the_weights_columns():
    from spindle.layers.skinny_gemm import skinny_linear

    x, w, _ = _inputs(2, 64, 256, HALF, False, seed=1)
    with pytest.raises(ValueError, match=r"x \[M, 2K\]"):
        skinny_linear(x, w, silu_and_mul=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers dispatch on CUDA only")
@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_mlp_fuses_its_activation_into_the_down_projection(monkeypatch, switch):
    """LlamaMLP on a decode-sized CUDA batch: the same bits with the activation applied
    in the down projection's loads (one launch fewer) as with its own kernel; more rows
    than the skinny GEMM takes, or SPINDLE_SKINNY_SILU=0, keep the separate kernel."""
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers import fused_kernels, skinny_gemm
    from spindle.models.llama import LlamaMLP

    monkeypatch.setenv("SPINDLE_SKINNY_SILU", switch)
    with torch.device("cuda"):
        mlp = LlamaMLP(1024, 3072, bias=False, tp_group=TensorParallelGroup(rank=0, size=1))
    for p in mlp.parameters():
        p.data = (torch.randn_like(p, dtype=torch.float32) / 32).to(torch.bfloat16).cuda()
    activations = []
    real = fused_kernels.silu_and_mul
    monkeypatch.setattr(fused_kernels, "silu_and_mul",
                        lambda x: activations.append(len(x)) or real(x))
    bound = min(skinny_gemm.max_rows(), skinny_gemm.SILU_MAX_M)
    for m in (1, bound, bound + 1):
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        expected = mlp.down_proj(real(mlp.gate_up_proj(x)))
        assert torch.equal(mlp(x), expected)
    assert activations == ([bound + 1] if switch == "1" else [1, bound, bound + 1])


def test_when_the_skinny_gemm_applies(monkeypatch):
    from spindle.layers.skinny_gemm import skinny_gemm_applies, use_skinny_gemm

    w = torch.randn(64, 256, dtype=torch.bfloat16)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    monkeypatch.delenv("SPINDLE_SKINNY_GEMM", raising=False)
    assert skinny_gemm_applies(x, w)  # default on
    assert skinny_gemm_applies(x[:1], w)
    assert not use_skinny_gemm(x, w)  # CPU tensors keep F.linear
    assert skinny_gemm_applies(torch.randn(16, 256, dtype=torch.bfloat16), w)
    assert not skinny_gemm_applies(torch.randn(17, 256, dtype=torch.bfloat16), w)  # M > 16
    monkeypatch.setenv("SPINDLE_SKINNY_MAX_M", "256")
    assert skinny_gemm_applies(torch.randn(256, 256, dtype=torch.bfloat16), w)
    assert not skinny_gemm_applies(torch.randn(257, 256, dtype=torch.bfloat16), w)
    monkeypatch.delenv("SPINDLE_SKINNY_MAX_M")
    assert not skinny_gemm_applies(x.float(), w.float())
    assert not skinny_gemm_applies(x[:, :248], w[:, :248].contiguous())  # K % 16
    assert not skinny_gemm_applies(x, w.T.contiguous().T)  # non-contiguous weight
    assert not skinny_gemm_applies(x[0], w)  # 1-D
    monkeypatch.setenv("SPINDLE_SKINNY_GEMM", "0")
    assert not skinny_gemm_applies(x, w)
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert not use_skinny_gemm(xc, wc)
        monkeypatch.setenv("SPINDLE_SKINNY_GEMM", "1")
        assert use_skinny_gemm(xc, wc) and not use_skinny_gemm(xc.repeat(3, 1), wc)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers dispatch on CUDA only")
@pytest.mark.parametrize("skinny", ["1", "0"])
def test_layers_match_f_linear(monkeypatch, skinny):
    """Column/row parallel layers and the LM head, with and without the skinny GEMM."""
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers.embedding import ParallelLMHead
    from spindle.layers.linear import ColumnParallelLinear, RowParallelLinear

    monkeypatch.setenv("SPINDLE_SKINNY_GEMM", skinny)
    group = TensorParallelGroup(rank=0, size=1)
    with torch.device("cuda"):  # (their split-K counters are buffers: on the device too)
        col = ColumnParallelLinear(1024, 4096, bias=True, tp_group=group)
        row = RowParallelLinear(2048, 1024, tp_group=group)
        head = ParallelLMHead(1000, 1024, tp_group=group)
    for layer in (col, row, head):
        for p in layer.parameters():
            p.data = (torch.randn_like(p, dtype=torch.float32) / 32).to(torch.bfloat16).cuda()
    for m in (1, 4, 8):
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        _check(col(x), _reference(x, col.weight, col.bias), torch.bfloat16)
        x2 = torch.randn(m, 2048, dtype=torch.bfloat16, device="cuda")
        _check(row(x2), _reference(x2, row.weight, None), torch.bfloat16)
        _check(head.compute_logits(x), _reference(x, head.weight, None), torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("n,k", [(1024, 2048), (6144, 1024)])
def test_cuda_graph_replays(n, k):
    """Captured once (split K included), replayed on new inputs: every replay matches."""
    from spindle.layers.skinny_gemm import new_split_counters, skinny_linear

    x, w, b = _inputs(4, n, k, torch.bfloat16, True, seed=n)
    counters = new_split_counters(n, x.device)
    skinny_linear(x, w, b, counters=counters)  # warm-up outside the graph, as the runner does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, w, b, counters=counters)
    for seed in range(3):
        x.copy_(_inputs(4, n, k, torch.bfloat16, False, seed=100 + seed)[0])
        y.fill_(float("nan"))
        graph.replay()
        _check(y, _reference(x, w, b), torch.bfloat16)


def _fp8_inputs(m, n, k, dtype, with_bias, seed):
    """bf16/fp16 activations and a float8 weight with its per-row scales."""
    from spindle.layers.fp8 import quantize_rows

    x, w, b = _inputs(m, n, k, dtype, with_bias, seed)
    q, scale = quantize_rows(w)
    return x, q, scale, b


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", pick(QWEN_SHAPES, SMALL_SHAPES) + TAIL_SHAPES[:2])
@pytest.mark.parametrize("m", pick([1, 2, 4, 8, 16], [1, 8, 16]))
def test_skinny_linear_fp8_weight(m, n, k, with_bias):
    """A float8 weight widened in registers and scaled per row (split K included) equals
    the product with the dequantized weight."""
    x, q, scale, b = _fp8_inputs(m, n, k, HALF, with_bias, seed=hash((m, n, k)) % 1000)
    dequantized = q.float() * scale[:, None]
    _check(_run(x, q, b, weight_scale=scale), _reference(x, dequantized, b), HALF)


def test_fp8_weight_needs_its_scale_to_apply():
    from spindle.layers.skinny_gemm import skinny_gemm_applies, skinny_linear

    x, q, scale, _ = _fp8_inputs(2, 64, 256, HALF, False, seed=1)
    assert skinny_gemm_applies(x, q, scale)
    assert not skinny_gemm_applies(x, q)  # a float8 weight without scales
    assert not skinny_gemm_applies(x, q.to(HALF), scale)  # scales for a half weight
    with pytest.raises(ValueError, match="weight_scale must be a float32 \\[64\\]"):
        skinny_linear(x, q, weight_scale=scale[:32])


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("n,k,split", pick([(1024, 2048, 8), (1024, 3072, 12)],
                                           [(256, 1024, 4), (192, 768, 3)]))
@pytest.mark.parametrize("m", pick([1, 3, 8, 40, 200], [1, 3, 40]))
def test_deferred_merge_gives_the_merged_bits(m, n, k, split, silu):
    """defer_merge: the partials left unsummed add up (merged(), and the fused RMSNorm
    as it loads them, with and without a residual) to the bits the GEMM's own merge
    stores; a residual add and norm of those bits is what the norm of the partials
    gives."""
    from spindle.layers.fused_kernels import rms_norm
    from spindle.layers.skinny_gemm import (SkinnyConfig, SplitKPartials, merged,
                                            new_split_counters, skinny_linear)

    from spindle.layers.skinny_gemm import SILU_MAX_M

    gen = torch.Generator().manual_seed(m * 1000 + n + split)
    x = torch.randn(m, 2 * k if silu else k, generator=gen).to(HALF).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(HALF).to(DEVICE)
    weight = (1 + torch.randn(n, generator=gen) / 8).to(HALF).to(DEVICE)
    residual = torch.randn(m, n, generator=gen).to(HALF).to(DEVICE)
    cfg = SkinnyConfig(split_k=split)
    counters = new_split_counters(n, x.device)
    if silu and m > SILU_MAX_M:  # (its gate and up tiles would overflow shared memory)
        with pytest.raises(ValueError, match="at most 256 rows, and 64 with silu_and_mul"):
            skinny_linear(x, w, config=cfg, counters=counters, silu_and_mul=silu)
        return
    stored = skinny_linear(x, w, config=cfg, counters=counters, silu_and_mul=silu)
    parts = skinny_linear(x, w, config=cfg, counters=counters, silu_and_mul=silu,
                          defer_merge=True)
    assert isinstance(parts, SplitKPartials) and parts.partials.shape[0] == split
    assert not counters.any()  # (the deferred launch counts no arrivals)
    assert torch.equal(merged(parts), stored) and merged(stored) is stored
    assert torch.equal(rms_norm(parts, weight, 1e-6), rms_norm(stored, weight, 1e-6))
    y, summed = rms_norm(parts, weight, 1e-6, residual)
    y_ref, summed_ref = rms_norm(stored, weight, 1e-6, residual)
    assert torch.equal(y, y_ref) and torch.equal(summed, summed_ref)


def test_deferred_merge_only_where_k_is_split_without_bias():
    """No split (one program per N tile has the whole sum), a bias, or no counters:
    the output is stored as usual."""
    from spindle.layers.skinny_gemm import SkinnyConfig, new_split_counters, skinny_linear

    x, w, b = _inputs(2, 256, 1024, HALF, True, seed=3)
    counters = new_split_counters(256, x.device)
    for kwargs in (dict(config=SkinnyConfig(split_k=1), counters=counters),
                   dict(config=SkinnyConfig(split_k=4)),  # (no counters: no split)
                   dict(config=SkinnyConfig(split_k=4), counters=counters, bias=b)):
        assert isinstance(skinny_linear(x, w, defer_merge=True, **kwargs), torch.Tensor)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers dispatch on CUDA only")
def test_the_mlp_defers_its_merge_to_the_norm(monkeypatch):
    """LlamaMLP on a decode-sized CUDA batch, asked to defer: its down projection leaves
    its partials to the next RMSNorm (up to skinny_gemm.max_rows() rows), and they give
    that norm the bits of the merged output; one row more (cuBLAS) gives a tensor, and so
    does one row where the TMA GEMV takes it (it does not split K)."""
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers import skinny_gemm, tma_gemv
    from spindle.layers.norm import RMSNorm
    from spindle.models.llama import LlamaMLP

    with torch.device("cuda"):
        mlp = LlamaMLP(1024, 3072, bias=False, tp_group=TensorParallelGroup(rank=0, size=1))
        norm = RMSNorm(1024)
    for p in list(mlp.parameters()) + list(norm.parameters()):
        p.data = (torch.randn_like(p, dtype=torch.float32) / 32).to(torch.bfloat16).cuda()
    bound = skinny_gemm.max_rows()
    for m in (1, bound, bound + 1):
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        deferred = mlp(x, defer_merge=True)
        stored = mlp(x)
        tma = m == 1 and tma_gemv.tma_gemv_applies(stored.new_empty(1, 6144),
                                                     mlp.down_proj.weight, silu_and_mul=True)
        assert isinstance(deferred, skinny_gemm.SplitKPartials) == (m <= bound and not tma)
        assert torch.equal(skinny_gemm.merged(deferred), stored)
        for a, b in zip(norm(deferred, residual), norm(stored, residual)):
            assert torch.equal(a, b)


def test_pick_config_splits_k_only_for_few_n_tiles():
    """On 132 SMs: Qwen3-0.6B's qkv and gate_up (64 and 96 N tiles) run unsplit in
    256-deep K tiles, o_proj and down_proj (16 tiles) split K to about the SM count,
    the LM head's 2374 tiles keep the base tiles; a K that 256 does not divide keeps
    128."""
    from spindle.layers.skinny_gemm import SkinnyConfig, pick_config

    def chosen(n, k):
        cfg = pick_config(n, k, 132)
        return cfg.split_k, cfg.block_k

    assert chosen(4096, 1024) == (1, 256)
    assert chosen(6144, 1024) == (1, 256)
    assert chosen(1024, 2048) == (8, 128)
    assert chosen(1024, 3072) == (12, 128)
    assert chosen(151936, 1024) == (1, 128)
    assert chosen(4096, 1152) == (1, 128)
    assert pick_config(4096, 1024, 132, SkinnyConfig(block_k=512)).block_k == 512


def test_pick_config_counts_row_blocks():
    """Row blocks count as programs (down_proj at 256 rows: 2 x 16 tiles, so 6 splits
    reach the SMs where one block needs 12); blocks of 64 rows and more keep K tiles of
    128 (their x tile would not fit shared memory beside a 256-deep W tile)."""
    from spindle.layers.skinny_gemm import SkinnyConfig, base_config, pick_config

    assert pick_config(1024, 3072, 132, rows_block=16).split_k == 12
    assert pick_config(1024, 2048, 132, rows_block=128, m_tiles=2).split_k == 8
    assert pick_config(1024, 2048, 132, rows_block=128, m_tiles=1).split_k == 8
    assert pick_config(1024, 3072, 132, rows_block=128, m_tiles=2).split_k == 6
    assert pick_config(4096, 1024, 132, rows_block=32).block_k == 256
    assert pick_config(4096, 1024, 132, rows_block=64).block_k == 128
    assert pick_config(4096, 1024, 132, rows_block=128, m_tiles=2).split_k == 1
    assert base_config(128).num_warps == 8 and base_config(16) == SkinnyConfig()

