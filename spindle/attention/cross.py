"""Cross-attention for encoder-decoder models: decoder queries over the encoder's
keys and values.

A request's encoder runs once, in the step that computes its first decoder token;
each decoder layer then projects the encoder's output to keys and values and keeps
them in the request's state slot of its cross-attention cache ([slots, positions,
kv_heads, head_dim] for keys and for values: a ``CrossAttentionCacheSpec``, one slot
per running request, see spindle/cache/spec.py). Every later step of the request
reads them from there. The step's metadata for this cache group is a
``MambaMetadata`` (the metadata of every state group): request i owns query tokens
query_start_loc[i]:query_start_loc[i+1] and slot state_indices[i]; a negative slot is
a CUDA-graph padding row, whose output nobody reads.

Every query sees every encoder position (no mask). Decode steps (one query per
request) attend in one call over the slots' keys, and run inside CUDA graphs on the GPU:
a Triton kernel there (cross_triton.py; SPINDLE_CROSS_ATTENTION_TRITON=0 turns it
off), SDPA over the gathered slots elsewhere. Steps with prompt chunks attend with
SDPA, one call per request.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from spindle.attention.heads import set_head_geometry
from spindle.cache.spec import CrossAttentionCacheSpec
from spindle.forward_context import get_forward_context
from spindle.switches import on_off

# "0" turns the Triton decode kernel off on CUDA (gather + SDPA instead).
TRITON_SWITCH_ENV = "SPINDLE_CROSS_ATTENTION_TRITON"


class CrossAttention(nn.Module):
    """forward(q [T, H*D], new_kv=None, new_slots=None) -> [T, H*D].

    new_kv: (keys, values), each [n, positions, H_kv, D], the encoder outputs' keys and
    values of the n requests whose encoder ran this step, written into their slots
    new_slots [n] before anything is read. While ``kv_cache`` is None (the profiling
    forward, no cache yet) request i attends to new_kv's row i directly."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 num_positions: int) -> None:
        super().__init__()
        set_head_geometry(self, num_heads, head_dim, scale, num_kv_heads)
        self.num_positions = num_positions
        self.kv_cache: list[torch.Tensor] | None = None  # [keys, values], set by the runner
        self.cache_group = 0
        self.use_triton = on_off(TRITON_SWITCH_ENV, True)

    def cache_spec(self, dtype: torch.dtype) -> CrossAttentionCacheSpec:
        return CrossAttentionCacheSpec.of(self.num_positions, self.num_kv_heads, self.head_dim,
                                          dtype)

    def forward(self, q: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                new_slots: torch.Tensor | None = None) -> torch.Tensor:
        md = get_forward_context().for_group(self.cache_group)
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        if self.kv_cache is None:
            if new_kv is None:
                raise ValueError("cross-attention without a cache needs the encoder's keys "
                                 "and values (new_kv)")
            keys, values = new_kv
            out = self._attend_rows(q, md, keys, values)
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        key_cache, value_cache = self.kv_cache
        if new_kv is not None:
            if new_slots is None or new_slots.shape[0] != new_kv[0].shape[0]:
                raise ValueError("new_kv needs one slot per request (new_slots)")
            key_cache.index_copy_(0, new_slots, new_kv[0].to(key_cache.dtype))
            value_cache.index_copy_(0, new_slots, new_kv[1].to(value_cache.dtype))
        if md.is_pure_decode and num_tokens == md.num_reqs:
            out = self._decode(q, key_cache, value_cache, md.state_indices)
        else:
            out = self._mixed_step(q, md, key_cache, value_cache)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def _mixed_step(self, q: torch.Tensor, md, key_cache: torch.Tensor,
                    value_cache: torch.Tensor) -> torch.Tensor:
        """A step with prompt chunks: its one-token requests attend together as in a
        decode step, the others one SDPA call each (planned once per step, md.derived)."""
        plan = md.derived.get("cross_attention")
        if plan is None:
            bounds = md.query_start_loc_cpu.tolist()
            lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
            single = [i for i, n in enumerate(lengths) if n == 1]
            multi = [i for i, n in enumerate(lengths) if n > 1]
            plan = md.derived["cross_attention"] = (
                torch.tensor([bounds[i] for i in single], dtype=torch.int64).to(q.device),
                md.state_indices[torch.tensor(single, dtype=torch.int64).to(q.device)],
                [(bounds[i], bounds[i + 1], int(md.state_indices_cpu[i])) for i in multi])
        single_rows, single_slots, chunks = plan
        out = torch.zeros_like(q)  # rows of padding tokens (if any) stay finite
        if single_rows.numel():
            out[single_rows] = self._decode(q[single_rows], key_cache, value_cache, single_slots)
        for start, end, slot in chunks:
            out[start:end] = self._sdpa(q[start:end], key_cache[slot], value_cache[slot])
        return out

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [n, H, D] over keys/values [L, H_kv, D] -> [n, H, D]."""
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
            values.transpose(0, 1).unsqueeze(0).to(q.dtype), scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return attn.squeeze(0).transpose(0, 1)

    def _decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        """One query per request, q [B, H, D], over its slot's keys -> [B, H, D]. No
        host sync, so CUDA graphs capture it. On CUDA a Triton kernel reads the slots in
        place (cross_triton.py); elsewhere the slots are gathered for SDPA (padding rows
        read slot 0)."""
        if q.is_cuda and self.use_triton:
            from spindle.attention.cross_triton import cross_decode_attention

            return cross_decode_attention(q, key_cache, value_cache, slots, self.scale)
        index = slots.to(torch.int64).clamp(min=0)
        keys = key_cache.index_select(0, index).transpose(1, 2)  # [B, H_kv, L, D]
        values = value_cache.index_select(0, index).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys.to(q.dtype),
                                             values.to(q.dtype), scale=self.scale,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return out.squeeze(2)

    def _attend_rows(self, q: torch.Tensor, md, keys: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
        """The cache-less (profiling) forward: request i's queries over keys[i]."""
        bounds = (md.query_start_loc_cpu if md.query_start_loc_cpu is not None
                  else md.query_start_loc.cpu()).tolist()
        out = torch.zeros_like(q)
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end > start:
                out[start:end] = self._sdpa(q[start:end], keys[i], values[i])
        return out

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, positions={self.num_positions}")
