"""The gated delta rule as Triton kernels (CUDA), same signatures and results as
gated_delta.py's torch code, against which they are tested: the decode step (a decay
per head, or per key feature: Kimi delta attention's), and the prefill in chunks
(SPINDLE_GDN_TRITON_PREFILL=1, a decay per head only; by default the prefill on CUDA is
gated_delta.gated_delta_prefill, torch with every chunk of the step batched, a few
dozen launches a layer).

The Triton prefill is one launch: a program per (request, value head, block of value
features) walks its request's chunks in order, the state block [Dk, BLOCK_V] in
registers, each chunk evaluated as gated_delta.py's module docstring unrolls it (its
unit lower-triangular system solved by forward substitution, row after row)."""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from spindle.layers import pdl
from spindle.layers.mamba import gated_delta
from spindle.layers.mamba.gated_delta import L2_EPS
from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.triton_ops import softplus
from spindle.switches import on_off

# "1": the Triton prefill kernel on CUDA instead of gated_delta.py's batched torch form.
TRITON_PREFILL_ENV = "SPINDLE_GDN_TRITON_PREFILL"
# Tokens per chunk of the Triton prefill: the forward substitution's rows (a loop of
# CHUNK steps over [CHUNK, BLOCK_V]) against the chunks a program walks one by one.
PREFILL_CHUNK = 32


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                        state: torch.Tensor | None, md: MambaMetadata,
                        chunk_size: int = 64, batched: bool | None = None,
                        beta_scale: float = 1.0) -> torch.Tensor:
    """gated_delta.gated_delta_prefill's contract. With SPINDLE_GDN_TRITON_PREFILL=1 the
    Triton kernel evaluates it (in chunks of PREFILL_CHUNK tokens: chunk_size and
    batched, which choose among the torch evaluations, do not apply to it); it has no
    decay per key feature, and refuses one."""
    if not on_off(TRITON_PREFILL_ENV, False):
        return gated_delta.gated_delta_prefill(q, k, v, a, b, A_log, dt_bias, state, md,
                                               chunk_size, batched, beta_scale)
    if a.dim() == 3:
        raise ValueError(f"{TRITON_PREFILL_ENV}=1: the Triton prefill has no decay per key "
                         "feature (Kimi delta attention's); unset it for this model")
    return triton_prefill(q, k, v, a, b, A_log, dt_bias, state, md, beta_scale)


def triton_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                   state: torch.Tensor | None, md: MambaMetadata, beta_scale: float = 1.0,
                   chunk: int = PREFILL_CHUNK, block_v: int = 32,
                   num_warps: int = 4) -> torch.Tensor:
    """The prefill in one launch (see the module docstring); chunk and block_v: the
    kernel's tile sizes (powers of two from 16); num_warps: per program (the benchmark
    sweeps these)."""
    _check_decay_per_head(q, k, v, a, b, A_log, dt_bias)
    tokens, value_heads, value_dim = v.shape
    key_heads, key_dim = q.shape[1], q.shape[2]
    if state is not None and state.shape[1:] != (value_heads, key_dim, value_dim):
        raise ValueError(f"the state must be [slots, {value_heads}, {key_dim}, {value_dim}], "
                         f"got {tuple(state.shape)}")
    for name, size in (("chunk", chunk), ("block_v", block_v)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two from 16, got {size}")
    out = torch.zeros_like(v)
    if md.num_reqs == 0 or tokens == 0:
        return out
    block_v = min(block_v, max(16, triton.next_power_of_2(value_dim)))
    states = state if state is not None else out  # (neither read nor written then)
    _prefill_kernel[(md.num_reqs, value_heads, triton.cdiv(value_dim, block_v))](
        q, k, v, a, b, A_log, dt_bias, states, md.query_start_loc, md.state_indices,
        md.has_initial_state, out, key_dim, value_dim,
        *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(),
        *(state.stride() if state is not None else (0, 0, 0, 0)), *out.stride(),
        L2_EPS, key_dim ** -0.5, float(beta_scale),
        VALUES_PER_KEY=value_heads // key_heads, HAS_STATE=state is not None,
        BLOCK_K=max(16, triton.next_power_of_2(key_dim)), BLOCK_V=block_v, CHUNK=chunk,
        IEEE=v.is_cuda, num_warps=num_warps)
    return out


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                       state: torch.Tensor, state_indices: torch.Tensor,
                       beta_scale: float = 1.0) -> torch.Tensor:
    """One step per request: q/k [B, Hk, Dk], v [B, Hv, Dv], a/b [B, Hv] (or a [B, Hv, Dk]
    and dt_bias [Hv, Dk]: a decay per key feature) -> o [B, Hv, Dv]; state [S, Hv, Dk, Dv]
    updated in place at state_indices [B] (a negative index: padding, state neither read
    nor written); beta_scale: a factor on beta. One launch, CUDA-graph safe."""
    gated_delta._check_shapes(q, k, v, a, b, A_log, dt_bias)
    gated_delta._check_rows(v, state_indices)
    per_key = a.dim() == 3
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
        *q.stride(), *k.stride(), *v.stride(), *a.stride()[:2],
        a.stride(2) if per_key else 0, *b.stride(),
        *(dt_bias.stride() if per_key else (dt_bias.stride(0), 0)), *state.stride(),
        *out.stride(), L2_EPS, key_dim ** -0.5, float(beta_scale),
        VALUES_PER_KEY=value_heads // key_heads, DECAY_PER_KEY=per_key,
        BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v, num_warps=4,
        **pdl.kernel_args(v.device, num_reqs))
    return out


def _check_decay_per_head(q, k, v, a, b, A_log, dt_bias) -> None:
    """gated_delta's shape checks, and a decay per head: the prefill kernel reads one a
    per token and head."""
    gated_delta._check_shapes(q, k, v, a, b, A_log, dt_bias)
    if a.dim() != 2:
        raise ValueError(f"the Triton gated delta prefill takes a decay per head (a [T, Hv]), "
                         f"got a {tuple(a.shape)}: a decay per key feature runs in "
                         "gated_delta.py's torch code")


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
                   state_idx_ptr, out_ptr, key_dim, value_dim,
                   q_stride_b, q_stride_h, q_stride_d, k_stride_b, k_stride_h, k_stride_d,
                   v_stride_b, v_stride_h, v_stride_d, a_stride_b, a_stride_h, a_stride_d,
                   b_stride_b, b_stride_h, dt_stride_h, dt_stride_d,
                   s_stride_s, s_stride_h, s_stride_k, s_stride_v,
                   o_stride_b, o_stride_h, o_stride_d, l2_eps, q_scale, beta_scale,
                   VALUES_PER_KEY: tl.constexpr, DECAY_PER_KEY: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """One program per (request, value head, block of value features): the state
    columns [Dk, BLOCK_V] are decayed (by one factor, or DECAY_PER_KEY one per key
    feature, a row of the state), corrected by the delta rule, written back and read
    out through q. Each program normalises its q and k itself (Dk is small)."""
    pdl.enter(PDL)
    req = tl.program_id(0).to(tl.int64)
    head, key_head, offs_k, offs_v, k_valid, v_valid = _head_block(
        key_dim, value_dim, VALUES_PER_KEY, BLOCK_K, BLOCK_V)
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
    # beta = sigmoid(b) in b's own dtype, as the torch op (and transformers) computes it.
    b_raw = tl.load(b_ptr + req * b_stride_b + head * b_stride_h)
    beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32) * beta_scale
    rate = -tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
    if DECAY_PER_KEY:
        a = tl.load(a_ptr + req * a_stride_b + head * a_stride_h + offs_k * a_stride_d,
                    mask=k_valid, other=0.0).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + head * dt_stride_h + offs_k * dt_stride_d,
                          mask=k_valid, other=0.0).to(tl.float32)
        state = state * tl.exp(rate * softplus(a + dt_bias))[:, None]
    else:
        a = tl.load(a_ptr + req * a_stride_b + head * a_stride_h).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
        state = state * tl.exp(rate * softplus(a + dt_bias))
    error = v - tl.sum(state * k[:, None], 0)
    state = state + k[:, None] * (beta * error)[None, :]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=state_mask)
    o = tl.sum(state * q[:, None], 0)
    tl.store(out_ptr + req * o_stride_b + head * o_stride_h + offs_v * o_stride_d,
             o.to(out_ptr.dtype.element_ty), mask=v_valid)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
                    qsl_ptr, state_idx_ptr, has_init_ptr, out_ptr, key_dim, value_dim,
                    q_stride_t, q_stride_h, q_stride_d, k_stride_t, k_stride_h, k_stride_d,
                    v_stride_t, v_stride_h, v_stride_d, a_stride_t, a_stride_h,
                    b_stride_t, b_stride_h, s_stride_s, s_stride_h, s_stride_k, s_stride_v,
                    o_stride_t, o_stride_h, o_stride_d, l2_eps, q_scale, beta_scale,
                    VALUES_PER_KEY: tl.constexpr, HAS_STATE: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
                    IEEE: tl.constexpr):
    """One program per (request, value head, block of value features): the state block
    enters from its slot (or as zeros), passes through the request's chunks in order,
    and is stored back to the slot; each chunk's outputs are stored as it goes."""
    req = tl.program_id(0)
    head, key_head, offs_k, offs_v, k_valid, v_valid = _head_block(
        key_dim, value_dim, VALUES_PER_KEY, BLOCK_K, BLOCK_V)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    state_mask = k_valid[:, None] & v_valid[None, :]
    slot = -1
    state = tl.zeros((BLOCK_K, BLOCK_V), tl.float32)
    if HAS_STATE:
        slot = tl.load(state_idx_ptr + req).to(tl.int64)
        state_ptrs = state_ptr + slot * s_stride_s + head * s_stride_h \
            + offs_k[:, None] * s_stride_k + offs_v[None, :] * s_stride_v
        read = (slot >= 0) & (tl.load(has_init_ptr + req) != 0)
        state = tl.load(state_ptrs, mask=state_mask & read, other=0.0).to(tl.float32)
    decay_rate = -tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    rows = tl.arange(0, CHUNK)
    causal = rows[:, None] >= rows[None, :]
    for c0 in range(start, end, CHUNK):
        t = (c0 + rows).to(tl.int64)
        t_valid = t < end
        kv_mask = t_valid[:, None] & k_valid[None, :]
        k = tl.load(k_ptr + t[:, None] * k_stride_t + key_head * k_stride_h
                    + offs_k[None, :] * k_stride_d, mask=kv_mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + t[:, None] * q_stride_t + key_head * q_stride_h
                    + offs_k[None, :] * q_stride_d, mask=kv_mask, other=0.0).to(tl.float32)
        k = k * tl.math.rsqrt(tl.sum(k * k, 1) + l2_eps)[:, None]
        q = q * (tl.math.rsqrt(tl.sum(q * q, 1) + l2_eps) * q_scale)[:, None]
        vv = tl.load(v_ptr + t[:, None] * v_stride_t + head * v_stride_h
                     + offs_v[None, :] * v_stride_d, mask=t_valid[:, None] & v_valid[None, :],
                     other=0.0).to(tl.float32)
        raw_a = tl.load(a_ptr + t * a_stride_t + head * a_stride_h, mask=t_valid, other=0.0)
        g = tl.where(t_valid, decay_rate * softplus(raw_a.to(tl.float32) + dt_bias), 0.0)
        # beta = sigmoid(b) in b's own dtype, as the torch op (and transformers) computes it.
        raw_b = tl.load(b_ptr + t * b_stride_t + head * b_stride_h, mask=t_valid, other=0.0)
        beta = tl.sigmoid(raw_b.to(tl.float32)).to(raw_b.dtype).to(tl.float32) * beta_scale
        beta = tl.where(t_valid, beta, 0.0)
        G = tl.cumsum(g, 0)  # padding rows add 0: G[CHUNK - 1] is the chunk's total
        decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
        k_t = tl.trans(k)
        system = tl.where(rows[:, None] > rows[None, :],
                          beta[:, None] * _dot(k, k_t, IEEE) * decay, 0.0)
        decay_in = tl.exp(G)
        rhs = beta[:, None] * (vv - decay_in[:, None] * _dot(k, state, IEEE))
        u = _forward_substitute(system, rhs, rows)
        o = decay_in[:, None] * _dot(q, state, IEEE) + _dot(_dot(q, k_t, IEEE) * decay, u, IEEE)
        tl.store(out_ptr + t[:, None] * o_stride_t + head * o_stride_h
                 + offs_v[None, :] * o_stride_d, o.to(out_ptr.dtype.element_ty),
                 mask=t_valid[:, None] & v_valid[None, :])
        total = tl.sum(tl.where(rows == CHUNK - 1, G, 0.0), 0)
        to_end = tl.exp(total - G)
        state = tl.exp(total) * state + _dot(tl.trans(k * to_end[:, None]), u, IEEE)
    if HAS_STATE:
        tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty),
                 mask=state_mask & (slot >= 0) & (end > start))


@triton.jit
def _head_block(key_dim, value_dim, VALUES_PER_KEY: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """A program's value head (axis 1), the key head serving it, and its key features and
    block of value features (axis 2), with their masks."""
    head = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    return (head, head // VALUES_PER_KEY, offs_k, offs_v, offs_k < key_dim,
            offs_v < value_dim)


@triton.jit
def _forward_substitute(system, rhs, rows):
    """u with (I + system) u = rhs for a strictly lower triangular system [C, C]: row t
    of u is rhs[t] - system[t, :t] @ u[:t], rows in order (u's later rows are still 0)."""
    u = tl.zeros_like(rhs)
    for t in range(0, rhs.shape[0]):
        pick = rows[:, None] == t
        coefficients = tl.sum(tl.where(pick, system, 0.0), 0)  # system[t, :]
        row = tl.sum(tl.where(pick, rhs, 0.0), 0) - tl.sum(coefficients[:, None] * u, 0)
        u = tl.where(pick, row[None, :], u)
    return u


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in float32: full precision on the GPU (input_precision "ieee"); the
    interpreter multiplies float32 as is."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)
