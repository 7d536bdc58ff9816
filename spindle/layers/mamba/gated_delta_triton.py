"""The gated delta rule's decode step as a Triton kernel (CUDA), same signature and
results as gated_delta.gated_delta_decode, against which it is tested. The prefill on
CUDA is gated_delta.gated_delta_prefill (torch, every chunk of the step batched: a few
dozen launches a layer), outside CUDA graphs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spindle.layers import pdl
from spindle.layers.mamba import gated_delta
from spindle.layers.mamba.gated_delta import L2_EPS
from spindle.layers.mamba.triton_ops import softplus

gated_delta_prefill = gated_delta.gated_delta_prefill


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                       state: torch.Tensor, state_indices: torch.Tensor,
                       beta_scale: float = 1.0) -> torch.Tensor:
    """One step per request: q/k [B, Hk, Dk], v [B, Hv, Dv], a/b [B, Hv] -> o [B, Hv, Dv];
    state [S, Hv, Dk, Dv] updated in place at state_indices [B] (a negative index:
    padding, state neither read nor written); beta_scale: a factor on beta. One launch,
    CUDA-graph safe."""
    gated_delta._check_shapes(q, k, v, a, b, A_log, dt_bias)
    gated_delta._check_rows(v, state_indices)
    num_reqs, value_heads, value_dim = v.shape
    key_heads, key_dim = q.shape[1], q.shape[2]
    if state.shape[1:] != (value_heads, key_dim, value_dim):
        raise ValueError(f"the state must be [slots, {value_heads}, {key_dim}, {value_dim}], "
                         f"got {tuple(state.shape)}")
    out = torch.empty_like(v)
    if num_reqs == 0:
        return out
    block_v = min(triton.next_power_of_2(value_dim), 32)
    _decode_kernel[(num_reqs, value_heads, triton.cdiv(value_dim, block_v))](
        q, k, v, a, b, A_log, dt_bias, state, state_indices, out, key_dim, value_dim,
        *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), *state.stride(),
        *out.stride(), L2_EPS, key_dim ** -0.5, float(beta_scale),
        VALUES_PER_KEY=value_heads // key_heads,
        BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v, num_warps=4,
        **pdl.kernel_args(v.device, num_reqs))
    return out


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
                   state_idx_ptr, out_ptr, key_dim, value_dim,
                   q_stride_b, q_stride_h, q_stride_d, k_stride_b, k_stride_h, k_stride_d,
                   v_stride_b, v_stride_h, v_stride_d, a_stride_b, a_stride_h,
                   b_stride_b, b_stride_h, s_stride_s, s_stride_h, s_stride_k, s_stride_v,
                   o_stride_b, o_stride_h, o_stride_d, l2_eps, q_scale, beta_scale,
                   VALUES_PER_KEY: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """One program per (request, value head, block of value features): the state
    columns [Dk, BLOCK_V] are decayed, corrected by the delta rule, written back and
    read out through q. Each program normalises its q and k itself (Dk is small)."""
    pdl.enter(PDL)
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    key_head = head // VALUES_PER_KEY
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_valid = offs_k < key_dim
    v_valid = offs_v < value_dim
    slot = tl.load(state_idx_ptr + req).to(tl.int64)
    state_mask = (slot >= 0) & k_valid[:, None] & v_valid[None, :]
    state_ptrs = state_ptr + slot * s_stride_s + head * s_stride_h \
        + offs_k[:, None] * s_stride_k + offs_v[None, :] * s_stride_v
    state = tl.load(state_ptrs, mask=state_mask, other=0.0).to(tl.float32)

    q = tl.load(q_ptr + req * q_stride_b + key_head * q_stride_h + offs_k * q_stride_d,
                mask=k_valid, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + req * k_stride_b + key_head * k_stride_h + offs_k * k_stride_d,
                mask=k_valid, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, 0) + l2_eps) * q_scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + l2_eps)
    v = tl.load(v_ptr + req * v_stride_b + head * v_stride_h + offs_v * v_stride_d,
                mask=v_valid, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + req * a_stride_b + head * a_stride_h).to(tl.float32)
    # beta = sigmoid(b) in b's own dtype, as the torch op (and transformers) computes it.
    b_raw = tl.load(b_ptr + req * b_stride_b + head * b_stride_h)
    beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32) * beta_scale
    step = softplus(a + tl.load(dt_bias_ptr + head).to(tl.float32))
    g = -tl.exp(tl.load(A_log_ptr + head).to(tl.float32)) * step

    state = state * tl.exp(g)
    error = v - tl.sum(state * k[:, None], 0)
    state = state + k[:, None] * (beta * error)[None, :]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=state_mask)
    o = tl.sum(state * q[:, None], 0)
    tl.store(out_ptr + req * o_stride_b + head * o_stride_h + offs_v * o_stride_d,
             o.to(out_ptr.dtype.element_ty), mask=v_valid)
