"""Triton kernels of the Mamba2 layer (the CUDA path): the causal depthwise conv1d and
the selective state-space scan, for prefill and for decode. Same signatures and math as
the plain-torch ops (ops.py); computed in float32, states stored in their tensors'
dtype, outputs in the input's dtype.

Layout: token-major packed batches (request i owns tokens query_start_loc[i]:[i+1],
MambaMetadata). Inputs may be strided views (slices of a projection output); only the
last dimension of x, B and C is expected to be contiguous for speed, not correctness.
A negative state index marks a padding row: it reads no state (zeros), writes none,
and its output is finite. Prefill inputs may end in padding tokens past md.num_tokens,
which no request owns: they are never read, and their outputs are zeros.

* ``causal_conv1d_prefill`` / ``causal_conv1d_decode``: out[t] = act(bias +
  sum_k w[k] * in[t - (K-1) + k]) over the request's history (its conv state: the last
  K-1 inputs) followed by its new tokens; the state then holds the last K-1 inputs.
* ``ssd_prefill``: the chunked SSD scan. Each request's tokens are cut into chunks of
  chunk_size (chunks never span two requests; a table of them is made on the host).
  Five launches: dt and its within-chunk cumulative decay; C.B^T per chunk and group
  (shared by the group's heads); each chunk's own end state; a pass over each
  request's chunks in order that turns those into every chunk's start state (and
  writes the final state); and the outputs, the chunk's start state seen through C
  plus the causal within-chunk part.
* ``ssd_decode``: one token per request, the selective state update in one launch.
  Its grid depends only on the shapes and it never reads a host value, so it can be
  captured in a CUDA graph.

Discretisation (as transformers' Bamba): dt = clamp(softplus(dt + dt_bias), *dt_limit);
state = exp(dt * A) * state + dt * B x; y = C . state + D x; head h reads group
h // (H // G) of B and C. The SSD ops take A_log (A = -exp(A_log)); decode derives A in
its kernel, so a decode step spends no launches on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spindle.layers import pdl
from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.ops import decay_rates

_ACTIVATIONS = (None, "silu", "swish")


# ---------------------------------------------------------------------- conv1d
def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          conv_state: torch.Tensor | None, md: MambaMetadata,
                          activation: str | None = "silu") -> torch.Tensor:
    """x [T, C] -> [T, C]. Request i's history is conv_state[slot] [C, K-1] when
    has_initial_state[i], else zeros; afterwards conv_state[slot] holds the last K-1
    inputs of history + new tokens. conv_state None: zero history, nothing stored."""
    num_tokens, channels = x.shape
    width = _check_conv(x, weight, bias, conv_state, activation)
    out = _output(num_tokens, (channels,), x, md)
    if md.num_reqs == 0:
        return out
    has_state = conv_state is not None
    state = conv_state if has_state else x
    state_strides = conv_state.stride() if has_state else (0, 0, 0)
    if num_tokens and md.max_query_len:
        block_t = min(32, triton.next_power_of_2(md.max_query_len))
        block_c = min(128, triton.next_power_of_2(channels))
        grid = (triton.cdiv(md.max_query_len, block_t), md.num_reqs,
                triton.cdiv(channels, block_c))
        _conv_prefill_kernel[grid](
            x, weight, bias if bias is not None else weight, state, out,
            md.query_start_loc, md.state_indices, md.has_initial_state, channels,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *state_strides,
            out.stride(0), WIDTH=width, HAS_BIAS=bias is not None, HAS_STATE=has_state,
            SILU=activation is not None, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    if has_state and width > 1:
        # A second launch: the conv above reads the old states from every tile of a
        # request, so none of its programs may overwrite one.
        block_c = min(256, triton.next_power_of_2(channels))
        _conv_state_prefill_kernel[(md.num_reqs, triton.cdiv(channels, block_c))](
            x, conv_state, md.query_start_loc, md.state_indices, md.has_initial_state,
            channels, x.stride(0), x.stride(1), *state_strides,
            WIDTH=width, BLOCK_C=block_c, num_warps=4)
    return out


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, state_indices: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    """One new token per request: x [B, C] -> [B, C]; conv_state[state_indices[b]]
    is the history and is shifted by the new input. CUDA-graph safe."""
    num_reqs, channels = x.shape
    width = _check_conv(x, weight, bias, conv_state, activation)
    if conv_state is None:
        raise ValueError("causal_conv1d_decode needs a conv_state")
    out = torch.empty((num_reqs, channels), dtype=x.dtype, device=x.device)
    if num_reqs == 0:
        return out
    block_c = min(256, triton.next_power_of_2(channels))
    _conv_decode_kernel[(num_reqs, triton.cdiv(channels, block_c))](
        x, weight, bias if bias is not None else weight, conv_state, out, state_indices,
        channels, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        *conv_state.stride(), out.stride(0), WIDTH=width, HAS_BIAS=bias is not None,
        SILU=activation is not None, BLOCK_C=block_c, num_warps=4,
        **pdl.kernel_args(x.device, num_reqs))
    return out


def _check_conv(x, weight, bias, conv_state, activation) -> int:
    """The kernel width K, after checking the shapes agree."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"conv1d activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"conv1d needs x [T, C] and weight [C, K], got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    channels, width = weight.shape
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"conv1d bias must be [{channels}], got {tuple(bias.shape)}")
    if conv_state is not None and (conv_state.dim() != 3
                                   or tuple(conv_state.shape[1:]) != (channels, width - 1)):
        raise ValueError(f"conv_state must be [slots, {channels}, {width - 1}], got "
                         f"{tuple(conv_state.shape)}")
    return width


@triton.jit
def _conv_prefill_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, query_start_ptr,
                         state_idx_ptr, has_init_ptr, channels,
                         x_stride_t, x_stride_c, w_stride_c, w_stride_k,
                         s_stride_s, s_stride_c, s_stride_k, o_stride_t,
                         WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                         SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program per (token tile, request, channel block)."""
    tile = tl.program_id(0)
    req = tl.program_id(1)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(query_start_ptr + req).to(tl.int64)
    q_len = tl.load(query_start_ptr + req + 1) - start
    if tile * BLOCK_T >= q_len:
        return
    offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    c_valid = offs_c < channels
    t_valid = offs_t < q_len
    if HAS_STATE:
        slot = tl.load(state_idx_ptr + req).to(tl.int64)
        use_history = (slot >= 0) & (tl.load(has_init_ptr + req) != 0)
        history = state_ptr + slot * s_stride_s + offs_c[None, :] * s_stride_c
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_valid, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH):
        # Input position j of the window; j < 0 lies in the history (its column K-1+j).
        j = offs_t - (WIDTH - 1) + k
        new_mask = (t_valid & (j >= 0))[:, None] & c_valid[None, :]
        value = tl.load(x_ptr + (start + j)[:, None] * x_stride_t
                        + offs_c[None, :] * x_stride_c, mask=new_mask, other=0.0)
        value = value.to(tl.float32)
        if HAS_STATE:
            old_mask = (t_valid & (j < 0) & use_history)[:, None] & c_valid[None, :]
            value += tl.load(history + (WIDTH - 1 + j)[:, None] * s_stride_k,
                             mask=old_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_c * w_stride_c + k * w_stride_k, mask=c_valid, other=0.0)
        acc += value * w.to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + (start + offs_t)[:, None] * o_stride_t + offs_c[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=t_valid[:, None] & c_valid[None, :])


@triton.jit
def _conv_state_prefill_kernel(x_ptr, state_ptr, query_start_ptr, state_idx_ptr, has_init_ptr,
                               channels, x_stride_t, x_stride_c,
                               s_stride_s, s_stride_c, s_stride_k,
                               WIDTH: tl.constexpr, BLOCK_C: tl.constexpr):
    """One program per (request, channel block): the state becomes the last K-1 inputs
    of history + new tokens. Column q takes input j = q_len - (K-1) + q, which lies in
    the history (column q + q_len) when j < 0: the columns are written in increasing
    order, each read before it is written, by the thread that owns its channel."""
    req = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(state_idx_ptr + req).to(tl.int64)
    if slot < 0:
        return
    c_valid = offs_c < channels
    start = tl.load(query_start_ptr + req).to(tl.int64)
    q_len = tl.load(query_start_ptr + req + 1) - start
    use_history = tl.load(has_init_ptr + req) != 0
    history = state_ptr + slot * s_stride_s + offs_c * s_stride_c
    for q in tl.static_range(WIDTH - 1):
        j = q_len - (WIDTH - 1) + q
        new = tl.load(x_ptr + (start + j) * x_stride_t + offs_c * x_stride_c,
                      mask=c_valid & (j >= 0), other=0.0)
        old = tl.load(history + (q + q_len) * s_stride_k,
                      mask=c_valid & (j < 0) & use_history, other=0.0)
        value = new.to(tl.float32) + old.to(tl.float32)
        tl.store(history + q * s_stride_k, value.to(state_ptr.dtype.element_ty), mask=c_valid)


@triton.jit
def _conv_decode_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, state_idx_ptr, channels,
                        x_stride_t, x_stride_c, w_stride_c, w_stride_k,
                        s_stride_s, s_stride_c, s_stride_k, o_stride_t,
                        WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """One program per (request, channel block). The history columns are read one by
    one and each is written one column to the left right after it is read (by the same
    thread: the loads and stores share the channel layout)."""
    pdl.enter(PDL)
    req = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_valid = offs_c < channels
    slot = tl.load(state_idx_ptr + req).to(tl.int64)
    has_slot = slot >= 0
    history = state_ptr + slot * s_stride_s + offs_c * s_stride_c
    x = tl.load(x_ptr + req * x_stride_t + offs_c * x_stride_c, mask=c_valid, other=0.0)
    acc = tl.zeros([BLOCK_C], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_valid, other=0.0).to(tl.float32)
    for k in tl.static_range(WIDTH - 1):
        value = tl.load(history + k * s_stride_k, mask=c_valid & has_slot, other=0.0)
        if k > 0:
            tl.store(history + (k - 1) * s_stride_k, value, mask=c_valid & has_slot)
        w = tl.load(w_ptr + offs_c * w_stride_c + k * w_stride_k, mask=c_valid, other=0.0)
        acc += value.to(tl.float32) * w.to(tl.float32)
    if WIDTH > 1:
        tl.store(history + (WIDTH - 2) * s_stride_k, x.to(state_ptr.dtype.element_ty),
                 mask=c_valid & has_slot)
    w = tl.load(w_ptr + offs_c * w_stride_c + (WIDTH - 1) * w_stride_k, mask=c_valid,
                other=0.0)
    acc += x.to(tl.float32) * w.to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + req * o_stride_t + offs_c, acc.to(out_ptr.dtype.element_ty),
             mask=c_valid)


# ---------------------------------------------------------------------- SSD prefill
def ssd_prefill(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                dt_limit: tuple[float, float], chunk_size: int,
                ssm_state: torch.Tensor | None, md: MambaMetadata) -> torch.Tensor:
    """x [T, H, P], dt [T, H], A_log/D/dt_bias [H], B/C [T, G, N] -> y [T, H, P].

    Request i starts from ssm_state[slot] [H, P, N] when has_initial_state[i] (else
    zeros) and its final state is written there. ssm_state None: zero initial states,
    nothing stored. Plans its chunks on the host (md's host copies when present):
    prefill steps are not captured in CUDA graphs."""
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    _check_ssd(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    out = _output(num_tokens, (num_heads, head_dim), x, md)
    if md.num_reqs == 0:
        return out
    A = decay_rates(A_log)  # (as the torch ops: prefill steps are eager, the launch is cheap)
    num_chunks, chunk_start, chunk_len, req_chunks = _chunk_table(md, chunk_size, x.device)
    dev = dict(device=x.device, dtype=torch.float32)
    dt_out = torch.empty((num_chunks, num_heads, chunk_size), **dev)
    # Cumulative dt * A within each chunk, in float64: see _chunk_decay_kernel.
    decay = torch.empty((num_chunks, num_heads, chunk_size), device=x.device,
                        dtype=torch.float64)
    cb = torch.empty((num_chunks, num_groups, chunk_size, chunk_size), **dev)
    states = torch.empty((num_chunks, num_heads, head_dim, state_size), **dev)
    block_m = max(16, min(64, triton.next_power_of_2(chunk_size) // 4))
    m_tiles = triton.cdiv(chunk_size, block_m)
    block_p = max(16, min(64, triton.next_power_of_2(head_dim)))
    block_n = max(16, min(64, triton.next_power_of_2(state_size)))
    heads_per_group = num_heads // num_groups
    ieee = x.dtype == torch.float32
    if num_chunks:
        block_l = triton.next_power_of_2(chunk_size)
        block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // block_l))
        _chunk_decay_kernel[(num_chunks, triton.cdiv(num_heads, block_h))](
            dt, A, dt_bias, dt_out, decay, chunk_start, chunk_len, num_heads,
            float(dt_limit[0]), float(dt_limit[1]), dt.stride(0), dt.stride(1),
            CHUNK=chunk_size, BLOCK_L=block_l, BLOCK_H=block_h, num_warps=4)
        _chunk_cb_kernel[(num_chunks * m_tiles, num_groups, m_tiles)](
            C, B, cb, chunk_start, chunk_len, state_size, *C.stride(), *B.stride(),
            M_TILES=m_tiles, CHUNK=chunk_size, BLOCK_M=block_m, BLOCK_N=block_n,
            IEEE=ieee, num_warps=4)
        _chunk_state_kernel[(num_chunks, num_heads,
                             triton.cdiv(head_dim, block_p) * triton.cdiv(state_size, block_n))](
            x, B, dt_out, decay, states, chunk_start, chunk_len, head_dim, state_size,
            *x.stride(), *B.stride(), HEADS_PER_GROUP=heads_per_group, CHUNK=chunk_size,
            BLOCK_K=block_m, BLOCK_P=block_p, BLOCK_N=block_n, IEEE=ieee, num_warps=4)
    has_state = ssm_state is not None
    block = min(1024, triton.next_power_of_2(head_dim * state_size))
    _state_passing_kernel[(md.num_reqs, num_heads, triton.cdiv(head_dim * state_size, block))](
        states, decay, ssm_state if has_state else states, req_chunks, md.state_indices,
        md.has_initial_state, num_heads, head_dim, state_size,
        *(ssm_state.stride() if has_state else (0, 0, 0, 0)),
        CHUNK=chunk_size, HAS_STATE=has_state, BLOCK=block, num_warps=4)
    if num_chunks:
        _chunk_scan_kernel[(num_chunks * m_tiles, num_heads, triton.cdiv(head_dim, block_p))](
            x, C, D, dt_out, decay, cb, states, out, chunk_start, chunk_len, head_dim,
            state_size, *x.stride(), *C.stride(), *out.stride(),
            HEADS_PER_GROUP=heads_per_group, M_TILES=m_tiles, CHUNK=chunk_size,
            BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_N=block_n, IEEE=ieee, num_warps=4)
    return out


def _chunk_table(md: MambaMetadata, chunk_size: int, device: torch.device):
    """(number of chunks, chunk_start [n], chunk_len [n], req_chunks [R + 1]) on the
    device, int32: chunk c covers tokens chunk_start[c] + [0, chunk_len[c]) and request
    i owns chunks req_chunks[i]:req_chunks[i + 1], in order. Made once per step (kept in
    md.derived for the step's other layers), with one non-blocking host-to-device copy
    from pinned memory: a pageable copy would wait for the device to drain."""
    key = f"chunk_table/{chunk_size}/{device}"
    if key not in md.derived:
        md.derived[key] = _make_chunk_table(md, chunk_size, device)
    return md.derived[key]


def _make_chunk_table(md: MambaMetadata, chunk_size: int, device: torch.device):
    qsl = md.query_start_loc_cpu if md.query_start_loc_cpu is not None \
        else md.query_start_loc.cpu()
    qsl = qsl.to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    per_req = (lens + chunk_size - 1) // chunk_size
    req_chunks = torch.zeros(len(lens) + 1, dtype=torch.int64)
    torch.cumsum(per_req, 0, out=req_chunks[1:])
    num_chunks = int(req_chunks[-1])
    owner = torch.repeat_interleave(torch.arange(len(lens)), per_req)
    offset = (torch.arange(num_chunks) - req_chunks[owner]) * chunk_size
    chunk_start = qsl[owner] + offset
    chunk_len = torch.clamp(lens[owner] - offset, max=chunk_size)
    table = torch.cat([chunk_start, chunk_len, req_chunks]).to(torch.int32)
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    return (num_chunks, table[:num_chunks], table[num_chunks:2 * num_chunks],
            table[2 * num_chunks:])


def _check_ssd(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state) -> None:
    if x.dim() != 3 or dt.dim() != 2 or B.dim() != 3:
        raise ValueError(f"the SSD needs x [T, H, P], dt [T, H], B and C [T, G, N], got "
                         f"{tuple(x.shape)}, {tuple(dt.shape)}, {tuple(B.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    if tuple(dt.shape) != (num_tokens, num_heads) or B.shape[0] != num_tokens \
            or C.shape != B.shape:
        raise ValueError(f"SSD shapes disagree: x {tuple(x.shape)}, dt {tuple(dt.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    if num_heads % num_groups:
        raise ValueError(f"{num_heads} heads do not split into {num_groups} groups")
    for name, t in (("A_log", A_log), ("D", D), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (num_heads,):
            raise ValueError(f"{name} must be [{num_heads}], got {tuple(t.shape)}")
    if not (x.dtype == B.dtype == C.dtype):
        raise ValueError(f"x, B and C must share a dtype, got {x.dtype}, {B.dtype}, {C.dtype}")
    if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
        raise ValueError(f"dt_limit must be (low, high) with low <= high, got {dt_limit}")
    if ssm_state is not None and (ssm_state.dim() != 4 or tuple(ssm_state.shape[1:])
                                  != (num_heads, head_dim, state_size)):
        raise ValueError(f"ssm_state must be [slots, {num_heads}, {head_dim}, {state_size}], "
                         f"got {tuple(ssm_state.shape)}")


@triton.jit
def _softplus_dt(dt, dt_bias, dt_min, dt_max):
    """clamp(softplus(dt + dt_bias), dt_min, dt_max) in float32."""
    v = dt.to(tl.float32) + dt_bias.to(tl.float32)
    return tl.minimum(tl.maximum(softplus(v), dt_min), dt_max)


@triton.jit
def softplus(v):
    """softplus(v) = max(v, 0) + log1p(exp(-|v|)) of a float32 v, with log1p(u) =
    log(1 + u) * u / ((1 + u) - 1), exact where 1 + u rounds (tl has no log1p that the
    interpreter runs too)."""
    u = tl.exp(-tl.abs(v))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.maximum(v, 0.0) + log1p


@triton.jit
def _chunk_decay_kernel(dt_ptr, A_ptr, dt_bias_ptr, dt_out_ptr, decay_ptr, chunk_start_ptr,
                        chunk_len_ptr, num_heads, dt_min, dt_max, dt_stride_t, dt_stride_h,
                        CHUNK: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr):
    """Per (chunk, head block): dt_out[c, h, t] (0 past the chunk's end) and decay[c, h,
    t] = sum over the chunk's tokens s <= t of dt[s] * A[h] (so the last entry is the
    whole chunk's decay, whatever its length).

    The scan weighs token s at token t by exp(decay[t] - decay[s]). A chunk's decay runs
    to a few hundred (dt * A about -1 a token over 256 tokens), where float32 values are
    1e-5 apart, which every weight inherits; kept in float64 and subtracted before the
    exp, a difference is exact to float32 rounding. (Measured on random inputs, chunk
    256: half the float32 output error, 1.3e-6 instead of 2.9e-6 of the largest value,
    and an eighth of the final state's.)"""
    chunk = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_t = tl.arange(0, BLOCK_L)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    h_valid = offs_h < num_heads
    mask = (offs_t < length)[:, None] & h_valid[None, :]
    raw = tl.load(dt_ptr + (start + offs_t)[:, None] * dt_stride_t
                  + offs_h[None, :] * dt_stride_h, mask=mask, other=0.0)
    bias = tl.load(dt_bias_ptr + offs_h, mask=h_valid, other=0.0)
    dt = tl.where(mask, _softplus_dt(raw, bias[None, :], dt_min, dt_max), 0.0)
    a = tl.load(A_ptr + offs_h, mask=h_valid, other=0.0).to(tl.float32)
    decay = tl.cumsum((dt * a[None, :]).to(tl.float64), 0)
    rows = (chunk.to(tl.int64) * num_heads + offs_h[None, :]) * CHUNK + offs_t[:, None]
    out_mask = (offs_t < CHUNK)[:, None] & h_valid[None, :]
    tl.store(dt_out_ptr + rows, dt, mask=out_mask)
    tl.store(decay_ptr + rows, decay, mask=out_mask)


@triton.jit
def _chunk_cb_kernel(C_ptr, B_ptr, cb_ptr, chunk_start_ptr, chunk_len_ptr, state_size,
                     c_stride_t, c_stride_g, c_stride_n, b_stride_t, b_stride_g, b_stride_n,
                     M_TILES: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """cb[c, g, t, s] = C[t] . B[s] of group g, for the tiles on or below the diagonal
    of the chunk's tokens (those the causal scan reads). One program per tile."""
    chunk = tl.program_id(0) // M_TILES
    m_tile = tl.program_id(0) % M_TILES
    group = tl.program_id(1)
    k_tile = tl.program_id(2)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    if (k_tile > m_tile) | (m_tile * BLOCK_M >= length):
        return
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = k_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_valid = offs_m < length
    k_valid = offs_k < length
    c_rows = C_ptr + (start + offs_m)[:, None] * c_stride_t + group * c_stride_g
    b_rows = B_ptr + (start + offs_k)[:, None] * b_stride_t + group * b_stride_g
    acc = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)
    for n in range(0, state_size, BLOCK_N):
        n_valid = (n + offs_n) < state_size
        c = tl.load(c_rows + (n + offs_n)[None, :] * c_stride_n,
                    mask=m_valid[:, None] & n_valid[None, :], other=0.0)
        b = tl.load(b_rows + (n + offs_n)[None, :] * b_stride_n,
                    mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        acc += _dot(c, tl.trans(b), IEEE)
    base = cb_ptr + ((chunk.to(tl.int64) * tl.num_programs(1) + group) * CHUNK) * CHUNK
    tl.store(base + offs_m[:, None] * CHUNK + offs_k[None, :], acc,
             mask=(offs_m < CHUNK)[:, None] & (offs_k < CHUNK)[None, :])


@triton.jit
def _chunk_state_kernel(x_ptr, B_ptr, dt_ptr, decay_ptr, states_ptr, chunk_start_ptr,
                        chunk_len_ptr, head_dim, state_size,
                        x_stride_t, x_stride_h, x_stride_p, b_stride_t, b_stride_g, b_stride_n,
                        HEADS_PER_GROUP: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                        IEEE: tl.constexpr):
    """The state a chunk leaves from a zero start: states[c, h] [P, N] = sum over its
    tokens s of exp(decay_end - decay[s]) * dt[s] * x[s] B[s]^T. One program per
    (chunk, head, P x N tile)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    n_tiles = tl.cdiv(state_size, BLOCK_N)
    offs_p = (tl.program_id(2) // n_tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (tl.program_id(2) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    p_valid = offs_p < head_dim
    n_valid = offs_n < state_size
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    group = head // HEADS_PER_GROUP
    row = (chunk.to(tl.int64) * tl.num_programs(1) + head) * CHUNK
    decay_end = tl.load(decay_ptr + row + CHUNK - 1)
    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for k in range(0, length, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_valid = offs_k < length
        x = tl.load(x_ptr + (start + offs_k)[:, None] * x_stride_t + head * x_stride_h
                    + offs_p[None, :] * x_stride_p,
                    mask=k_valid[:, None] & p_valid[None, :], other=0.0)
        b = tl.load(B_ptr + (start + offs_k)[:, None] * b_stride_t + group * b_stride_g
                    + offs_n[None, :] * b_stride_n,
                    mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        dt = tl.load(dt_ptr + row + offs_k, mask=k_valid, other=0.0)
        decay = tl.load(decay_ptr + row + offs_k, mask=k_valid, other=0.0)
        weight = tl.where(k_valid, tl.exp((decay_end - decay).to(tl.float32)) * dt, 0.0)
        acc += _dot(tl.trans(x), (b.to(tl.float32) * weight[:, None]).to(x.dtype), IEEE)
    base = states_ptr + (chunk.to(tl.int64) * tl.num_programs(1) + head) * head_dim * state_size
    tl.store(base + offs_p[:, None] * state_size + offs_n[None, :], acc,
             mask=p_valid[:, None] & n_valid[None, :])


@triton.jit
def _state_passing_kernel(states_ptr, decay_ptr, ssm_state_ptr, req_chunks_ptr,
                          state_idx_ptr, has_init_ptr, num_heads, head_dim, state_size,
                          s_stride_s, s_stride_h, s_stride_p, s_stride_n,
                          CHUNK: tl.constexpr, HAS_STATE: tl.constexpr, BLOCK: tl.constexpr):
    """Walks one request's chunks in order (one program per request, head and block of
    its P x N state): replaces each chunk's own end state in `states` by the state the
    chunk starts from, and writes the request's final state to its slot."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    size = head_dim * state_size
    valid = offs < size
    # int64, as the loop variable (the chunk row) is then.
    first = tl.load(req_chunks_ptr + req).to(tl.int64)
    end = tl.load(req_chunks_ptr + req + 1).to(tl.int64)
    state = tl.zeros([BLOCK], tl.float32)
    if HAS_STATE:
        slot = tl.load(state_idx_ptr + req).to(tl.int64)
        has_slot = slot >= 0
        use_initial = has_slot & (tl.load(has_init_ptr + req) != 0)
        slot_ptrs = ssm_state_ptr + slot * s_stride_s + head * s_stride_h \
            + (offs // state_size) * s_stride_p + (offs % state_size) * s_stride_n
        state = tl.load(slot_ptrs, mask=valid & use_initial, other=0.0).to(tl.float32)
    for chunk in range(first, end):
        row = chunk * num_heads + head
        ptrs = states_ptr + row * size + offs
        own = tl.load(ptrs, mask=valid, other=0.0)
        tl.store(ptrs, state, mask=valid)
        chunk_decay = tl.load(decay_ptr + row * CHUNK + CHUNK - 1).to(tl.float32)
        state = tl.exp(chunk_decay) * state + own
    if HAS_STATE:
        tl.store(slot_ptrs, state.to(ssm_state_ptr.dtype.element_ty), mask=valid & has_slot)


@triton.jit
def _chunk_scan_kernel(x_ptr, C_ptr, D_ptr, dt_ptr, decay_ptr, cb_ptr, states_ptr, out_ptr,
                       chunk_start_ptr, chunk_len_ptr, head_dim, state_size,
                       x_stride_t, x_stride_h, x_stride_p, c_stride_t, c_stride_g, c_stride_n,
                       o_stride_t, o_stride_h, o_stride_p,
                       HEADS_PER_GROUP: tl.constexpr, M_TILES: tl.constexpr,
                       CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Outputs of a tile of a chunk's tokens t (one program per (chunk, token tile),
    head, P block): y[t] = exp(decay[t]) C[t] . start_state + sum over s <= t in the
    chunk of cb[t, s] exp(decay[t] - decay[s]) dt[s] x[s], plus D x[t]."""
    chunk = tl.program_id(0) // M_TILES
    m_tile = tl.program_id(0) % M_TILES
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    if m_tile * BLOCK_M >= length:
        return
    num_heads = tl.num_programs(1)
    group = head // HEADS_PER_GROUP
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_valid = offs_m < length
    p_valid = offs_p < head_dim
    row = (chunk.to(tl.int64) * num_heads + head) * CHUNK
    decay_m = tl.load(decay_ptr + row + offs_m, mask=m_valid, other=0.0)  # float64

    # From the chunk's start state [P, N].
    acc = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    state_base = states_ptr + (chunk.to(tl.int64) * num_heads + head) * head_dim * state_size
    for n in range(0, state_size, BLOCK_N):
        n_valid = (n + offs_n) < state_size
        c = tl.load(C_ptr + (start + offs_m)[:, None] * c_stride_t + group * c_stride_g
                    + (n + offs_n)[None, :] * c_stride_n,
                    mask=m_valid[:, None] & n_valid[None, :], other=0.0)
        state = tl.load(state_base + offs_p[:, None] * state_size + (n + offs_n)[None, :],
                        mask=p_valid[:, None] & n_valid[None, :], other=0.0)
        acc += _dot(c, tl.trans(state.to(c.dtype)), IEEE)
    acc = acc * tl.exp(decay_m.to(tl.float32))[:, None]

    # Within the chunk, causally. Decays relative to the tile's first token (float64
    # differences, then float32): a pair's float32 gap is then exact to rounding.
    tile_start = tl.load(decay_ptr + row + m_tile * BLOCK_M)
    rel_m = (decay_m - tile_start).to(tl.float32)
    cb_base = cb_ptr + ((chunk.to(tl.int64) * (num_heads // HEADS_PER_GROUP) + group)
                        * CHUNK) * CHUNK
    for k in range(0, (m_tile + 1) * BLOCK_M, BLOCK_M):
        offs_k = k + tl.arange(0, BLOCK_M)
        k_valid = offs_k < length
        cb = tl.load(cb_base + offs_m[:, None] * CHUNK + offs_k[None, :],
                     mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        dt_k = tl.load(dt_ptr + row + offs_k, mask=k_valid, other=0.0)
        rel_k = (tl.load(decay_ptr + row + offs_k, mask=k_valid, other=0.0)
                 - tile_start).to(tl.float32)
        causal = (offs_k[None, :] <= offs_m[:, None]) & k_valid[None, :] & m_valid[:, None]
        # rel_m - rel_k <= 0 where causal; elsewhere exp(0), then zeroed.
        gap = tl.where(causal, rel_m[:, None] - rel_k[None, :], 0.0)
        weight = tl.where(causal, cb * tl.exp(gap) * dt_k[None, :], 0.0)
        x_k = tl.load(x_ptr + (start + offs_k)[:, None] * x_stride_t + head * x_stride_h
                      + offs_p[None, :] * x_stride_p,
                      mask=k_valid[:, None] & p_valid[None, :], other=0.0)
        acc += _dot(weight.to(x_k.dtype), x_k, IEEE)

    mask = m_valid[:, None] & p_valid[None, :]
    x_m = tl.load(x_ptr + (start + offs_m)[:, None] * x_stride_t + head * x_stride_h
                  + offs_p[None, :] * x_stride_p, mask=mask, other=0.0)
    acc += tl.load(D_ptr + head).to(tl.float32) * x_m.to(tl.float32)
    tl.store(out_ptr + (start + offs_m)[:, None] * o_stride_t + head * o_stride_h
             + offs_p[None, :] * o_stride_p, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------- SSD decode
def ssd_decode(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
               dt_limit: tuple[float, float], ssm_state: torch.Tensor,
               state_indices: torch.Tensor) -> torch.Tensor:
    """One token per request: x [B, H, P], dt [B, H], B/C [B, G, N] -> y [B, H, P];
    updates ssm_state[state_indices[b]] in place (negative index: a padding row,
    state neither read nor written). One launch, CUDA-graph safe."""
    _check_ssd(x, dt, A_log, B, C, D, dt_bias, dt_limit, ssm_state)
    if ssm_state is None:
        raise ValueError("ssd_decode needs an ssm_state")
    num_reqs, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    out = torch.empty((num_reqs, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_reqs == 0:
        return out
    # Small batches: narrower P tiles, so that enough programs stream the states.
    block_p = min(triton.next_power_of_2(head_dim), 16 if num_reqs * num_heads < 1024 else 32)
    _ssd_decode_kernel[(num_reqs, num_heads, triton.cdiv(head_dim, block_p))](
        x, dt, A_log, B, C, D, dt_bias, ssm_state, state_indices, out,
        float(dt_limit[0]), float(dt_limit[1]), head_dim, state_size,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *ssm_state.stride(),
        *out.stride(), HEADS_PER_GROUP=num_heads // num_groups, BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(state_size), num_warps=4,
        **pdl.kernel_args(x.device, num_reqs))
    return out


@triton.jit
def _ssd_decode_kernel(x_ptr, dt_ptr, A_log_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr,
                       state_idx_ptr, out_ptr, dt_min, dt_max, head_dim, state_size,
                       x_stride_b, x_stride_h, x_stride_p, dt_stride_b, dt_stride_h,
                       b_stride_b, b_stride_g, b_stride_n, c_stride_b, c_stride_g, c_stride_n,
                       s_stride_s, s_stride_h, s_stride_p, s_stride_n,
                       o_stride_b, o_stride_h, o_stride_p,
                       HEADS_PER_GROUP: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """One program per (request, head, P block): the state rows [BLOCK_P, N] are read,
    decayed, given dt * x B^T, written back, and read out through C."""
    pdl.enter(PDL)
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_valid = offs_p < head_dim
    n_valid = offs_n < state_size
    group = head // HEADS_PER_GROUP
    slot = tl.load(state_idx_ptr + req).to(tl.int64)
    state_mask = (slot >= 0) & p_valid[:, None] & n_valid[None, :]
    state_ptrs = state_ptr + slot * s_stride_s + head * s_stride_h \
        + offs_p[:, None] * s_stride_p + offs_n[None, :] * s_stride_n
    state = tl.load(state_ptrs, mask=state_mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + req * x_stride_b + head * x_stride_h + offs_p * x_stride_p,
                mask=p_valid, other=0.0).to(tl.float32)
    b = tl.load(B_ptr + req * b_stride_b + group * b_stride_g + offs_n * b_stride_n,
                mask=n_valid, other=0.0).to(tl.float32)
    c = tl.load(C_ptr + req * c_stride_b + group * c_stride_g + offs_n * c_stride_n,
                mask=n_valid, other=0.0).to(tl.float32)
    dt = _softplus_dt(tl.load(dt_ptr + req * dt_stride_b + head * dt_stride_h),
                      tl.load(dt_bias_ptr + head), dt_min, dt_max)
    A = -tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
    decay = tl.exp(dt * A)
    state = state * decay + (dt * x)[:, None] * b[None, :]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=state_mask)
    y = tl.sum(state * c[None, :], 1) + tl.load(D_ptr + head).to(tl.float32) * x
    tl.store(out_ptr + req * o_stride_b + head * o_stride_h + offs_p * o_stride_p,
             y.to(out_ptr.dtype.element_ty), mask=p_valid)


# ---------------------------------------------------------------------- shared
def _output(num_tokens: int, row_shape: tuple[int, ...], x: torch.Tensor,
            md: MambaMetadata) -> torch.Tensor:
    """A prefill output [num_tokens, *row_shape]. Rows past md.num_tokens (padding
    tokens that no request owns, which no program writes) are zeros."""
    if md.num_tokens > num_tokens:
        raise ValueError(f"the metadata has {md.num_tokens} tokens, the input {num_tokens}")
    out = torch.empty((num_tokens, *row_shape), dtype=x.dtype, device=x.device)
    if md.num_tokens < num_tokens:
        out[md.num_tokens:].zero_()
    return out


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """Float32 operands as IEEE float32 (not TF32), so a float32 model stays
    comparable with transformers; half operands on the tensor cores."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


# ---------------------------------------------------------------- gated RMSNorm
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float, group_size: int | None = None,
                   norm_first: bool = False, sigmoid_gate: bool = False) -> torch.Tensor:
    """weight * rmsnorm(x * silu(gate)) over each row of x [T, W] (with norm_first:
    weight * rmsnorm(x) * silu(gate), or with sigmoid_gate too * sigmoid(gate)), the mean
    square taken per group of group_size consecutive features (None: the whole width on
    this rank, one tensor-parallel rank or a model without TP), in float32, returned in
    x's dtype. One launch instead of torch's eight."""
    if sigmoid_gate and not norm_first:
        raise ValueError("gated_rms_norm: a sigmoid gate is applied after the norm "
                         "(norm_first)")
    num_tokens, width = x.shape
    if gate.shape != x.shape or weight.shape != (width,):
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)}, "
                         f"weight {tuple(weight.shape)}")
    group_size = width if group_size is None else group_size
    if group_size <= 0 or width % group_size != 0:
        raise ValueError(f"gated_rms_norm: group_size {group_size} does not divide the "
                         f"width {width}")
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(group_size)
    _gated_rms_norm_kernel[(num_tokens, width // group_size)](
        x, gate, weight, out, group_size, x.stride(0), gate.stride(0), out.stride(0),
        float(eps), BLOCK=block, NORM_FIRST=norm_first, SIGMOID_GATE=sigmoid_gate,
        num_warps=min(16, max(1, block // 256)),
        **pdl.kernel_args(x.device, num_tokens))
    return out


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, group_size, x_stride, g_stride,
                           o_stride, eps, BLOCK: tl.constexpr, NORM_FIRST: tl.constexpr,
                           SIGMOID_GATE: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    valid = tl.arange(0, BLOCK) < group_size
    x = tl.load(x_ptr + row * x_stride + offs, mask=valid, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_stride + offs, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID_GATE:
        act_g = tl.sigmoid(g)
    else:
        act_g = g * tl.sigmoid(g)
    h = x if NORM_FIRST else x * act_g
    h = h * tl.rsqrt(tl.sum(h * h, 0) / group_size + eps)
    w = tl.load(w_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    out = w * h
    if NORM_FIRST:
        out = out * act_g
    tl.store(out_ptr + row * o_stride + offs, out.to(out_ptr.dtype.element_ty), mask=valid)
