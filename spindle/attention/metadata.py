"""Attention metadata: how the flat batch of tokens of one step maps onto sequences
and onto the paged KV cache. Built by the runner, read by attention backends."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Tokens of all requests are concatenated: request i owns query tokens
    query_start_loc[i]:query_start_loc[i+1] (its *new* tokens), which are the last
    tokens of a context of seq_lens[i] tokens (cached + new). Causality is relative
    to the context: new token j of request i sees context positions
    <= seq_lens[i] - query_len_i + j.

    KV cache per layer: tensor [2, num_blocks, block_size, num_kv_heads, head_dim].
    A token at context position p of request i lives in slot
    block_tables[i, p // block_size] * block_size + p % block_size; slot_mapping
    holds the slots of this step's new tokens (in token order).
    """

    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [num_reqs] int32, on the model's device
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on device
    slot_mapping: torch.Tensor  # [num_tokens] int64, on device
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that plan on the CPU.
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    causal: bool = True
    # What a backend derives from this metadata once per step for all its layers (the
    # CPU backend's decode gather plan), keyed by the backend; the metadata is built
    # anew every step, so nothing here outlives it.
    derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
