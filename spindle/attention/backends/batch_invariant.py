"""Batch-invariant attention (batch_invariant=True; see layers/batch_invariant.py).

A query's output must be the same bits whether it is computed in a prefill (whole or
in chunks, after a cached prefix or not) or in a decode step, alone or among others.
Both implementations get there the same way: one code path for every step, an online
softmax over keys in blocks at fixed absolute positions (0..B-1, B..2B-1, ...), and
queries computed in tiles whose rows do not interact.

* CUDA: the Triton prefill kernel (triton_attn.py) for every step, decode included,
  with one tile shape (CUDA_QUERY_TILE rows of (token, query head) pairs of a KV
  head, so a decode step reads each KV head once): each row's dot products and row
  reductions are the same instruction sequence whatever the other rows hold, its
  key blocks start at position 0, and the blocks past a row's own position are fully
  masked, which leaves its softmax state exactly as it was (scale 1, sum + 0). No
  split-KV (the decode kernel splits by batch size).
* CPU: torch ops of fixed shapes. Queries go in tiles of QUERY_TILE positions aligned
  to absolute positions, so a query at position p is always row p % QUERY_TILE of tile
  p // QUERY_TILE, and that tile reads key blocks 0..p // KEY_BLOCK, whatever the
  step. Every call (bmm, exp, sums) then has one shape and puts the query in one
  place: its bits depend on its own data only. A loop per request, tile and block.

The CUDA and CPU results are each invariant; they are not equal to one another.
"""

from __future__ import annotations

import torch

from spindle.attention.heads import set_head_geometry
from spindle.attention.metadata import AttentionMetadata

# CPU: query positions per tile and key positions per softmax block (equal, so a
# tile's last block is the one holding its last position: no row sees a fully
# masked block).
QUERY_TILE = 16
KEY_BLOCK = QUERY_TILE
# CUDA: rows per tile of the prefill kernel, the same in every step.
CUDA_QUERY_TILE = 16


class BatchInvariantBackend:
    fuses_qk_transform = True  # (CUDA: q/k norm + rotary by the per-token kernel)

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None,
                 alibi_slopes: torch.Tensor | None = None,
                 attention_chunk_size: int | None = None) -> None:
        set_head_geometry(self, num_heads, head_dim, scale, num_kv_heads)
        if alibi_slopes is not None:
            raise ValueError("batch_invariant does not support ALiBi")
        if attention_chunk_size is not None:
            raise ValueError("batch_invariant does not support chunked attention")
        if sinks is not None:
            raise ValueError("batch_invariant does not support attention sinks")
        if sliding_window is not None:
            raise ValueError("batch_invariant does not support sliding-window attention")
        if logits_soft_cap is not None:
            raise ValueError("batch_invariant does not support attention logit soft-capping")
        self.sliding_window = None
        self.gqa = num_heads // num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, attn_metadata: AttentionMetadata | None,
                qk_transform=None) -> torch.Tensor:
        """q [T, H, D], k/v [T, H_kv, D] -> [T, H, D] (q, k may change in place)."""
        from spindle.attention.backends.torch_sdpa import TorchSDPABackend

        if kv_cache is None:  # the profiling forward: its output is never used
            if qk_transform is not None:
                qk_transform.apply_(q, k)
            return TorchSDPABackend(self.num_heads, self.head_dim, self.scale,
                                    self.num_kv_heads).forward(q, k, v, None, attn_metadata)
        if attn_metadata is None:
            raise ValueError("attention with a KV cache needs attention metadata")
        if not attn_metadata.causal:
            raise ValueError("batch-invariant attention is causal; got non-causal metadata")
        if q.is_cuda:
            return self._forward_cuda(q, k, v, kv_cache, attn_metadata, qk_transform)
        if qk_transform is not None:
            qk_transform.apply_(q, k)
        key_cache, value_cache = TorchSDPABackend(
            self.num_heads, self.head_dim, self.scale, self.num_kv_heads)._flat_caches(kv_cache)
        TorchSDPABackend.store_kv(k, v, key_cache, value_cache, attn_metadata.slot_mapping)
        return self._forward_cpu(q, key_cache, value_cache, kv_cache.shape[2], attn_metadata)

    # ---------------------------------------------------------------- CUDA
    def _forward_cuda(self, q, k, v, kv_cache, md: AttentionMetadata, qk_transform):
        from spindle.attention.backends.triton_attn import prefill_attention, store_kv

        if qk_transform is None:
            store_kv(k, v, kv_cache, md.slot_mapping)
        else:
            qk_transform.apply_(q, k, v, kv_cache, md.slot_mapping)
        out = torch.empty_like(q)
        prefill_attention(q, kv_cache, md, self.scale, out, block_m=CUDA_QUERY_TILE,
                          pack_gqa=True)
        return out

    # ---------------------------------------------------------------- CPU
    def _forward_cpu(self, q, key_cache, value_cache, block_size: int,
                     md: AttentionMetadata) -> torch.Tensor:
        query_start = (md.query_start_loc_cpu if md.query_start_loc_cpu is not None
                       else md.query_start_loc).tolist()
        seq_lens = (md.seq_lens_cpu if md.seq_lens_cpu is not None else md.seq_lens).tolist()
        out = torch.zeros_like(q)  # rows of padding tokens (if any) stay finite
        for i in range(md.num_reqs):
            start, end = query_start[i], query_start[i + 1]
            if end > start:
                table = md.block_tables[i].to(torch.int64)
                out[start:end] = self._attend(q[start:end], seq_lens[i], table, key_cache,
                                              value_cache, block_size).to(q.dtype)
        return out

    def _attend(self, q: torch.Tensor, seq_len: int, table: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_size: int) -> torch.Tensor:
        """One request's new queries q [L, H, D] (context positions seq_len - L ...
        seq_len - 1) over its context -> [L, H, D] float32."""
        first = seq_len - q.shape[0]
        out = torch.empty(q.shape, dtype=torch.float32)
        for tile_start in range(first // QUERY_TILE * QUERY_TILE, seq_len, QUERY_TILE):
            lo, hi = max(first, tile_start), min(seq_len, tile_start + QUERY_TILE)
            tile = torch.zeros(self.num_heads, QUERY_TILE, self.head_dim, dtype=torch.float32)
            tile[:, lo - tile_start:hi - tile_start] = q[lo - first:hi - first].transpose(0, 1)
            result = self._attend_tile(tile, tile_start, seq_len, table, key_cache,
                                       value_cache, block_size)
            out[lo - first:hi - first] = result[:, lo - tile_start:hi - tile_start].transpose(0, 1)
        return out

    def _attend_tile(self, tile: torch.Tensor, tile_start: int, seq_len: int,
                     table: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_size: int) -> torch.Tensor:
        """Queries tile [H, QUERY_TILE, D] at positions tile_start... over key blocks
        0 .. the tile's last -> [H, QUERY_TILE, D] (rows without a query: garbage)."""
        row_pos = torch.arange(tile_start, tile_start + QUERY_TILE)[:, None]
        shape = (self.num_heads, QUERY_TILE)
        m = torch.full(shape, float("-inf"))
        total = torch.zeros(shape)
        acc = torch.zeros(*shape, self.head_dim)
        for block_start in range(0, min(seq_len, tile_start + QUERY_TILE), KEY_BLOCK):
            key_pos = torch.arange(block_start, block_start + KEY_BLOCK)
            keys, values = self._key_block(key_pos, seq_len, table, key_cache, value_cache,
                                           block_size)
            scores = torch.bmm(tile, keys.transpose(1, 2)) * self.scale
            visible = (key_pos[None, :] <= row_pos) & (key_pos < seq_len)[None, :]
            scores = scores.masked_fill(~visible, float("-inf"))
            m_new = torch.maximum(m, scores.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            p = torch.exp(scores - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            total = total * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.bmm(p, values)
            m = m_new
        return acc / torch.where(total > 0, total, 1.0)[..., None]

    def _key_block(self, key_pos: torch.Tensor, seq_len: int, table: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, block_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [H, KEY_BLOCK, D] (float32, fresh tensors, each KV head
        repeated for its query heads) at key_pos; positions >= seq_len read as zeros
        (their cache slots may hold anything)."""
        valid = key_pos < seq_len
        pos = torch.where(valid, key_pos, 0)
        slots = table[pos // block_size] * block_size + pos % block_size
        mask = valid[:, None, None]
        keys = torch.where(mask, key_cache[slots].float(), 0.0)
        values = torch.where(mask, value_cache[slots].float(), 0.0)
        return (keys.transpose(0, 1).repeat_interleave(self.gqa, dim=0).contiguous(),
                values.transpose(0, 1).repeat_interleave(self.gqa, dim=0).contiguous())
