"""The gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3-Next) in
plain torch: the CPU path, and the reference GPU kernels are tested against.

Per request and value head h, with a state S [Dk, Dv] (keys in, values out) and the
query/key head that serves h (each key head serves Hv / Hk consecutive value heads):

    g_t    = -exp(A_log) * softplus(a_t + dt_bias)       (log of the step's decay, <= 0)
    beta_t = sigmoid(b_t)                                (how far the step writes)
    q_t, k_t: L2-normalised (eps 1e-6), q_t also scaled by Dk ** -0.5
    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (outer) beta_t * (v_t - S_t^T k_t)   (the delta rule: write the error)
    o_t = S_t^T q_t

Layout as in ops.py: token-major and packed ([T, heads, dim]), MambaMetadata saying
where each request starts and which state slot it owns; prefill takes any number of
tokens per request, decode exactly one. Everything is computed in float32; the state
tensor ([S, Hv, Dk, Dv]) is float32 too, and outputs come back in v's dtype.

The prefill evaluates a chunk of L tokens at once. Unrolling the recurrence from the
state S0 entering the chunk, with G_t = g_1 + ... + g_t (the decay from the chunk's
start), every step's write u_t = beta_t * (v_t - (exp(g_t) S_{t-1})^T k_t) satisfies

    u_t + beta_t * sum_{s<t} exp(G_t - G_s) (k_t . k_s) u_s
        = beta_t * v_t - beta_t * exp(G_t) * S0^T k_t

a unit lower-triangular system for the L writes. Then

    o_t   = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s
    S_end = exp(G_L) S0 + sum_s exp(G_L - G_s) k_s (outer) u_s

Every exponent is <= 0: nothing overflows, whatever the chunk length.

Kimi delta attention (KimiLinear's KDA) is the same rule with a decay per key feature:
a is [T, Hv, Dk] and dt_bias [Hv, Dk], so g_t is a vector and S_t = diag(exp(g_t)) S_{t-1}
before the write. The algebra above holds feature by feature: k_t . k_s and q_t . k_s
become sums over the features c of k_t[c] k_s[c] exp(G_t[c] - G_s[c]) (an [L, L, Dk]
product per chunk and head, as transformers' chunked form computes it), and exp(G_t) S0
becomes diag(exp(G_t)) S0. The code carries g as [..., 1] for a decay per head and
[..., Dk] per feature, and takes the cheaper matrix products for the former.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.ops import _check_rows, _requests, _slots, _write_rows

L2_EPS = 1e-6
# The batched prefill with a decay per key feature builds its [chunks, H, L, L, Dk]
# decays this many float32 elements (256 MiB) at a time, a slice of the chunks each.
PER_FEATURE_SLICE_ELEMENTS = 1 << 26


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                        state: torch.Tensor | None, md: MambaMetadata,
                        chunk_size: int = 64, batched: bool | None = None,
                        beta_scale: float = 1.0) -> torch.Tensor:
    """Each request's tokens: q/k [T, Hk, Dk], v [T, Hv, Dv], a/b [T, Hv] (raw, before
    the decay and beta), A_log/dt_bias [Hv] -> o [T, Hv, Dv]; for a decay per key feature
    (KDA), a [T, Hv, Dk] and dt_bias [Hv, Dk]. The initial state is
    state[slot] ([Hv, Dk, Dv]) when has_initial_state[i], else zeros; the final state
    is written back to the slot (state None: zeros, nothing stored). Rows past the last
    request are 0. beta_scale: a factor on beta (OLMo's 2, which lets a step reverse
    what the state holds).

    Two evaluations of the same chunks (batched: default on CUDA):
    - by request (the CPU's): request after request, chunk after chunk, the state
      entering each chunk known, so each chunk solves for its writes directly. Its
      state stays in cache; measured on the 2-core CPU machine it is 1.5-5x faster
      than the batched form (which solves for twice the columns and streams every
      request's state several times).
    - batched: every chunk of every request is one batch entry (padded to the longest
      chunk with tokens that neither decay nor write: g = 0, beta = 0, k = 0). The
      systems are solved before any state is known, for the writes as values minus
      keys times the entering state; only the state's passage from one chunk to the
      next loops, once per chunk position, over all requests at once: a few dozen
      launches a layer instead of a few dozen per chunk. A decay per key feature
      multiplies the pairwise decays by Dk ([chunks, H, L, L, Dk]): they are built a
      slice of the chunks at a time (PER_FEATURE_SLICE_ELEMENTS)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_shapes(q, k, v, a, b, A_log, dt_bias)
    if batched is None:
        batched = v.is_cuda
    run = _prefill_batched if batched else _prefill_by_request
    return run(q, k, v, a, b, A_log, dt_bias, state, md, chunk_size, beta_scale)


def _prefill_by_request(q, k, v, a, b, A_log, dt_bias, state, md, chunk_size, beta_scale
                        ) -> torch.Tensor:
    qf, kf = _expanded_unit_qk(q, k, v.shape[1])
    g, beta = _decay_and_beta(a, b, A_log, dt_bias, beta_scale)
    num_heads, key_dim, value_dim = v.shape[1], q.shape[2], v.shape[2]
    out = torch.zeros_like(v)
    for _, start, end, slot, has_history in _requests(md):
        if end == start:
            continue
        if has_history and state is not None and slot >= 0:
            s = state[slot].float()
        else:
            s = v.new_zeros(num_heads, key_dim, value_dim, dtype=torch.float32)
        vf = v[start:end].float()
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            out[c0:c1], s = _chunk(qf[c0:c1], kf[c0:c1], vf[c0 - start:c1 - start],
                                   g[c0:c1], beta[c0:c1], s)
        if state is not None and slot >= 0:
            state[slot] = s.to(state.dtype)
    return out


def _prefill_batched(q, k, v, a, b, A_log, dt_bias, state, md, chunk_size, beta_scale
                     ) -> torch.Tensor:
    out = torch.zeros_like(v)
    plan = _chunk_plan(md, chunk_size, v.device)
    if plan.num_chunks == 0:
        return out
    qf, kf = _expanded_unit_qk(q, k, v.shape[1])
    g, beta = _decay_and_beta(a, b, A_log, dt_bias, beta_scale)
    # [chunks, H, L, ...]: the chunks' tokens, head-major.
    qc, kc, vc = (plan.gather(x).permute(0, 2, 1, 3) for x in (qf, kf, v.float()))
    gc, bc = (plan.gather(x).transpose(1, 2) for x in (g, beta))  # g: [chunks, H, L, 1|Dk]
    G = torch.cumsum(gc, dim=-2)
    rows = torch.arange(plan.length, device=v.device)
    key_products, scores = _key_and_query_products(kc, qc, G, rows[:, None] >= rows[None, :])
    system = (bc[..., None] * key_products).tril(-1) \
        + torch.eye(plan.length, device=v.device)  # (s < t: the strictly lower triangle)
    # A chunk's writes are u = values - keys @ S0 for the state S0 entering it.
    solved = torch.linalg.solve_triangular(
        system, torch.cat([bc[..., None] * vc, (bc[..., None] * torch.exp(G)) * kc], dim=-1),
        upper=False, unitriangular=True)
    values, keys = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)
    q_decayed = torch.exp(G) * qc
    k_to_end = (torch.exp(G[..., -1:, :] - G) * kc).transpose(-1, -2)
    s = plan.initial_states(state, qf.shape[1], kf.shape[2], vc.shape[-1])
    outputs = torch.empty_like(vc)
    for chunks, reqs in plan.by_position():
        s_in = s[reqs]
        u = values[chunks] - keys[chunks] @ s_in
        outputs[chunks] = q_decayed[chunks] @ s_in + scores[chunks] @ u
        s[reqs] = torch.exp(G[chunks, :, -1]).unsqueeze(-1) * s_in + k_to_end[chunks] @ u
    plan.scatter(outputs.permute(0, 2, 1, 3), out)
    plan.store_states(s, state)
    return out


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                       state: torch.Tensor, state_indices: torch.Tensor,
                       beta_scale: float = 1.0) -> torch.Tensor:
    """One step per request: q/k [B, Hk, Dk], v [B, Hv, Dv], a/b [B, Hv] (a [B, Hv, Dk]
    for a decay per key feature, as gated_delta_prefill's) -> o [B, Hv, Dv];
    state [S, Hv, Dk, Dv] updated in place at state_indices [B] (a negative index:
    padding, zero state, no write). beta_scale: as gated_delta_prefill's."""
    _check_shapes(q, k, v, a, b, A_log, dt_bias)
    _check_rows(v, state_indices)
    qf, kf = _expanded_unit_qk(q, k, v.shape[1])
    g, beta = _decay_and_beta(a, b, A_log, dt_bias, beta_scale)
    valid, slots = _slots(state_indices)
    s = state.index_select(0, slots).float()
    s = torch.where(valid[:, None, None, None], s, 0.0)  # [B, Hv, Dk, Dv]
    s = s * torch.exp(g).unsqueeze(-1)  # ([B, Hv, 1|Dk, 1])
    error = v.float() - torch.einsum("bhkv,bhk->bhv", s, kf)
    s = s + kf.unsqueeze(-1) * (beta.unsqueeze(-1) * error).unsqueeze(-2)
    _write_rows(state, slots, valid, s)
    return torch.einsum("bhkv,bhk->bhv", s, qf).to(v.dtype)


# ---------------------------------------------------------------------- helpers
def _chunk_plan(md: MambaMetadata, chunk_size: int, device: torch.device) -> "_ChunkPlan":
    """The step's _ChunkPlan, made once per step (kept in md.derived for the step's other
    gated delta layers)."""
    key = f"gated_delta_plan/{chunk_size}/{device}"
    if key not in md.derived:
        md.derived[key] = _ChunkPlan(md, chunk_size, device)
    return md.derived[key]


class _ChunkPlan:
    """Where each request's chunks sit in the step: chunk c holds the tokens
    index[c, 0:length] (the step's token count where it runs past its request's end:
    padding); chunks are listed request by request, in order, and by_position() groups
    them by their place in their request (first chunks, second chunks, ...), which is
    the order the state passes through them.

    Planned on the host from the metadata's host copies; every index reaches the device
    in one non-blocking copy from pinned memory (a pageable copy, or a boolean mask on
    the device, would make the host wait for the device to drain)."""

    def __init__(self, md: MambaMetadata, chunk_size: int, device: torch.device) -> None:
        starts, ends, chunk_req, position = [], [], [], []
        reads, writes = [], []  # (request, slot) pairs
        for req, start, end, slot, has_history in _requests(md):
            if slot >= 0 and end > start:
                writes.append((req, slot))
                if has_history:
                    reads.append((req, slot))
            for j, c0 in enumerate(range(start, end, chunk_size)):
                starts.append(c0)
                ends.append(min(c0 + chunk_size, end))
                chunk_req.append(req)
                position.append(j)
        self.num_tokens, self.num_chunks = md.num_tokens, len(starts)
        self.num_reqs = md.num_reqs
        # (Chunks as long as the longest one: a step of short prefills pads less.)
        self.length = max((e - s for s, e in zip(starts, ends)), default=0)
        index = torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(self.length)
        index = torch.where(index < torch.tensor(ends, dtype=torch.int64)[:, None], index,
                            md.num_tokens)
        flat = index.flatten()
        kept = (flat < md.num_tokens).nonzero().squeeze(1)
        chunk_req_t = torch.tensor(chunk_req, dtype=torch.int64)
        position_t = torch.tensor(position, dtype=torch.int64)
        by_position = []
        for j in range(int(position_t.max()) + 1 if position else 0):
            at = position_t == j
            by_position += [at.nonzero().squeeze(1), chunk_req_t[at]]
        pairs = [torch.tensor(p, dtype=torch.int64).reshape(-1, 2).t().reshape(-1)
                 for p in (reads, writes)]
        pieces = [*pairs, flat, kept, flat[kept], *by_position]
        host = torch.cat(pieces)
        if device.type == "cuda":
            host = host.pin_memory()
        parts = host.to(device, non_blocking=True).split([len(p) for p in pieces])
        self._reads, self._writes = (part.reshape(2, -1) for part in parts[:2])
        self.index = parts[2].reshape(index.shape)
        self._scatter_from, self._scatter_to = parts[3], parts[4]
        self._positions = list(zip(parts[5::2], parts[6::2]))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> [chunks, L, ...], zeros at padding."""
        padded = torch.cat([x[:self.num_tokens], x.new_zeros((1, *x.shape[1:]))])
        return padded[self.index]

    def scatter(self, chunks: torch.Tensor, out: torch.Tensor) -> None:
        """chunks [chunks, L, ...] back to their tokens' rows of out [T, ...]."""
        out[self._scatter_to] = chunks.flatten(0, 1)[self._scatter_from].to(out.dtype)

    def by_position(self):
        """(chunk ids, their requests) of each requests' j-th chunk, j = 0, 1, ..."""
        return self._positions

    def initial_states(self, state: torch.Tensor | None, heads: int, key_dim: int,
                       value_dim: int) -> torch.Tensor:
        """[requests, H, Dk, Dv] float32: the stored state of each request that has one,
        else zeros."""
        s = torch.zeros(self.num_reqs, heads, key_dim, value_dim, device=self.index.device)
        if state is not None:
            reqs, slots = self._reads
            s[reqs] = state[slots].float()
        return s

    def store_states(self, s: torch.Tensor, state: torch.Tensor | None) -> None:
        """Each request's final state into its slot (those with tokens and a slot)."""
        if state is not None:
            reqs, slots = self._writes
            state[slots] = s[reqs].to(state.dtype)


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one request, float32: q/k [L, H, Dk] (per value head, normalised,
    q scaled), v [L, H, Dv], g [L, H, 1|Dk], beta [L, H], s0 [H, Dk, Dv] -> (o [L, H, Dv],
    the state leaving the chunk). See the module docstring for the algebra."""
    length = q.shape[0]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, L, D]
    G = torch.cumsum(g.transpose(0, 1), dim=1)  # [H, L, 1|Dk]
    rows = torch.arange(length, device=q.device)
    key_products, scores = _key_and_query_products(k, q, G, rows[:, None] >= rows[None, :])
    b = beta.t().unsqueeze(-1)  # [H, L, 1]
    # (s < t only: the strictly lower triangle)
    system = (b * key_products).tril(-1) + torch.eye(length, device=q.device)
    rhs = b * (v - _decayed_rows(k, G, s0))
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = _decayed_rows(q, G, s0) + scores @ u
    to_end = torch.exp(G[:, -1:] - G)  # [H, L, 1|Dk]
    s = torch.exp(G[:, -1]).unsqueeze(-1) * s0 + (k * to_end).transpose(1, 2) @ u
    return o.transpose(0, 1), s


def _pairwise_decay(G: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """exp(G_t - G_s) where causal[t, s], else 0, from the cumulative decay G [..., L, 1|D]
    since the chunk's start: [..., L, L] for a decay per head, [..., L, L, D] per
    feature."""
    if G.shape[-1] == 1:
        return torch.exp((G - G.transpose(-1, -2)).masked_fill(~causal, float("-inf")))
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)
    return torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))


def _key_and_query_products(k: torch.Tensor, q: torch.Tensor, G: torch.Tensor,
                            causal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decayed k_t . k_s and q_t . k_s ([N, ..., L, L] each, the diagonal included) of
    k, q [N, ..., L, Dk] and G [N, ..., L, 1|Dk] (the batched prefill's N chunks, or one
    chunk's N heads); with a decay per feature, the decays built a slice of the first
    dimension at a time (PER_FEATURE_SLICE_ELEMENTS)."""
    if G.shape[-1] == 1:
        decay = _pairwise_decay(G, causal)
        return _decayed_products(k, k, decay), _decayed_products(q, k, decay)
    per_chunk = G[0].numel() * G.shape[-2]
    step = max(1, PER_FEATURE_SLICE_ELEMENTS // per_chunk)
    pieces = []
    for first in range(0, G.shape[0], step):
        part = slice(first, first + step)
        decay = _pairwise_decay(G[part], causal)
        pieces.append((_decayed_products(k[part], k[part], decay),
                       _decayed_products(q[part], k[part], decay)))
    keys, queries = zip(*pieces)
    return torch.cat(keys), torch.cat(queries)


def _decayed_products(x: torch.Tensor, y: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """[..., t, s] = sum_c x_t[c] y_s[c] decay[..., t, s(, c)]: x, y [..., L, D], decay
    _pairwise_decay's."""
    if decay.dim() == x.dim():
        return (x @ y.transpose(-1, -2)) * decay
    return torch.einsum("...tc,...sc,...tsc->...ts", x, y, decay)


def _decayed_rows(x: torch.Tensor, G: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Row t of x [..., L, D] decayed by exp(G_t) (G [..., L, 1|D]), times s [..., D, E]."""
    if G.shape[-1] == 1:
        return torch.exp(G) * (x @ s)
    return (torch.exp(G) * x) @ s


def _expanded_unit_qk(q: torch.Tensor, k: torch.Tensor, value_heads: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in float32, L2-normalised, q scaled by Dk ** -0.5, each key head repeated
    for the value heads it serves: [T, Hv, Dk]."""
    repeat = value_heads // q.shape[1]
    qf, kf = (_l2_normalised(x.float()).repeat_interleave(repeat, dim=1) for x in (q, k))
    return qf * q.shape[2] ** -0.5, kf


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _decay_and_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                    dt_bias: torch.Tensor, beta_scale: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [T, H, 1|Dk], beta [T, H]) in float32: a decay per head, or per key feature
    where a is [T, H, Dk]. beta is the sigmoid in b's own dtype, as transformers computes
    it, before the rest goes to float32 (the scale is exact either way)."""
    per_feature = a.dim() == 3
    rate = torch.exp(A_log.float())
    g = -(rate[:, None] if per_feature else rate) * F.softplus(a.float() + dt_bias.float())
    return (g if per_feature else g.unsqueeze(-1)), torch.sigmoid(b).float() * beta_scale


def _check_shapes(q, k, v, a, b, A_log, dt_bias) -> None:
    tokens, value_heads = v.shape[0], v.shape[1]
    if q.shape != k.shape or q.shape[0] != tokens or value_heads % q.shape[1] != 0:
        raise ValueError(f"gated delta: q and k must be [T, Hk, Dk] with Hk dividing v's "
                         f"{value_heads} heads; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    per_head = (tokens, value_heads)
    per_feature = (tokens, value_heads, q.shape[2])
    if tuple(a.shape) not in (per_head, per_feature) or b.shape != per_head \
            or A_log.shape != (value_heads,) or dt_bias.shape != a.shape[1:]:
        raise ValueError(f"gated delta: v {tuple(v.shape)} needs a/b [T, Hv] and A_log, "
                         f"dt_bias [Hv] (or, for a decay per key feature, a [T, Hv, Dk] and "
                         f"dt_bias [Hv, Dk]); got a {tuple(a.shape)}, b {tuple(b.shape)}, "
                         f"A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)}")
