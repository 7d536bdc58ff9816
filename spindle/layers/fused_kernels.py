"""Fused Triton kernels for the small element-wise stages of a decoder layer on CUDA.

Unfused, a layer's norms, q/k norms, rotary embedding and SiLU-and-mul are about
forty tiny kernels; on a decode step each costs a few microseconds of GPU time no
matter how small the batch, which dominated batch-1 decode. Each kernel here does
one of those stages in one launch and rounds to the activation dtype exactly where
the plain-torch (Hugging Face) version rounds, so results stay bit-comparable:

* rms_norm(x, weight, eps, residual=None): optional residual add, then RMSNorm.
* qk_norm_rope_(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, eps):
  optional per-head RMSNorm of q and k, then the neox-style rotary embedding,
  in place.
* silu_and_mul(x): silu(gate) * up for x = [gate | up].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """x [T, H] -> y, or (y, x + residual) when residual is given."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else out
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, new_residual,
            x.stride(0), (residual if residual is not None else x).stride(0), eps,
            HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None, num_warps=4 if hidden <= 4096 else 8)
    return out if residual is None else (out, new_residual)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, x_stride, res_stride, eps,
                     HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The add rounds to the activation dtype, as `residual + x` does in torch.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * res_stride + offs, mask=mask,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + row * HIDDEN + offs, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, 0) / HIDDEN
    normed = (h * tl.math.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * HIDDEN + offs, y, mask=mask)


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                  eps: float) -> None:
    """In place on q [T, Hq, D] and k [T, Hk, D] (views into the qkv output allowed):
    per-head RMSNorm when weights are given, then the rotary embedding."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0:
        return
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[(num_tokens, num_q_heads + num_k_heads)](
        q, k, positions, cos_cache, sin_cache,
        q_weight if has_norm else q, k_weight if has_norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), HAS_NORM=has_norm, num_warps=1)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                         q_stride_t, q_stride_h, k_stride_t, k_stride_h, cs_stride, eps,
                         NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         HAS_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < NUM_Q_HEADS:
        base = q_ptr + token * q_stride_t + head * q_stride_h
        w_ptr = qw_ptr
    else:
        base = k_ptr + token * k_stride_t + (head - NUM_Q_HEADS) * k_stride_h
        w_ptr = kw_ptr
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    if HAS_NORM:
        h1 = x1.to(tl.float32)
        h2 = x2.to(tl.float32)
        variance = (tl.sum(h1 * h1, 0) + tl.sum(h2 * h2, 0)) / HEAD_DIM
        inv = tl.math.rsqrt(variance + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (h1 * inv).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (h2 * inv).to(dtype).to(tl.float32)).to(dtype)
    pos = tl.load(pos_ptr + token)
    # The cos/sin tables are float32; torch casts them to the activation dtype first.
    cos1 = tl.load(cos_ptr + pos * cs_stride + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * cs_stride + HALF + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * cs_stride + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * cs_stride + HALF + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # (x * cos) + (rotate_half(x) * sin), each product rounded like the torch version.
    out1 = ((a1 * cos1).to(dtype).to(tl.float32) + (-a2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((a2 * cos2).to(dtype).to(tl.float32) + (a1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + offs, out1, mask=mask)
    tl.store(base + HALF + offs, out2, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2F] = [gate | up] -> silu(gate) * up [T, F]."""
    num_tokens, double = x.shape
    width = double // 2
    out = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, block))](
            x, out, x.stride(0), WIDTH=width, BLOCK=block)
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + WIDTH + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * WIDTH + offs, y, mask=mask)
