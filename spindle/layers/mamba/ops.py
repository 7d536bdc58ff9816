"""Mamba2 ops in plain torch: the CPU path, and the reference the Triton kernels
(triton_ops.py, same signatures) are tested against.

Layout is token-major and packed: the new tokens of every request of a step are
concatenated ([T, ...]) and MambaMetadata says where each request starts and which
state slot it owns. Prefill ops take any number of tokens per request; decode ops
exactly one. Everything is computed in float32; states are stored in their tensors'
dtype and outputs returned in the input's dtype.

The recurrence (per request, head h of group g = h // (H // G)):

    dt_t    = clamp(softplus(dt_t + dt_bias), *dt_limit)
    state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t (outer) B_t     [P, N]
    y_t     = state_t @ C_t + D * x_t

with A = -exp(A_log): the SSD ops take A_log, as checkpoints store it, and derive A in
float32 themselves (on the GPU inside the decode kernel, where computing it apart cost
three launches a layer and step).

ssd_prefill evaluates it chunk by chunk (the SSD form: a masked "attention" inside a
chunk, the state carried from one chunk to the next); ssd_decode takes one step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spindle.layers.mamba.metadata import MambaMetadata

ACTIVATIONS = ("silu", "swish", None)


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          conv_state: torch.Tensor | None, md: MambaMetadata,
                          activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal convolution of each request's tokens: x [T, C], weight [C, K],
    bias [C] -> [T, C]. Request i sees its history (conv_state[slot], [C, K-1]: the
    K-1 inputs before its first new token) when has_initial_state[i], else zeros;
    afterwards conv_state[slot] holds the last K-1 inputs of history + new tokens.
    conv_state None: zero history, nothing stored. Rows past the last request are 0."""
    _check_activation(activation)
    channels, width = weight.shape
    if x.dim() != 2 or x.shape[1] != channels:
        raise ValueError(f"x must be [tokens, {channels}], got {tuple(x.shape)}")
    out = torch.zeros_like(x)
    w = weight.float().unsqueeze(1)  # [C, 1, K]: F.conv1d's depthwise layout
    b = None if bias is None else bias.float()
    for i, start, end, slot, has_history in _requests(md):
        if end == start:
            continue
        new = x[start:end].float().t()  # [C, L]
        if has_history and conv_state is not None and slot >= 0:
            history = conv_state[slot].float()
        else:
            history = new.new_zeros(channels, width - 1)
        seq = torch.cat([history, new], dim=1)  # [C, K-1+L]
        y = F.conv1d(seq.unsqueeze(0), w, b, groups=channels)[0]  # [C, L]
        out[start:end] = _activate(y, activation).t().to(x.dtype)
        if conv_state is not None and slot >= 0:
            conv_state[slot] = seq[:, seq.shape[1] - (width - 1):].to(conv_state.dtype)
    return out


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, state_indices: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    """One new token per request: x [B, C] -> [B, C], conv_state [S, C, K-1] read and
    shifted in place at state_indices [B] (a negative index: padding, zero history,
    no write)."""
    _check_activation(activation)
    _check_rows(x, state_indices)
    valid, slots = _slots(state_indices)
    history = conv_state.index_select(0, slots).float()  # [B, C, K-1]
    history = torch.where(valid[:, None, None], history, 0.0)
    seq = torch.cat([history, x.float().unsqueeze(-1)], dim=-1)  # [B, C, K]
    y = (seq * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    _write_rows(conv_state, slots, valid, seq[..., 1:])
    return _activate(y, activation).to(x.dtype)


def ssd_prefill(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                dt_limit: tuple[float, float], chunk_size: int,
                ssm_state: torch.Tensor | None, md: MambaMetadata) -> torch.Tensor:
    """The selective scan of each request's tokens: x [T, H, P], dt [T, H] (raw, before
    dt_bias and softplus), A_log [H] (A = -exp(A_log)), B/C [T, G, N], D/dt_bias [H]
    -> y [T, H, P] (with the D skip, no gating). The initial state is ssm_state[slot]
    ([H, P, N]) when has_initial_state[i], else zeros; the final state is written back
    to the slot (ssm_state None: zeros, nothing stored). Rows past the last request
    are 0."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_ssd_shapes(x, dt, A_log, B, C, D, dt_bias)
    num_heads, head_dim = x.shape[1], x.shape[2]
    heads_per_group = num_heads // B.shape[1]
    step = _discretized_dt(dt, dt_bias, dt_limit)
    A, D = decay_rates(A_log), D.float()
    y = torch.zeros_like(x)
    for i, start, end, slot, has_history in _requests(md):
        if end == start:
            continue
        if has_history and ssm_state is not None and slot >= 0:
            state = ssm_state[slot].float()
        else:
            state = x.new_zeros(num_heads, head_dim, B.shape[2], dtype=torch.float32)
        xs = x[start:end].float()
        Bs = B[start:end].float().repeat_interleave(heads_per_group, dim=1)  # [L, H, N]
        Cs = C[start:end].float().repeat_interleave(heads_per_group, dim=1)
        out = torch.empty_like(xs)
        for c0 in range(0, end - start, chunk_size):
            c1 = min(c0 + chunk_size, end - start)
            out[c0:c1], state = _ssd_chunk(xs[c0:c1], step[start + c0:start + c1], A,
                                           Bs[c0:c1], Cs[c0:c1], state)
        y[start:end] = (out + D[:, None] * xs).to(x.dtype)
        if ssm_state is not None and slot >= 0:
            ssm_state[slot] = state.to(ssm_state.dtype)
    return y


def ssd_decode(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
               dt_limit: tuple[float, float], ssm_state: torch.Tensor,
               state_indices: torch.Tensor) -> torch.Tensor:
    """One step of the recurrence per request: x [B, H, P], dt [B, H], B/C [B, G, N]
    -> y [B, H, P]; ssm_state [S, H, P, N] updated in place at state_indices [B] (a
    negative index: padding, zero state, no write)."""
    _check_ssd_shapes(x, dt, A_log, B, C, D, dt_bias)
    _check_rows(x, state_indices)
    heads_per_group = x.shape[1] // B.shape[1]
    valid, slots = _slots(state_indices)
    state = ssm_state.index_select(0, slots).float()
    state = torch.where(valid[:, None, None, None], state, 0.0)  # [B, H, P, N]
    step = _discretized_dt(dt, dt_bias, dt_limit)  # [B, H]
    xf = x.float()
    Bh = B.float().repeat_interleave(heads_per_group, dim=1)  # [B, H, N]
    Ch = C.float().repeat_interleave(heads_per_group, dim=1)
    decay = torch.exp(step * decay_rates(A_log))
    state = (state * decay[..., None, None]
             + (step[..., None] * xf).unsqueeze(-1) * Bh.unsqueeze(2))
    _write_rows(ssm_state, slots, valid, state)
    y = torch.einsum("bhpn,bhn->bhp", state, Ch) + D.float()[:, None] * xf
    return y.to(x.dtype)


# ---------------------------------------------------------------------- helpers
def _ssd_chunk(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one sequence, float32: x [L, H, P], dt [L, H] (discretized), A [H],
    B/C [L, H, N] (per head), state [H, P, N] entering the chunk -> (y without the D
    skip [L, H, P], state leaving the chunk)."""
    log_a = dt * A  # [L, H], <= 0: log of each step's decay
    # decay[t, s] = prod_{s < r <= t} a_r: from the input at s to the output at t.
    decay = torch.exp(_segment_sums(log_a))  # [L, L, H], 0 above the diagonal
    log_from_start = torch.cumsum(log_a, dim=0)  # decay of the entering state at t
    weights = torch.einsum("thn,shn->tsh", C, B) * decay * dt.unsqueeze(0)
    y = torch.einsum("tsh,shp->thp", weights, x)
    y = y + torch.einsum("thn,hpn->thp", C, state) * torch.exp(log_from_start).unsqueeze(-1)
    to_end = torch.exp(log_from_start[-1:] - log_from_start) * dt  # [L, H]
    state = (state * torch.exp(log_from_start[-1])[:, None, None]
             + torch.einsum("sh,shp,shn->hpn", to_end, x, B))
    return y, state


def _segment_sums(log_a: torch.Tensor) -> torch.Tensor:
    """[L, H] -> [L, L, H]: out[t, s] = sum of log_a[s+1 .. t] for s <= t, -inf above the
    diagonal. Summed term by term (a masked cumsum) rather than as a difference of two
    prefix sums, which would cancel catastrophically in long chunks."""
    length = log_a.shape[0]
    rows = torch.arange(length, device=log_a.device)
    terms = log_a.unsqueeze(1).expand(length, length, log_a.shape[1])  # [r, s, H] = log_a[r]
    terms = terms.masked_fill((rows[:, None] <= rows[None, :]).unsqueeze(-1), 0.0)
    sums = torch.cumsum(terms, dim=0)  # [t, s]: sum over s < r <= t
    return sums.masked_fill((rows[:, None] < rows[None, :]).unsqueeze(-1), float("-inf"))


def _discretized_dt(dt: torch.Tensor, dt_bias: torch.Tensor,
                    dt_limit: tuple[float, float]) -> torch.Tensor:
    low, high = dt_limit
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=low, max=high)


def _requests(md: MambaMetadata):
    """(index, first token, end token, slot, has_initial_state) of each request, from
    the host copies when the metadata carries them."""
    starts = _host_list(md.query_start_loc_cpu, md.query_start_loc)
    slots = _host_list(md.state_indices_cpu, md.state_indices)
    has_initial = _host_list(md.has_initial_state_cpu, md.has_initial_state)
    for i in range(md.num_reqs):
        yield i, starts[i], starts[i + 1], slots[i], bool(has_initial[i])


def _host_list(host: torch.Tensor | None, device: torch.Tensor) -> list:
    return (host if host is not None else device).tolist()


def _slots(state_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid mask, slots with padding rows pointed at slot 0, never written)."""
    valid = state_indices >= 0
    return valid, torch.where(valid, state_indices, 0).long()


def _write_rows(states: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
                rows: torch.Tensor) -> None:
    keep = valid.nonzero().squeeze(1)
    states.index_copy_(0, slots[keep], rows[keep].to(states.dtype))


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return y if activation is None else F.silu(y)


def _check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_rows(x: torch.Tensor, state_indices: torch.Tensor) -> None:
    if state_indices.shape != (x.shape[0],):
        raise ValueError(f"decode takes one state index per row: x has {x.shape[0]} rows, "
                         f"state_indices has shape {tuple(state_indices.shape)}")


def decay_rates(A_log: torch.Tensor) -> torch.Tensor:
    """A = -exp(A_log) in float32 (negative: a state decays by exp(dt * A) a step)."""
    return -torch.exp(A_log.float())


def _check_ssd_shapes(x, dt, A_log, B, C, D, dt_bias) -> None:
    num_heads = x.shape[1]
    if dt.shape != x.shape[:2] or A_log.shape != (num_heads,) or D.shape != (num_heads,) \
            or dt_bias.shape != (num_heads,):
        raise ValueError(f"ssd: x {tuple(x.shape)} needs dt [T, H] and A_log, D, dt_bias [H]; "
                         f"got dt {tuple(dt.shape)}, A_log {tuple(A_log.shape)}, "
                         f"D {tuple(D.shape)}, dt_bias {tuple(dt_bias.shape)}")
    if B.shape != C.shape or B.shape[0] != x.shape[0] or num_heads % B.shape[1] != 0:
        raise ValueError(f"ssd: B and C must be [T, G, N] with G dividing the {num_heads} "
                         f"heads; got B {tuple(B.shape)}, C {tuple(C.shape)}")
