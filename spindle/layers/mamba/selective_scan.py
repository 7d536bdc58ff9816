"""Mamba (version 1) selective scan in plain torch: the CPU path, and the reference the
Triton kernels (selective_scan_triton.py, same signatures) are tested against.

Per request and channel d (of the intermediate width), with a state h [N]:

    dt_t = softplus(dt_t + dt_bias)                  (per channel)
    h_t  = exp(dt_t * A[d]) * h_{t-1} + dt_t * x_t * B_t      (A [D, N] = -exp(A_log))
    y_t  = (h_t . C_t + D * x_t) * silu(z_t)

B_t and C_t [N] are shared by every channel. Unlike Mamba2's, each state element
decays at its own rate, so there is no chunked matrix form: the prefill runs the
recurrence token by token (vectorised over channels and state). Layout as in ops.py:
token-major and packed ([T, ...]), MambaMetadata saying where each request starts and
which state slot it owns. Everything is computed in float32; states are stored in their
tensor's dtype and outputs returned in x's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.ops import _check_rows, _requests, _slots, _write_rows

# Tokens whose discretised A and B x are made at once in a prefill ([tokens, D, N]
# float32 each): bounds the scratch memory of long prompts.
TOKENS_PER_BLOCK = 128


def selective_scan_prefill(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                           dt_bias: torch.Tensor, z: torch.Tensor,
                           ssm_state: torch.Tensor | None, md: MambaMetadata) -> torch.Tensor:
    """Each request's tokens: x/dt/z [T, D] (dt before dt_bias and softplus), A_log
    [D, N], B/C [T, N], D/dt_bias [D] -> y [T, D], gated. The initial state is
    ssm_state[slot] ([D, N]) when has_initial_state[i], else zeros; the final state is
    written back (ssm_state None: zeros, nothing stored). Rows past the last request
    are 0."""
    _check_shapes(x, dt, A_log, B, C, D, dt_bias, z)
    A = -torch.exp(A_log.float())
    step = F.softplus(dt.float() + dt_bias.float())
    y = torch.zeros_like(x)
    for _, start, end, slot, has_history in _requests(md):
        if end == start:
            continue
        if has_history and ssm_state is not None and slot >= 0:
            h = ssm_state[slot].float()
        else:
            h = x.new_zeros(A.shape, dtype=torch.float32)
        out = torch.empty(end - start, x.shape[1], dtype=torch.float32, device=x.device)
        for b0 in range(start, end, TOKENS_PER_BLOCK):
            b1 = min(b0 + TOKENS_PER_BLOCK, end)
            decay = torch.exp(step[b0:b1, :, None] * A)  # [L, D, N]
            write = (step[b0:b1] * x[b0:b1].float())[:, :, None] * B[b0:b1, None, :].float()
            Cs = C[b0:b1].float()
            for t in range(b1 - b0):
                h = decay[t] * h + write[t]
                out[b0 - start + t] = h @ Cs[t]
        y[start:end] = _output(out, x[start:end], D, z[start:end])
        if ssm_state is not None and slot >= 0:
            ssm_state[slot] = h.to(ssm_state.dtype)
    return y


def selective_scan_decode(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                          B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                          dt_bias: torch.Tensor, z: torch.Tensor, ssm_state: torch.Tensor,
                          state_indices: torch.Tensor) -> torch.Tensor:
    """One step per request: x/dt/z [B, D], B/C [B, N] -> y [B, D]; ssm_state [S, D, N]
    updated in place at state_indices [B] (a negative index: padding, zero state, no
    write)."""
    _check_shapes(x, dt, A_log, B, C, D, dt_bias, z)
    _check_rows(x, state_indices)
    valid, slots = _slots(state_indices)
    h = ssm_state.index_select(0, slots).float()
    h = torch.where(valid[:, None, None], h, 0.0)  # [B, D, N]
    step = F.softplus(dt.float() + dt_bias.float())
    h = (torch.exp(step[:, :, None] * -torch.exp(A_log.float())) * h
         + (step * x.float())[:, :, None] * B.float()[:, None, :])
    _write_rows(ssm_state, slots, valid, h)
    return _output(torch.einsum("bdn,bn->bd", h, C.float()), x, D, z)


def _output(scan: torch.Tensor, x: torch.Tensor, D: torch.Tensor, z: torch.Tensor
            ) -> torch.Tensor:
    """(scan + D x) * silu(z), in x's dtype."""
    return ((scan + D.float() * x.float()) * F.silu(z.float())).to(x.dtype)


def _check_shapes(x, dt, A_log, B, C, D, dt_bias, z) -> None:
    tokens, channels = x.shape
    if dt.shape != x.shape or z.shape != x.shape or A_log.dim() != 2 \
            or A_log.shape[0] != channels or D.shape != (channels,) \
            or dt_bias.shape != (channels,):
        raise ValueError(f"selective scan: x {tuple(x.shape)} needs dt and z like it, A_log "
                         f"[{channels}, N] and D, dt_bias [{channels}]; got dt "
                         f"{tuple(dt.shape)}, z {tuple(z.shape)}, A_log {tuple(A_log.shape)}, "
                         f"D {tuple(D.shape)}, dt_bias {tuple(dt_bias.shape)}")
    if B.shape != (tokens, A_log.shape[1]) or C.shape != B.shape:
        raise ValueError(f"selective scan: B and C must be [{tokens}, {A_log.shape[1]}], got "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}")
