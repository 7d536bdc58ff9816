"""Bidirectional attention without a KV cache, for encoder-only models.

A step's sequences arrive packed: [T, H, D], one whole sequence after another, no
padding. Attention is full (non-causal) within each sequence and never crosses
from one sequence to another. To attend many sequences with few kernel calls, an
EncoderAttentionMetadata groups sequences of similar length; each layer gathers
q, k and v once into the groups' padded layout ([B, L] per group, with a key
mask), runs one SDPA per group and gathers the result back. The plan is built
once per step (by the model state) and shared by every layer; the packed layout
everywhere else (embeddings, MLPs, norms) never pays for padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from spindle.forward_context import get_forward_context
from spindle.attention.heads import set_head_geometry

# A sequence joins a group of longer ones while its padding stays within this many
# tokens, or within this fraction of the group's longest sequence.
PAD_SLACK_TOKENS = 8
PAD_SLACK_FRACTION = 0.25
# Most attention scores (B * L * L, per head) one padded group may hold.
MAX_GROUP_SCORES = 1 << 22

Stage = Callable[[np.ndarray, torch.dtype], torch.Tensor]  # host array -> device tensor


@dataclass
class PaddedGroup:
    """Sequences attended by one SDPA call: rows offset .. offset + batch * width of
    the padded layout, viewed as [batch, width]. key_mask marks real keys
    ([B, 1, 1, L]; None when the group has no padding)."""

    offset: int
    batch: int
    width: int
    key_mask: torch.Tensor | None


@dataclass
class EncoderAttentionMetadata:
    """How the packed tokens map onto the padded layout of the groups.

    pad_index[r] is the packed token of padded row r (a padding row repeats its
    sequence's first token, so every row is finite); unpad_index[t] is the padded
    row of packed token t. Invariant: the groups cover every token exactly once.
    """

    num_tokens: int
    num_seqs: int
    groups: list[PaddedGroup]
    pad_index: torch.Tensor  # [P] int64
    unpad_index: torch.Tensor  # [T] int64

    @classmethod
    def from_seq_lens(cls, seq_lens: Sequence[int], device: torch.device,
                      stage: Stage | None = None) -> "EncoderAttentionMetadata":
        """Plan for packed sequences of these lengths (in packing order). stage(array,
        dtype) moves a host array to the device (default: a plain copy)."""
        stage = stage or (lambda a, dtype: torch.from_numpy(a).to(dtype).to(device))
        lens = np.asarray(seq_lens, dtype=np.int64)
        if len(lens) == 0 or np.any(lens < 1):
            raise ValueError(f"every packed sequence needs at least one token, got {list(lens)}")
        starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
        groups, pad_parts, unpad = [], [], np.empty(int(lens.sum()), dtype=np.int64)
        offset = 0
        for members in plan_groups(lens.tolist()):
            group, rows = _padded_group(starts[members], lens[members], offset, unpad, stage)
            groups.append(group)
            pad_parts.append(rows)
            offset += group.batch * group.width
        return cls(num_tokens=int(lens.sum()), num_seqs=len(lens), groups=groups,
                   pad_index=stage(np.concatenate(pad_parts), torch.int64),
                   unpad_index=stage(unpad, torch.int64))


def plan_groups(seq_lens: Sequence[int]) -> list[list[int]]:
    """Indices of the sequences, longest first, split into groups whose padding is
    small (PAD_SLACK_*) and whose score matrix is bounded (MAX_GROUP_SCORES)."""
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and _fits(groups[-1], seq_lens, seq_lens[i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _fits(group: list[int], seq_lens: Sequence[int], length: int) -> bool:
    longest = seq_lens[group[0]]
    slack = max(PAD_SLACK_TOKENS, PAD_SLACK_FRACTION * longest)
    return longest - length <= slack and (len(group) + 1) * longest * longest <= MAX_GROUP_SCORES


def _padded_group(starts: np.ndarray, lens: np.ndarray, offset: int, unpad: np.ndarray,
                  stage: Stage) -> tuple[PaddedGroup, np.ndarray]:
    """The group, and the packed token of each of its padded rows; fills unpad for
    the group's real tokens."""
    width = int(lens.max())
    cols = np.arange(width)[None, :]
    real = cols < lens[:, None]  # [B, L]
    rows = (starts[:, None] + np.where(real, cols, 0)).reshape(-1)
    unpad[rows[real.reshape(-1)]] = offset + np.flatnonzero(real.reshape(-1))
    mask = None if real.all() else stage(np.ascontiguousarray(real[:, None, None, :]), torch.bool)
    return PaddedGroup(offset=offset, batch=len(lens), width=width, key_mask=mask), rows


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      metadata: EncoderAttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, H_kv, D] packed -> [T, H, D], attention within each sequence."""
    if q.shape[0] != metadata.num_tokens:
        raise ValueError(f"attention got {q.shape[0]} tokens, the metadata plans "
                         f"{metadata.num_tokens}")
    gqa = q.shape[1] != k.shape[1]
    # One gather per tensor into the padded layout of every group (index_select is
    # several times faster than x[index]), one per-group SDPA, one gather back.
    padded = [x.index_select(0, metadata.pad_index) for x in (q, k, v)]
    outs = []
    for g in metadata.groups:
        # rows [B * L, H, D] -> [B, H, L, D]
        qg, kg, vg = (x[g.offset:g.offset + g.batch * g.width]
                      .view(g.batch, g.width, x.shape[1], x.shape[2]).transpose(1, 2)
                      for x in padded)
        res = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.key_mask, scale=scale,
                                             enable_gqa=gqa)
        outs.append(res.transpose(1, 2).reshape(g.batch * g.width, q.shape[1], q.shape[2]))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out.index_select(0, metadata.unpad_index)


class EncoderAttention(nn.Module):
    """Multi-head attention of an encoder layer: forward(q [T, H*D], k, v [T, H_kv*D])
    -> [T, H*D] for the packed sequences that the forward context's
    EncoderAttentionMetadata describes. It owns no KV cache (so the runner, which
    allocates caches for spindle.attention.Attention layers only, gives it none)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        set_head_geometry(self, num_heads, head_dim, scale, num_kv_heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, EncoderAttentionMetadata):
            raise TypeError("EncoderAttention needs EncoderAttentionMetadata in the forward "
                            f"context, got {type(metadata).__name__}")
        num_tokens = q.shape[0]
        out = encoder_attention(q.view(num_tokens, self.num_heads, self.head_dim),
                                k.view(num_tokens, self.num_kv_heads, self.head_dim),
                                v.view(num_tokens, self.num_kv_heads, self.head_dim),
                                metadata, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, scale={self.scale:.4g}, bidirectional, no cache")
