"""Plain-torch attention over the paged KV cache (the default backend, and the CPU one).

Storing: this step's k/v rows are written into their slots of the flattened cache view
([num_blocks * block_size, num_kv_heads, head_dim]) with index_copy_.

Attending, for the requests of one step:

* decode requests (one new token each) are batched: their contexts are gathered through
  the block tables into [B, max_seq_len, ...] and one masked SDPA call attends them all.
  Requests are grouped by context length so padding stays small and the gathered
  tensors stay within a token budget.
* prefill requests (several new tokens, possibly after a cached prefix or an earlier
  chunk) run one SDPA call each, causal with the offset context_len - query_len.

Padding positions of the batched gather read the first slot of the request's own
context (a slot that holds real data) instead of uninitialised cache memory, because
masked-out scores still multiply their values: NaN garbage there would leak into the
output.

Sliding window W (transformers' semantics, checked against transformers 5.17's
masking_utils: ``sliding_window_causal_mask_function(W)`` is ``causal_mask_function``
(kv_idx <= q_idx) and ``sliding_window_overlay(W)`` (kv_idx > q_idx - W), on absolute
positions, the cache's included; its flash-attention path agrees, window_size=(W - 1,
W - 1), and so does DynamicSlidingWindowLayer, which keeps the last W - 1 tokens): a
query at context position p sees the W keys at positions p - W < k <= p, itself
included. Only keys inside some query's window are ever gathered: a request's range
starts at max(0, first_query_position - W + 1). The blocks wholly before it may already
be freed and their block-table entries stale (another request's data, or NaN), and
masking alone would not keep their values out. Windowed prefill attends in chunks of
queries, each over its own key range, so the explicit mask stays chunk x (chunk + W)
however long the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spindle.attention.heads import set_head_geometry, set_score_options
from spindle.attention.metadata import AttentionMetadata
from spindle.layers import cpu_kernels
from spindle.layers.rotary import QKNormRope

# Most context tokens gathered at once by the batched decode path (per K and per V).
DECODE_GATHER_TOKEN_BUDGET = 1 << 15
# Queries per SDPA call of windowed prefill (each call gathers chunk + W - 1 keys).
WINDOW_QUERY_CHUNK = 512


class TorchSDPABackend:
    # forward() takes the q/k norm + rotary (a rotary.QKNormRope) and applies it together
    # with the KV store: one C++ call for bf16 on the CPU (layers/cpu_kernels.py).
    fuses_qk_transform = True

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None,
                 alibi_slopes: torch.Tensor | None = None,
                 attention_chunk_size: int | None = None) -> None:
        set_head_geometry(self, num_heads, head_dim, scale, num_kv_heads)
        # Gemma 2's soft cap, gpt-oss's sinks and ALiBi have no SDPA step: layers with
        # any of them attend with explicit torch ops (_attention), as transformers' eager
        # attention does.
        set_score_options(self, num_heads, sliding_window, logits_soft_cap, sinks,
                          alibi_slopes, attention_chunk_size)
        self.gqa = num_heads != num_kv_heads

    # ---------------------------------------------------------------- entry point
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None,
                attn_metadata: AttentionMetadata | None,
                qk_transform: QKNormRope | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, H_kv, D] -> [T, H, D]; qk_transform: the q/k norm and
        rotary still to apply to q and k (in place)."""
        if kv_cache is None:
            if qk_transform is not None:
                qk_transform.apply_(q, k)
            return self._forward_without_cache(q, k, v, attn_metadata)
        if attn_metadata is None:
            raise ValueError("attention with a KV cache needs attention metadata")
        key_cache, value_cache = self._flat_caches(kv_cache)
        plan = self.step_plan(attn_metadata, kv_cache.shape[2])
        if qk_transform is not None and kv_cache.dtype == k.dtype:
            qk_transform.apply_(q, k, v, kv_cache, plan.store_slots)  # rotates and stores
        else:
            if qk_transform is not None:
                qk_transform.apply_(q, k)
            self.store_kv(k, v, key_cache, value_cache, plan.store_slots)
        if plan.decode_only:  # every token is one decode query, in request order
            if self._fused_decode(q, key_cache):
                return cpu_kernels.decode_attention(
                    q, key_cache, value_cache, attn_metadata.block_tables,
                    attn_metadata.seq_lens, kv_cache.shape[2], self.scale,
                    self.sliding_window, self.logits_soft_cap)
            (group,) = plan.decode_groups
            return self._decode_group(q, key_cache, value_cache, group)
        out = torch.zeros_like(q)  # rows of padding tokens (if any) stay finite
        for group in plan.decode_groups:
            out[group.token_index] = self._decode_group(q[group.token_index], key_cache,
                                                        value_cache, group)
        for i in plan.prefill_reqs:
            self._prefill(q, key_cache, value_cache, kv_cache.shape[2], attn_metadata, i,
                          plan.query_start, plan.seq_lens, out)
        return out

    def _fused_decode(self, q: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """bf16 decode on the CPU attends in one C++ call (cpu_kernels.decode_attention;
        float32 keeps SDPA, whose sums match transformers'), without sinks or ALiBi."""
        return (self.sinks is None and self.alibi_slopes is None and self.chunk is None
                and key_cache.dtype == q.dtype and cpu_kernels.applies(q))

    def step_plan(self, md: AttentionMetadata, block_size: int) -> _StepPlan:
        """The step's split into decode groups and prefill requests, with each decode
        group's gather slots and padding mask: the same for every layer of a window,
        so built once per step (md.derived) and reused by the others."""
        key = ("torch_sdpa", self.sliding_window, self.chunk, block_size)
        plan = md.derived.get(key)
        if plan is None:
            plan = md.derived[key] = _plan_step(md, block_size, self.sliding_window, self.chunk)
        return plan

    # ---------------------------------------------------------------- KV storage
    def _flat_caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [num_blocks * block_size, H_kv, D] of the key and value caches.

        view() (never reshape) so that writes land in the real cache; a non-contiguous
        cache raises here instead of silently storing into a copy.
        """
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, "
                             f"head_dim], got {tuple(kv_cache.shape)}")
        flat_shape = (-1, self.num_kv_heads, self.head_dim)
        return kv_cache[0].view(flat_shape), kv_cache[1].view(flat_shape)

    @staticmethod
    def store_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        slots = slot_mapping.to(torch.int64)  # (no copy when it is int64 already)
        key_cache.index_copy_(0, slots, k.to(key_cache.dtype))
        value_cache.index_copy_(0, slots, v.to(value_cache.dtype))

    # ---------------------------------------------------------------- paths
    def _forward_without_cache(self, q, k, v, md: AttentionMetadata | None) -> torch.Tensor:
        """Attention among the step's new tokens only (memory profiling, no cache yet)."""
        if md is None:
            bounds, causal = [0, q.shape[0]], True
        else:
            bounds, _ = _host_lists(md)
            causal = md.causal
        self._check_window_is_causal(causal)
        out = torch.zeros_like(q)  # rows of padding tokens (if any) stay finite
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end <= start:
                continue
            if self.sliding_window is not None and end - start > self.sliding_window:
                out[start:end] = self._attend_window(q[start:end], k[start:end], v[start:end],
                                                     first_query_pos=0, first_key_pos=0)
            else:
                out[start:end] = self._sdpa(q[start:end], k[start:end], v[start:end],
                                            is_causal=causal, first_query_pos=0)
        return out

    def _prefill(self, q, key_cache, value_cache, block_size, md, i, query_start, seq_lens, out):
        start, end = query_start[i], query_start[i + 1]
        seq_len = seq_lens[i]
        first_query_pos = seq_len - (end - start)  # context position of the first new token
        table = md.block_tables[i].to(torch.int64)
        self._check_window_is_causal(md.causal)
        if self.sliding_window is not None and seq_len > self.sliding_window:
            first_key_pos = self._first_key(first_query_pos)
            keys, values = _gather(key_cache, value_cache, table, block_size, first_key_pos,
                                   seq_len, q.dtype)
            out[start:end] = self._attend_window(q[start:end], keys, values, first_query_pos,
                                                 first_key_pos)
            return
        keys, values = _gather(key_cache, value_cache, table, block_size, 0, seq_len, q.dtype)
        mask = None
        causal = md.causal
        if causal and first_query_pos > 0:
            mask = _visibility_mask(first_query_pos, seq_len, 0, None, q.device)
            causal = False
        out[start:end] = self._sdpa(q[start:end], keys, values, is_causal=causal, mask=mask,
                                    first_query_pos=first_query_pos)

    def _attend_window(self, q, keys, values, first_query_pos: int, first_key_pos: int
                       ) -> torch.Tensor:
        """Sliding-window causal attention of q [L, H, D] (context positions
        first_query_pos...) over keys/values [S, H_kv, D] (positions first_key_pos... up
        to the last query's), in chunks of WINDOW_QUERY_CHUNK queries, each over the keys
        its window can reach."""
        window = self.sliding_window
        out = torch.empty_like(q)
        for a in range(0, q.shape[0], WINDOW_QUERY_CHUNK):
            b = min(q.shape[0], a + WINDOW_QUERY_CHUNK)
            lo, hi = first_query_pos + a, first_query_pos + b  # query positions [lo, hi)
            key_lo = max(first_key_pos, self._first_key(lo))
            rows = slice(key_lo - first_key_pos, hi - first_key_pos)
            mask = _visibility_mask(lo, hi, key_lo, window, q.device, self.chunk)
            out[a:b] = self._sdpa(q[a:b], keys[rows], values[rows], is_causal=False, mask=mask,
                                  first_query_pos=lo, first_key_pos=key_lo)
        return out

    def _first_key(self, query_pos: int) -> int:
        """The first key position a windowed query at query_pos sees (with chunks, its
        chunk's start)."""
        if self.chunk is not None:
            return query_pos // self.chunk * self.chunk
        return max(0, query_pos - self.sliding_window + 1)

    def _decode_group(self, q: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, group: _DecodeGroup) -> torch.Tensor:
        """One query per request, q [B, H, D], over its gathered keys -> [B, H, D].
        Half precision attends in explicit float32 steps (_decode_attention); float32
        through SDPA, whose sums match transformers' own SDPA bit for bit, which the
        float32 comparisons with it rely on (fp8's rounding turns an ulp into 1/16)."""
        batch, span = group.slots.shape
        flat = group.slots.view(-1)  # (index_select on one dim: a fraction of [] indexing)
        keys = key_cache.index_select(0, flat).view(batch, span, *key_cache.shape[1:])
        values = value_cache.index_select(0, flat).view(batch, span, *value_cache.shape[1:])
        alibi = None
        if self.alibi_slopes is not None:  # [B, H, 1, S]
            distances = group.key_positions - (group.seq_lens[:, None] - 1)
            alibi = self._alibi(distances[:, None, None, :])
        if q.dtype != torch.float32:
            return self._decode_attention(q, keys, values, group.key_bias, alibi)
        mask = None if group.key_bias is None else group.key_bias == 0
        out = self._attention(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                              mask=mask, bias=alibi)
        return out.squeeze(2)

    def _decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          key_bias: torch.Tensor | None, alibi: torch.Tensor | None = None
                          ) -> torch.Tensor:
        """Single-query attention in explicit float32 steps: q [B, H, D], keys/values
        [B, S, H_kv, D], key_bias [B, 1, 1, S] (0 or -inf) or None, alibi [B, H, 1, S]
        or None -> [B, H, D] in q's dtype. CPU SDPA runs one query per sequence 5-13x
        slower than these matmuls (two of them per KV head group, the query heads of a
        group as the rows)."""
        batch, group = q.shape[0], self.num_heads // self.num_kv_heads
        queries = q.reshape(batch, self.num_kv_heads, group, self.head_dim).float()
        # Keys and values as contiguous float32 [B, H_kv, S, D], one copy each.
        keys = keys.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format)
        values = values.permute(0, 2, 1, 3).to(torch.float32,
                                               memory_format=torch.contiguous_format)
        scores = torch.matmul(queries, keys.transpose(-1, -2))  # [B, H_kv, G, S]
        scores.mul_(self.scale)
        if self.logits_soft_cap is not None:
            cap = self.logits_soft_cap
            scores = torch.tanh(scores.div_(cap)).mul_(cap)
        if alibi is not None:
            scores.add_(alibi.view(batch, self.num_kv_heads, group, -1))
        if key_bias is not None:
            scores.add_(key_bias)
        weights = _softmax_with_sinks(scores, self._sink_logits(scores, group))
        out = torch.matmul(weights, values)  # [B, H_kv, G, D]
        return out.reshape(batch, self.num_heads, self.head_dim).to(q.dtype)

    def _check_window_is_causal(self, causal: bool) -> None:
        if self.sliding_window is not None and not causal:
            raise ValueError("sliding-window attention is causal; got non-causal metadata")

    def _sdpa(self, q, k, v, is_causal: bool, mask: torch.Tensor | None = None,
              first_query_pos: int = 0, first_key_pos: int = 0) -> torch.Tensor:
        """One sequence: q [L, H, D], k/v [S, H_kv, D], mask [L, S] bool or None -> [L, H, D].
        The queries' context positions start at first_query_pos, the keys' at
        first_key_pos (what ALiBi's distances are made of)."""
        alibi = None
        if self.alibi_slopes is not None:
            query_pos = torch.arange(q.shape[0], device=q.device) + first_query_pos
            key_pos = torch.arange(k.shape[0], device=q.device) + first_key_pos
            alibi = self._alibi((key_pos[None, :] - query_pos[:, None])[None, None])
        attn = self._attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                               v.transpose(0, 1).unsqueeze(0), mask=mask, is_causal=is_causal,
                               bias=alibi)
        return attn.squeeze(0).transpose(0, 1)

    def _alibi(self, distances: torch.Tensor) -> torch.Tensor:
        """ALiBi's bias of key - query distances [B, 1, L, S] (integers): [B, H, L, S]
        float32."""
        slopes = self.alibi_slopes.to(device=distances.device, dtype=torch.float32)
        return slopes.view(1, -1, 1, 1) * distances.to(torch.float32)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None = None, is_causal: bool = False,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, L, D], k/v [B, H_kv, S, D], mask (bool, broadcast to [B, H, L, S]),
        bias (float32, added to the scores, broadcast likewise: ALiBi's) -> [B, H, L, D]:
        SDPA, or with a soft cap, sinks or a bias the same in explicit steps (as
        transformers' eager attention: scores, cap, bias, mask, float32 softmax)."""
        if self.logits_soft_cap is None and self.sinks is None and bias is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                  scale=self.scale, enable_gqa=self.gqa)
        repeat = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if self.logits_soft_cap is not None:
            cap = self.logits_soft_cap
            scores = torch.tanh(scores / cap) * cap
        if bias is not None:
            scores = scores + bias
        if is_causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                              device=q.device).tril(k.shape[-2] - q.shape[-2])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            weights = _softmax_with_sinks(scores, self.sinks.view(1, -1, 1, 1)).to(q.dtype)
        return torch.matmul(weights, v)

    def _sink_logits(self, scores: torch.Tensor, group: int) -> torch.Tensor | None:
        """The sinks laid out as _decode_attention's scores [B, H_kv, G, S]: [1, H_kv, G, 1]."""
        if self.sinks is None:
            return None
        return self.sinks.view(1, self.num_kv_heads, group, 1)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension with one more logit per row, sinks (broadcast to
    scores[..., :1]), that takes its share of the denominator and weighs nothing: as
    transformers' gpt-oss takes them (max subtracted over both, then a softmax in the
    scores' float type, the sink's column dropped). None: a plain float32 softmax."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    scores = scores.float()
    combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


@dataclass
class _DecodeGroup:
    """Decode requests attended together: their query rows, the cache slots of the
    keys each reads [B, S] (padding reads a slot of the request's own context), and
    the mask of the padding as a float32 bias [B, 1, 1, S] (None: no padding)."""

    token_index: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B, S] int64
    key_bias: torch.Tensor | None
    key_positions: torch.Tensor  # [B, S] int64: the context position each slot holds
    seq_lens: torch.Tensor  # [B] int64 (the query's position is one less)


@dataclass
class _StepPlan:
    store_slots: torch.Tensor  # slot_mapping as int64 (index_copy_'s index type)
    query_start: list[int]
    seq_lens: list[int]
    decode_groups: list[_DecodeGroup]
    prefill_reqs: list[int]
    decode_only: bool  # one group holding every token of the step, in order


def _plan_step(md: AttentionMetadata, block_size: int, window: int | None,
               chunk: int | None = None) -> _StepPlan:
    query_start, seq_lens = _host_lists(md)
    decode_reqs, prefill_reqs = [], []
    for i in range(md.num_reqs):
        query_len = query_start[i + 1] - query_start[i]
        if query_len == 1:
            decode_reqs.append(i)
        elif query_len > 1:
            prefill_reqs.append(i)
    # Keys each decode query reads: its whole context, the last W positions of it, or
    # its own chunk up to the query.
    if chunk is not None:
        spans = [(n - 1) % chunk + 1 if n else 0 for n in seq_lens]
    else:
        spans = seq_lens if window is None else [min(n, window) for n in seq_lens]
    by_length = _group_by_length(decode_reqs, spans, DECODE_GATHER_TOKEN_BUDGET)
    # (A group's order is free: its rows are attended independently.)
    by_length = [sorted(group) for group in by_length]
    groups = [_decode_group(md, group, query_start, spans, block_size, window, chunk)
              for group in by_length]
    decode_only = (by_length == [list(range(md.num_reqs))] and md.num_tokens == md.num_reqs
                   and query_start[-1] == md.num_tokens)
    return _StepPlan(md.slot_mapping.to(torch.int64), query_start, seq_lens, groups,
                     prefill_reqs, decode_only)


def _decode_group(md: AttentionMetadata, group: list[int], query_start: list[int],
                  spans: list[int], block_size: int, window: int | None,
                  chunk: int | None = None) -> _DecodeGroup:
    device = md.block_tables.device
    max_span = max(spans[i] for i in group)
    req_idx = torch.tensor(group, dtype=torch.int64, device=device)
    token_index = torch.tensor([query_start[i] for i in group], dtype=torch.int64,
                               device=device)
    lens = md.seq_lens[req_idx].to(torch.int64)
    positions = torch.arange(max_span, device=device)[None, :]
    if window is None:
        valid = positions < lens[:, None]  # [B, S]
        positions = torch.where(valid, positions, 0)  # padding reads position 0
    else:
        if chunk is not None:  # the query's chunk's first position
            first = ((lens - 1).clamp_(min=0) // chunk * chunk)[:, None]
        else:  # the window's first position
            first = (lens - window).clamp_(min=0)[:, None]
        valid = positions < (lens[:, None] - first)
        positions = first + torch.where(valid, positions, 0)  # padding reads `first`
    blocks = md.block_tables[req_idx].to(torch.int64).gather(1, positions // block_size)
    slots = blocks * block_size + positions % block_size
    key_bias = None
    if any(spans[i] != max_span for i in group):
        key_bias = torch.zeros(valid.shape, dtype=torch.float32, device=device)
        key_bias.masked_fill_(~valid, float("-inf"))
        key_bias = key_bias[:, None, None, :]
    return _DecodeGroup(token_index, slots, key_bias, positions, lens)


def _host_lists(md: AttentionMetadata) -> tuple[list[int], list[int]]:
    """query_start_loc and seq_lens as Python lists (from the host copies when present)."""
    query_start = md.query_start_loc_cpu if md.query_start_loc_cpu is not None else md.query_start_loc
    seq_lens = md.seq_lens_cpu if md.seq_lens_cpu is not None else md.seq_lens
    return query_start.tolist(), seq_lens.tolist()


def _gather(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
            block_size: int, first: int, end: int, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [end - first, H_kv, D] of one request's context positions
    [first, end), through its block table (no other position is read)."""
    positions = torch.arange(first, end, device=key_cache.device)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    return key_cache[slots].to(dtype), value_cache[slots].to(dtype)


def _visibility_mask(first_query_pos: int, end: int, first_key_pos: int, window: int | None,
                     device: torch.device, chunk: int | None = None) -> torch.Tensor:
    """[L, S] bool: query at position p (first_query_pos <= p < end) sees key k
    (first_key_pos <= k < end) iff k <= p, and p - window < k when window is given,
    and k is in p's chunk when chunk is given (attention/chunked.py)."""
    query_pos = torch.arange(first_query_pos, end, device=device)[:, None]
    key_pos = torch.arange(first_key_pos, end, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    if chunk is not None:  # (and k in p's chunk)
        mask &= key_pos >= query_pos // chunk * chunk
    return mask


def _group_by_length(reqs: list[int], spans: list[int], token_budget: int) -> list[list[int]]:
    """Split reqs into groups, sorted by span (keys read per request), whose padded size
    (len(group) * longest span) stays within token_budget (a group holds at least one)."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(reqs, key=lambda r: spans[r]):
        # Sorted ascending, so spans[i] is the group's longest span if i joins.
        if current and (len(current) + 1) * spans[i] > token_budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups
