"""The Mamba (version 1) selective scan as Triton kernels (CUDA): same signatures and
results as selective_scan.py's torch ops, against which they are tested.

The prefill gives each (request, block of channels) one program that walks the
request's tokens in order, the block's states [BLOCK_D, N] in registers: the
recurrence has no matrix form (each state element decays at its own rate), and the
channels are many (Jamba: 2 x hidden), so the parallelism is across them. The decode
takes one step per (request, block of channels), CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spindle.layers import pdl
from spindle.layers.mamba import selective_scan
from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.triton_ops import _output, softplus

BLOCK_D = 32


def selective_scan_prefill(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                           dt_bias: torch.Tensor, z: torch.Tensor,
                           ssm_state: torch.Tensor | None, md: MambaMetadata,
                           block_d: int = BLOCK_D) -> torch.Tensor:
    """See selective_scan.selective_scan_prefill. block_d: channels per program (a power
    of two; benchmarks/selective_scan_kernels.py sweeps it)."""
    selective_scan._check_shapes(x, dt, A_log, B, C, D, dt_bias, z)
    channels, state_size = A_log.shape
    y = _output(x.shape[0], (channels,), x, md)
    if md.num_reqs == 0 or md.num_tokens == 0:
        return y
    has_state = ssm_state is not None
    state = ssm_state if has_state else y  # (a placeholder pointer, never read)
    state_strides = ssm_state.stride() if has_state else (0, 0, 0)
    _prefill_kernel[(md.num_reqs, triton.cdiv(channels, block_d))](
        x, dt, A_log, B, C, D, dt_bias, z, state, y, md.query_start_loc, md.state_indices,
        md.has_initial_state, channels, state_size, *x.stride(), *dt.stride(),
        *A_log.stride(), *B.stride(), *C.stride(), *z.stride(), *state_strides, *y.stride(),
        HAS_STATE=has_state, BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(state_size),
        num_warps=4)
    return y


def selective_scan_decode(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                          B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                          dt_bias: torch.Tensor, z: torch.Tensor, ssm_state: torch.Tensor,
                          state_indices: torch.Tensor, block_d: int = BLOCK_D) -> torch.Tensor:
    """See selective_scan.selective_scan_decode. block_d: as selective_scan_prefill's."""
    selective_scan._check_shapes(x, dt, A_log, B, C, D, dt_bias, z)
    selective_scan._check_rows(x, state_indices)
    channels, state_size = A_log.shape
    y = torch.empty_like(x)
    if x.shape[0] == 0:
        return y
    _decode_kernel[(x.shape[0], triton.cdiv(channels, block_d))](
        x, dt, A_log, B, C, D, dt_bias, z, ssm_state, y, state_indices, channels, state_size,
        *x.stride(), *dt.stride(), *A_log.stride(), *B.stride(), *C.stride(), *z.stride(),
        *ssm_state.stride(), *y.stride(), BLOCK_D=block_d,
        BLOCK_N=triton.next_power_of_2(state_size), num_warps=4,
        **pdl.kernel_args(x.device, x.shape[0]))
    return y


@triton.jit
def _step(h, A, D, x, step, b, c, gate):
    """One token of a block of channels, float32: the states [BLOCK_D, N] decayed and
    written, and the gated output (h . C + D x) * silu(z)."""
    h = tl.exp(step[:, None] * A) * h + (step * x)[:, None] * b[None, :]
    return h, (tl.sum(h * c[None, :], 1) + D * x) * gate * tl.sigmoid(gate)


@triton.jit
def _channel_constants(A_log_ptr, D_ptr, dt_bias_ptr, offs_d, offs_n, d_valid, tile,
                       a_stride_d, a_stride_n):
    """A = -exp(A_log) [BLOCK_D, N], D and dt_bias [BLOCK_D] of a block of channels."""
    A = -tl.exp(tl.load(A_log_ptr + offs_d[:, None] * a_stride_d + offs_n[None, :] * a_stride_n,
                        mask=tile, other=0.0).to(tl.float32))
    D = tl.load(D_ptr + offs_d, mask=d_valid, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + offs_d, mask=d_valid, other=0.0).to(tl.float32)
    return A, D, dt_bias


@triton.jit
def _token_inputs(t, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, dt_bias, offs_d, offs_n, d_valid,
                  n_valid, x_stride_t, x_stride_d, dt_stride_t, dt_stride_d, b_stride_t,
                  b_stride_n, c_stride_t, c_stride_n, z_stride_t, z_stride_d):
    """Token row t's x, step = softplus(dt + dt_bias) and gate z [BLOCK_D], and its B, C
    [N], in float32."""
    x = tl.load(x_ptr + t * x_stride_t + offs_d * x_stride_d, mask=d_valid,
                other=0.0).to(tl.float32)
    step = softplus(tl.load(dt_ptr + t * dt_stride_t + offs_d * dt_stride_d, mask=d_valid,
                            other=0.0).to(tl.float32) + dt_bias)
    b = tl.load(B_ptr + t * b_stride_t + offs_n * b_stride_n, mask=n_valid,
                other=0.0).to(tl.float32)
    c = tl.load(C_ptr + t * c_stride_t + offs_n * c_stride_n, mask=n_valid,
                other=0.0).to(tl.float32)
    gate = tl.load(z_ptr + t * z_stride_t + offs_d * z_stride_d, mask=d_valid,
                   other=0.0).to(tl.float32)
    return x, step, b, c, gate


@triton.jit
def _prefill_kernel(x_ptr, dt_ptr, A_log_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, z_ptr,
                    state_ptr, y_ptr, query_start_ptr, state_idx_ptr, has_init_ptr,
                    channels, state_size, x_stride_t, x_stride_d, dt_stride_t, dt_stride_d,
                    a_stride_d, a_stride_n, b_stride_t, b_stride_n, c_stride_t, c_stride_n,
                    z_stride_t, z_stride_d, s_stride_s, s_stride_d, s_stride_n,
                    y_stride_t, y_stride_d, HAS_STATE: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    req = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_valid, n_valid = offs_d < channels, offs_n < state_size
    start = tl.load(query_start_ptr + req).to(tl.int64)
    end = tl.load(query_start_ptr + req + 1).to(tl.int64)
    slot = tl.load(state_idx_ptr + req).to(tl.int64)
    tile = d_valid[:, None] & n_valid[None, :]
    A, D, dt_bias = _channel_constants(A_log_ptr, D_ptr, dt_bias_ptr, offs_d, offs_n, d_valid,
                                       tile, a_stride_d, a_stride_n)
    state_ptrs = state_ptr + slot * s_stride_s + offs_d[:, None] * s_stride_d \
        + offs_n[None, :] * s_stride_n
    h = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    if HAS_STATE:
        carried = (slot >= 0) & (tl.load(has_init_ptr + req) != 0)
        h = tl.load(state_ptrs, mask=tile & carried, other=0.0).to(tl.float32)
    for t in range(start, end):
        x, step, b, c, gate = _token_inputs(
            t, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, dt_bias, offs_d, offs_n, d_valid, n_valid,
            x_stride_t, x_stride_d, dt_stride_t, dt_stride_d, b_stride_t, b_stride_n,
            c_stride_t, c_stride_n, z_stride_t, z_stride_d)
        h, y = _step(h, A, D, x, step, b, c, gate)
        tl.store(y_ptr + t * y_stride_t + offs_d * y_stride_d,
                 y.to(y_ptr.dtype.element_ty), mask=d_valid)
    if HAS_STATE:
        tl.store(state_ptrs, h.to(state_ptr.dtype.element_ty), mask=tile & (slot >= 0))


@triton.jit
def _decode_kernel(x_ptr, dt_ptr, A_log_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, z_ptr,
                   state_ptr, y_ptr, state_idx_ptr, channels, state_size,
                   x_stride_t, x_stride_d, dt_stride_t, dt_stride_d, a_stride_d, a_stride_n,
                   b_stride_t, b_stride_n, c_stride_t, c_stride_n, z_stride_t, z_stride_d,
                   s_stride_s, s_stride_d, s_stride_n, y_stride_t, y_stride_d,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_valid, n_valid = offs_d < channels, offs_n < state_size
    slot = tl.load(state_idx_ptr + row).to(tl.int64)
    tile = d_valid[:, None] & n_valid[None, :]
    state_ptrs = state_ptr + slot * s_stride_s + offs_d[:, None] * s_stride_d \
        + offs_n[None, :] * s_stride_n
    h = tl.load(state_ptrs, mask=tile & (slot >= 0), other=0.0).to(tl.float32)
    A, D, dt_bias = _channel_constants(A_log_ptr, D_ptr, dt_bias_ptr, offs_d, offs_n, d_valid,
                                       tile, a_stride_d, a_stride_n)
    x, step, b, c, gate = _token_inputs(
        row, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, dt_bias, offs_d, offs_n, d_valid, n_valid,
        x_stride_t, x_stride_d, dt_stride_t, dt_stride_d, b_stride_t, b_stride_n,
        c_stride_t, c_stride_n, z_stride_t, z_stride_d)
    h, y = _step(h, A, D, x, step, b, c, gate)
    tl.store(state_ptrs, h.to(state_ptr.dtype.element_ty), mask=tile & (slot >= 0))
    tl.store(y_ptr + row * y_stride_t + offs_d * y_stride_d, y.to(y_ptr.dtype.element_ty),
             mask=d_valid)
