"""A Triton GEMM for decode-sized batches: y = x W^T (+ b) with x [M, K], M <= 8.

At M = 1..8 a linear layer is a pass over its weight: cuBLAS reaches about a quarter
of an H200's memory bandwidth at these shapes. Here each program streams a
[BLOCK_N, BLOCK_K] tile of W along K (K is contiguous: coalesced, pipelined loads),
multiplies it by the M rows of x (padded to 16 for the matrix units; x is tiny and
stays in cache) and accumulates in float32. When N alone gives too few programs to
fill the chip (o_proj, down_proj), K is split as well; the program of an N tile that
finishes last sums the splits' partials in a fixed order, so results do not depend on
arrival order and there is no second launch. The grid depends only on (M, N, K):
CUDA graphs can capture it. This module knows nothing of layers or parallelism.

skinny_norm_linear also applies the RMSNorm before the layer (with the residual add)
as x is loaded: a decoder layer's two norms then cost no launch of their own. Each
program computes the rows' statistics itself (a row is a few KB, read from cache).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from spindle.layers.fused_kernels import silu_mul
from spindle.layers.linear import new_split_counters  # noqa: F401 (part of this API)

MAX_M = 8
_BLOCK_M = 16  # the smallest dot operand Triton takes; rows >= M are masked
_DTYPES = (torch.bfloat16, torch.float16)


def use_skinny_gemm(x: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor | None = None) -> bool:
    """Whether skinny_linear should replace F.linear(x, weight): CUDA tensors that
    skinny_gemm_applies to."""
    return x.is_cuda and skinny_gemm_applies(x, weight, weight_scale)


def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor,
                        weight_scale: torch.Tensor | None = None) -> bool:
    """A decode-sized 2-D half-precision input, a contiguous weight of its dtype (or
    float8 e4m3 with a float32 scale per row: weight_scale) with K a multiple of 16 on
    the same device, and SPINDLE_SKINNY_GEMM not "0" (the switch for A/B runs). (The
    device type is use_skinny_gemm's business.)"""
    weight_dtype = x.dtype if weight_scale is None else torch.float8_e4m3fn
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_M and x.dtype in _DTYPES
            and weight.dtype == weight_dtype and weight.dim() == 2
            and weight.shape[1] == x.shape[1] and weight.shape[1] % 16 == 0
            and weight.is_contiguous() and weight.device == x.device
            and os.environ.get("SPINDLE_SKINNY_GEMM", "1") != "0")


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None,
                  counters: torch.Tensor | None = None,
                  weight_scale: torch.Tensor | None = None,
                  silu_and_mul: bool = False) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) in float32, returned in x's dtype.

    out: an optional [M, N] contiguous destination. config: block sizes and split-K
    (default: pick_config's choice for the shape; benchmarks sweep it). counters: the
    caller's new_split_counters(N); without them the K dimension is not split.
    weight_scale: a float32 [N] scale per row of a float8 weight (W = weight * scale),
    which is widened to x's dtype tile by tile. silu_and_mul: x is [..., 2K] = [gate |
    up] and the product is of silu(gate) * up, computed as it is loaded, rounded where
    fused_kernels.silu_and_mul rounds (a SwiGLU MLP's down projection without the
    activation's own launch)."""
    return _skinny_gemm(x, weight, bias, out, config, counters, weight_scale, silu_and_mul)


def _skinny_gemm(x, weight, bias, out, config, counters, weight_scale, silu_and_mul,
                 norm: "_RowNorm | None" = None) -> torch.Tensor:
    """skinny_linear's checks and launch; norm: skinny_norm_linear's RMSNorm."""
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if x.shape[1] != (2 * k if silu_and_mul else k) or not weight.is_contiguous():
        raise ValueError(f"skinny_linear needs a contiguous weight [N, K] with x [M, "
                         f"{'2K' if silu_and_mul else 'K'}], got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)} (contiguous={weight.is_contiguous()})")
    if m > MAX_M:
        raise ValueError(f"skinny_linear serves at most {MAX_M} rows, got {m}")
    if weight_scale is not None and (weight_scale.shape != (n,)
                                     or weight_scale.dtype != torch.float32):
        raise ValueError(f"weight_scale must be a float32 [{n}] tensor, got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor")
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
        return out.reshape(*lead, n)
    _launch(x, weight, bias, out, config, counters, weight_scale, silu_and_mul, norm)
    return out.reshape(*lead, n)


@dataclass(frozen=True)
class _RowNorm:
    """The RMSNorm that skinny_norm_linear applies to x's rows as they load."""
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None  # added to x first (the sum is the new residual)
    new_residual: torch.Tensor | None


# Rows up to which skinny_norm_linear is worth its prologue: each row's statistics are
# one more wait on memory before the weights stream (measured: docs/benchmarks.md).
NORM_MAX_M = 8
# The widest row the prologue holds in registers at once.
NORM_MAX_K = 8192


def skinny_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_norm_linear takes x [M, K] and weight [N, K]: what the skinny GEMM
    takes (use_skinny_gemm, a half-precision weight), at most NORM_MAX_M rows and
    NORM_MAX_K columns, a contiguous x, and SPINDLE_SKINNY_NORM not "0"."""
    return (use_skinny_gemm(x, weight) and x.shape[0] <= NORM_MAX_M
            and x.shape[1] <= NORM_MAX_K and x.is_contiguous()
            and os.environ.get("SPINDLE_SKINNY_NORM", "1") != "0")


def skinny_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, residual: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None,
                       counters: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h) @ weight^T (+ bias), h) with h = x + residual (or x): a pre-norm
    layer's norm and the projection after it in one launch, the same bits as
    fused_kernels.rms_norm and then skinny_linear. x and residual are [M, K],
    contiguous, of one dtype; norm_weight [K]. h is a new tensor (x itself without a
    residual)."""
    m, k = x.shape
    if (not x.is_contiguous() or norm_weight.shape != (k,) or norm_weight.dtype != x.dtype
            or (residual is not None and (residual.shape != x.shape
                                          or residual.dtype != x.dtype
                                          or not residual.is_contiguous()))):
        raise ValueError(
            f"skinny_norm_linear needs a contiguous x [M, K] with a [K] norm weight and a "
            f"residual like x, all of one dtype; got x {x.dtype} {tuple(x.shape)}, norm "
            f"weight {norm_weight.dtype} {tuple(norm_weight.shape)}, residual "
            f"{None if residual is None else (residual.dtype, tuple(residual.shape))}")
    if k > NORM_MAX_K:
        raise ValueError(f"skinny_norm_linear holds rows of at most {NORM_MAX_K}, got {k}")
    new_residual = torch.empty_like(x) if residual is not None else x
    out = _skinny_gemm(x, weight, bias, None, None, counters, None, False,
                       _RowNorm(norm_weight, eps, residual, new_residual))
    return out, new_residual


def _launch(x, weight, bias, out, config, counters, weight_scale, silu_and_mul,
            norm: _RowNorm | None = None) -> None:
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    cfg = config or _default_config(n, k, x.device)
    n_tiles = triton.cdiv(n, cfg.block_n)
    if counters is None or n_tiles > counters.numel():
        cfg = replace(cfg, split_k=1)
    split, block_k = cfg.split_k, cfg.block_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    partials = (torch.empty(split, m, n_tiles * cfg.block_n, dtype=torch.float32,
                            device=x.device) if split > 1 else out)
    add_residual = norm is not None and norm.residual is not None
    _skinny_gemm_kernel[(n_tiles, split)](
        x, weight, bias if bias is not None else weight,
        weight_scale if weight_scale is not None else weight, out, partials,
        counters if counters is not None else out,
        norm.weight if norm is not None else x, norm.residual if add_residual else x,
        norm.new_residual if add_residual else x,
        m, n, k, x.stride(0), k_per_split, norm.eps if norm is not None else 0.0,
        HAS_BIAS=bias is not None, HAS_SCALE=weight_scale is not None, SPLIT_K=split,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, EVEN_K=k == split * k_per_split,
        # CPU tensors reach a Triton kernel only under Triton's interpreter, which
        # multiplies bf16 dot operands as raw integers: it gets float32 operands (bf16 x
        # bf16 products are exact in float32, as in the matrix units).
        IEEE=x.dtype == torch.float32 or not x.is_cuda, SILU_MUL=silu_and_mul,
        NORM=norm is not None, ADD_RESIDUAL=add_residual, MAX_ROWS=MAX_M,
        BLOCK_KF=triton.next_power_of_2(k) if norm is not None else 16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def pick_config(n: int, k: int, num_sms: int,
                base: SkinnyConfig = SkinnyConfig()) -> SkinnyConfig:
    """base's tiles (64 x 128); K split when the N tiles alone are fewer than num_sms.

    The split divides K into whole BLOCK_K chunks (no masked tail), keeps at least two
    chunks per program so its loads pipeline, and is the smallest such divisor that
    reaches num_sms programs (else the largest there is). Qwen3-0.6B on 132 SMs:
    qkv 4096x1024 -> 64 tiles x 4 splits, gate_up 6144x1024 -> 96 x 2, o_proj
    1024x2048 -> 16 x 8, down_proj 1024x3072 -> 16 x 12, LM head 151936x1024 -> 2374."""
    n_tiles = triton.cdiv(n, base.block_n)
    if n_tiles >= num_sms or k % base.block_k:
        return replace(base, split_k=1)
    chunks = k // base.block_k
    splits = [d for d in range(1, chunks // 2 + 1) if chunks % d == 0] or [1]
    return replace(base, split_k=next((d for d in splits if n_tiles * d >= num_sms),
                                      splits[-1]))


@functools.lru_cache(maxsize=None)
def _default_config(n: int, k: int, device: torch.device) -> SkinnyConfig:
    return pick_config(n, k, _num_sms(device))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: plan as for an H200
    return torch.cuda.get_device_properties(device).multi_processor_count




# M (1..8) is not specialized (Triton would compile M == 1 apart): one variant per
# shape and config serves every decode batch, so nothing compiles after warm-up.
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, part_ptr, counters_ptr,
                        nw_ptr, r_ptr, new_r_ptr,
                        M, N, K, x_stride, k_per_split, eps,
                        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        IEEE: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr,
                        ADD_RESIDUAL: tl.constexpr, MAX_ROWS: tl.constexpr,
                        BLOCK_KF: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = split * k_per_split + tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    if NORM:  # 1 / rms of each row (after the residual add), as _rms_norm_kernel has it
        inv_rms = _rows_inv_rms(x_ptr, r_ptr, new_r_ptr, M, K, eps,
                                (pid_n == 0) & (split == 0), ADD_RESIDUAL, BLOCK_M,
                                MAX_ROWS, BLOCK_KF)
    # The tail tile rereads row N - 1 instead of masking, so W loads stay unmasked.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :] * x_stride + offs_k[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    # y^T = W x^T: W is the dot's wide operand, so M pads only the narrow one.
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x_mask = m_valid[None, :]
        else:
            k_valid = offs_k + k0 < K
            w = tl.load(w_ptrs, mask=k_valid[None, :], other=0.0)
            x_mask = k_valid[:, None] & m_valid[None, :]
        xt = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if NORM:  # (x is contiguous here: x_stride == K)
            xt = _norm_tile(xt, r_ptr + offs_m[None, :] * K + (offs_k + k0)[:, None],
                            nw_ptr + offs_k + k0, offs_k + k0 < K, inv_rms, x_mask,
                            ADD_RESIDUAL)
        if SILU_MUL:  # xt is the gate; the up half starts K columns on
            xt = silu_mul(xt, tl.load(x_ptrs + K, mask=x_mask, other=0.0))
        if HAS_SCALE:
            w = w.to(xt.dtype)  # float8 -> the activations' dtype: exact
        if IEEE:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[None, :] * N + offs_n[:, None]
    y_mask = m_valid[None, :] & (offs_n < N)[:, None]
    if SPLIT_K == 1:
        _store_output(acc, b_ptr, s_ptr, rows, y_ptrs, y_mask, HAS_BIAS, HAS_SCALE)
    else:
        # partials [SPLIT_K, M, n_tiles * BLOCK_N]: whole tiles, so no N mask.
        width = tl.num_programs(0) * BLOCK_N
        part = part_ptr + offs_m[None, :] * width + offs_n[:, None]
        tl.store(part + split * M * width, acc, mask=m_valid[None, :])
        # Every thread's partial is written before the arrival is counted (release);
        # the program that arrives last sees all partials (acquire) and sums them in
        # split order, whichever order the splits finished in.
        tl.debug_barrier()
        counter = counters_ptr + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part + s * M * width, mask=m_valid[None, :], other=0.0,
                                 cache_modifier=".cg")
            _store_output(total, b_ptr, s_ptr, rows, y_ptrs, y_mask, HAS_BIAS, HAS_SCALE)
            tl.store(counter, 0)  # ready for the next launch


@triton.jit
def _rows_inv_rms(x_ptr, r_ptr, new_r_ptr, M, K, eps, writer, ADD_RESIDUAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, MAX_ROWS: tl.constexpr, BLOCK_KF: tl.constexpr):
    """[BLOCK_M] float32: rsqrt(mean(h^2) + eps) of rows h = x (+ residual) < M (x and the
    residual contiguous [M, K]). Row by row, each reduced as _rms_norm_kernel reduces
    its row, so the statistics are the same bits. writer: this program also stores the
    rows h into new_r_ptr (the layer's new residual)."""
    offs_f = tl.arange(0, BLOCK_KF)
    f_valid = offs_f < K
    offs_m = tl.arange(0, BLOCK_M)
    inv_rms = tl.zeros([BLOCK_M], tl.float32)
    for m in tl.static_range(MAX_ROWS):
        if m < M:
            row = tl.load(x_ptr + m * K + offs_f, mask=f_valid, other=0.0)
            if ADD_RESIDUAL:
                row = (row.to(tl.float32) + tl.load(r_ptr + m * K + offs_f, mask=f_valid,
                                                    other=0.0).to(tl.float32)).to(row.dtype)
                if writer:
                    tl.store(new_r_ptr + m * K + offs_f, row, mask=f_valid)
            h = row.to(tl.float32)
            variance = tl.sum(h * h, 0) / K
            inv_rms = tl.where(offs_m == m, tl.math.rsqrt(variance + eps), inv_rms)
    return inv_rms


@triton.jit
def _norm_tile(xt, r_ptrs, nw_ptrs, k_valid, inv_rms, x_mask, ADD_RESIDUAL: tl.constexpr):
    """The normalized rows of an x^T tile [BLOCK_K, BLOCK_M]: (the residual tile at r_ptrs
    added,) scaled by inv_rms, rounded, times the norm weight, rounded: where
    _rms_norm_kernel rounds."""
    if ADD_RESIDUAL:
        xt = (xt.to(tl.float32) + tl.load(r_ptrs, mask=x_mask, other=0.0).to(tl.float32)
              ).to(xt.dtype)
    normed = (xt.to(tl.float32) * inv_rms[None, :]).to(xt.dtype)
    w = tl.load(nw_ptrs, mask=k_valid, other=0.0)
    return (w.to(tl.float32)[:, None] * normed.to(tl.float32)).to(xt.dtype)


@triton.jit
def _store_output(acc, b_ptr, s_ptr, rows, y_ptrs, y_mask, HAS_BIAS: tl.constexpr,
                  HAS_SCALE: tl.constexpr):
    if HAS_SCALE:
        acc *= tl.load(s_ptr + rows)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=y_mask)
