"""Attention metadata: how the flat batch of tokens of one step maps onto sequences
and onto the paged KV cache. Built by the runner, read by attention backends."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from spindle.switches import on_off

LONGEST_FIRST_ENV = "SPINDLE_DECODE_LONGEST_FIRST"
MIXED_SPLIT_ENV = "SPINDLE_MIXED_DECODE_KERNEL"


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
    # [num_reqs] int32 on device, decode steps only: the order in which the decode
    # kernel starts the requests (a permutation, longest context first), or None for
    # batch order. See decode_order().
    decode_order: torch.Tensor | None = None
    # Steps holding both requests with one new token and requests with more (a prompt
    # chunk beside decodes), on a GPU: [R1] and [R2] int32 on device, the first kind
    # longest context first, the second in batch order; None otherwise. The Triton
    # backend may attend for the first kind in the decode kernel (see
    # mixed_step_requests and TritonAttentionBackend.forward).
    single_token_reqs: torch.Tensor | None = None
    multi_token_reqs: torch.Tensor | None = None
    # What a backend derives from this metadata once per step for all its layers (the
    # CPU backend's decode gather plan), keyed by the backend; the metadata is built
    # anew every step, so nothing here outlives it.
    derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


def longest_first_enabled(environ=os.environ) -> bool:
    """Whether decode steps start the longest contexts first (the default) or keep
    batch order (SPINDLE_DECODE_LONGEST_FIRST=0). Measured (docs/benchmarks.md): the
    kernel alone 7% faster at 256 requests and 13% at 128 on an H200; the engine's nano
    workload 1.3% faster on an H100, batch-1 decode unchanged, the same greedy tokens."""
    return on_off(LONGEST_FIRST_ENV, True, environ)


def decode_order(seq_lens: np.ndarray) -> np.ndarray:
    """The requests of a decode step, longest context first (ties in batch order).

    A decode step's programs are one per (request, KV head), each reading its whole
    context, so their lengths differ up to 20-fold. Started in batch order, a long
    context met late runs on alone while the rest of the GPU idles; started longest
    first, the short ones fill in behind the long ones (longest-processing-time-first
    scheduling). Padding rows (length 0) come last."""
    return np.argsort(-np.asarray(seq_lens, dtype=np.int64), kind="stable").astype(np.int32)


def mixed_split_enabled(environ=os.environ) -> bool:
    """Whether a mixed step on a GPU may attend for its single-token requests in the
    decode kernel (the default) or keeps every request in the prefill kernel
    (SPINDLE_MIXED_DECODE_KERNEL=0), where each takes a 64-row tile of one valid row
    per query head. Measured (docs/benchmarks.md): a layer's attention at 8,192 tokens
    with 248 decoding requests 1,034 -> 509 us on an H100."""
    return on_off(MIXED_SPLIT_ENV, True, environ)


def mixed_step_requests(query_lens: np.ndarray,
                        seq_lens: np.ndarray) -> tuple[np.ndarray, int] | None:
    """A mixed step's requests as one int32 array: those with one new token, longest
    context first (ties in batch order, as decode_order), then those with more in batch
    order; and how many of the first kind there are. None when the step lacks either
    kind."""
    query_lens = np.asarray(query_lens)
    single = query_lens == 1
    num_single = int(single.sum())
    if num_single == 0 or num_single == len(query_lens):
        return None
    singles = np.flatnonzero(single)
    singles = singles[decode_order(np.asarray(seq_lens)[singles])]
    return np.concatenate([singles, np.flatnonzero(~single)]).astype(np.int32), num_single
