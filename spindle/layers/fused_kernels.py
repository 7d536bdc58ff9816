"""Fused Triton kernels for the small element-wise stages of a decoder layer on CUDA.

Unfused, a layer's norms, q/k norms, rotary embedding and SiLU-and-mul are about
forty tiny kernels; on a decode step each costs a few microseconds of GPU time no
matter how small the batch, which dominated batch-1 decode. Each kernel here does
one of those stages in one launch and rounds to the activation dtype exactly where
the plain-torch (Hugging Face) version rounds, so results stay bit-comparable:

* rms_norm(x, weight, eps, residual=None): optional residual add, then RMSNorm; x
  may be a skinny GEMM's unsummed split-K partials (skinny_gemm.SplitKPartials).
* qk_norm_rope_(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, eps,
  [v, kv_cache, slot_mapping]): optional per-head RMSNorm of q and k, then the
  neox-style rotary embedding, in place; optionally also writes k and v into their
  paged KV-cache slots (rotary.QKNormRope bundles the arguments for the attention
  layer).
* silu_and_mul(x): silu(gate) * up for x = [gate | up].

PendingNorm is an rms_norm not run yet, left for the linear layer that reads its output
to apply as it loads its input (tma_gemv.py, a decode step of one request).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spindle.layers import pdl


def rms_norm(x, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None):
    """x [T, H] -> y, or (y, x + residual) when residual is given. x may be a
    SplitKPartials of [T, H]: its partials are summed as they load, in split order from
    zero, then rounded to its dtype, which is the tensor its GEMM would have stored.
    residual_out: where x + residual goes (a new tensor by default)."""
    if isinstance(x, torch.Tensor):
        source, parts = x, 0
        (num_tokens, hidden), dtype = x.shape, x.dtype
        x_stride, part_stride = x.stride(0), 0
    else:  # (skinny_gemm.SplitKPartials; not imported: it imports this module)
        source, parts = x.partials, x.partials.shape[0]
        (num_tokens, hidden), dtype = (x.partials.shape[1], x.n), x.dtype
        x_stride, part_stride = source.stride(1), source.stride(0)
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=source.device)
    new_residual = out
    if residual is not None:
        new_residual = residual_out if residual_out is not None else torch.empty_like(out)
    if num_tokens:
        res = residual if residual is not None else out  # (unread without a residual)
        _rms_norm_kernel[(num_tokens,)](
            source, res, weight, out, new_residual, x_stride, part_stride, res.stride(0),
            eps, HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None, PARTS=parts,
            num_warps=4 if hidden <= 4096 else 8, **pdl.kernel_args(out.device, num_tokens))
    return out if residual is None else (out, new_residual)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, x_stride, part_stride,
                     res_stride, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    if PARTS == 0:
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    else:  # a GEMM's split-K partials (float32), summed as its own merge sums them
        total = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(PARTS):
            total += tl.load(x_ptr + s * part_stride + row * x_stride + offs, mask=mask,
                             other=0.0)
        x = total.to(out_ptr.dtype.element_ty)
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


@dataclass(frozen=True)
class PendingNorm:
    """rms_norm(x, weight, eps, residual) not run yet: the input of the linear layer
    that reads it next, which may apply the norm as it loads x (tma_gemv, one row on
    CUDA) instead of reading a normalized copy. x + residual goes to residual_out
    (allocated when the norm was deferred: the decoder layer holds it as its residual
    stream), written by whichever kernel runs the norm. Without a residual (a first
    layer) there is no sum to write."""
    x: torch.Tensor
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None

    def materialized(self) -> torch.Tensor:
        """The normalized rows, by the norm's own kernel (residual_out written too)."""
        if self.residual is None:
            return rms_norm(self.x, self.weight, self.eps)
        return rms_norm(self.x, self.weight, self.eps, self.residual, self.residual_out)[0]


def materialized(x):
    """x as a tensor: a PendingNorm run (PendingNorm.materialized), anything else as is."""
    return x.materialized() if isinstance(x, PendingNorm) else x


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                  eps: float, v: torch.Tensor | None = None,
                  kv_cache: torch.Tensor | None = None,
                  slot_mapping: torch.Tensor | None = None) -> None:
    """In place on q [T, Hq, D] and k [T, Hk, D] (views into the qkv output allowed):
    per-head RMSNorm when weights are given, then the rotary embedding.

    With kv_cache [2, num_blocks, block_size, Hk, D] (and v [T, Hk, D], slot_mapping
    [T]) the same launch also writes each token's rotated k and its v into its cache
    slot (slot < 0: a padding token, skipped), which saves the separate store-KV kernel.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0:
        return
    has_norm = q_weight is not None
    store = kv_cache is not None
    if store and (v is None or slot_mapping is None):
        raise ValueError("storing into kv_cache needs v and slot_mapping")
    key_cache, value_cache = (kv_cache[0], kv_cache[1]) if store else (k, k)
    v = v if store else k
    _qk_norm_rope_kernel[(num_tokens, 2)](
        q, k, v, positions, cos_cache, sin_cache,
        q_weight if has_norm else q, k_weight if has_norm else k,
        key_cache, value_cache, slot_mapping if store else positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_cache.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        eps, NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_k_heads)),
        BLOCK_D=triton.next_power_of_2(head_dim), PAGE=key_cache.shape[1] if store else 1,
        HAS_NORM=has_norm, STORE=store, num_warps=4, **pdl.kernel_args(q.device, num_tokens))


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                         key_cache_ptr, value_cache_ptr, slot_ptr,
                         q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t,
                         v_stride_h, cs_stride, c_stride_b, c_stride_t, c_stride_h, eps,
                         NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         PAGE: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr,
                         PDL: tl.constexpr):
    """One program per (token, q or k): all heads of that token's q (or k) at once."""
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    is_k = tl.program_id(1) == 1
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    if is_k:
        rows = k_ptr + token * k_stride_t + offs_h * k_stride_h
        row_valid = offs_h < NUM_K_HEADS
        w_ptr = kw_ptr
    else:
        rows = q_ptr + token * q_stride_t + offs_h * q_stride_h
        row_valid = offs_h < NUM_Q_HEADS
        w_ptr = qw_ptr
    pos = tl.load(pos_ptr + token)
    x = norm_rope_rows(rows, row_valid, w_ptr, cos_ptr + pos * cs_stride,
                       sin_ptr + pos * cs_stride, eps, HEAD_DIM, BLOCK_D, HAS_NORM)
    mask = row_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(rows[:, None] + offs_d[None, :], x, mask=mask)
    if STORE:
        slot = tl.load(slot_ptr + token)
        if is_k & (slot >= 0):
            dst = cache_row(slot, c_stride_b, c_stride_t, PAGE) \
                + offs_h[:, None] * c_stride_h + offs_d[None, :]
            tl.store(key_cache_ptr + dst, x, mask=mask)
            value = tl.load(v_ptr + token * v_stride_t + offs_h[:, None] * v_stride_h
                            + offs_d[None, :], mask=mask)
            tl.store(value_cache_ptr + dst, value, mask=mask)


@triton.jit
def norm_rope_rows(rows, row_valid, w_ptr, cos_row, sin_row, eps, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads [R, BLOCK_D] of q or k, row r starting at pointer rows[r] (activation
    dtype; rows with row_valid False read as zeros) -> RMSNorm(head) * w (HAS_NORM),
    then the neox rotary embedding with the float32 table rows cos_row/sin_row of the
    token's position.

    Rounds to the activation dtype wherever the torch layers (RMSNorm, apply_rotary)
    round, so results match them up to float32 summation order. Shared with the
    attention backend's fused decode kernel."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, BLOCK_D)
    d_valid = offs < HEAD_DIM
    # rotate_half(x)[d] is -x[d + HALF] in the first half and x[d - HALF] in the
    # second: load each element's partner and give it that sign.
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
    sign = tl.where(offs < HALF, -1.0, 1.0)[None, :]
    mask = row_valid[:, None] & d_valid[None, :]
    x = tl.load(rows[:, None] + offs[None, :], mask=mask, other=0.0)
    xp = tl.load(rows[:, None] + partner[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_NORM:
        h = x.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(h * h, 1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + offs, mask=d_valid, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=d_valid, other=0.0).to(tl.float32)[None, :]
        x = (w * (h * inv).to(dtype).to(tl.float32)).to(dtype)
        xp = (wp * (xp.to(tl.float32) * inv).to(dtype).to(tl.float32)).to(dtype)
    # The cos/sin tables are float32; torch casts them to the activation dtype first.
    cos = tl.load(cos_row + offs, mask=d_valid, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_row + offs, mask=d_valid, other=0.0).to(dtype).to(tl.float32)[None, :]
    # x * cos + rotate_half(x) * sin, each product rounded like the torch version.
    return ((x.to(tl.float32) * cos).to(dtype).to(tl.float32)
            + (sign * xp.to(tl.float32) * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def cache_row(slot, c_stride_b, c_stride_t, PAGE: tl.constexpr):
    """Offset of cache slot `slot` (block * PAGE + position in block) in a key or value
    cache [num_blocks, PAGE, H_kv, D] with the given block and token strides."""
    slot = slot.to(tl.int64)
    return (slot // PAGE) * c_stride_b + (slot % PAGE) * c_stride_t


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2F] = [gate | up] -> silu(gate) * up [T, F]."""
    num_tokens, double = x.shape
    width = double // 2
    out = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, block))](
            x, out, x.stride(0), WIDTH=width, BLOCK=block, **pdl.kernel_args(x.device, num_tokens))
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + WIDTH + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * WIDTH + offs, silu_mul(gate, up), mask=mask)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in gate's dtype, rounded as the torch path rounds: silu in
    float32 rounded to the dtype, then the product in float32 rounded again. (Also the
    skinny GEMM's load of a down projection's input: the same bits.)"""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
