"""What a state-space layer needs to know about one step: how the flat batch of
tokens splits into requests, and which state slot each request owns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class MambaMetadata:
    """Request i owns tokens query_start_loc[i]:query_start_loc[i+1] of the step (its
    new tokens, in order) and state slot state_indices[i] of every mamba layer's state
    tensors ([num_slots, ...]). has_initial_state[i] is False when the request starts
    at its first token this step: its states are taken as zeros (whatever the slot
    held before), and written at the end of the step either way.

    A negative state index marks a padding row (a CUDA-graph batch padded to a
    captured size): it reads and writes no state, and its output is finite garbage.
    """

    num_reqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    state_indices: torch.Tensor  # [num_reqs] int32, device
    has_initial_state: torch.Tensor  # [num_reqs] bool, device
    max_query_len: int
    # Host copies, for code that plans on the CPU (None inside CUDA graphs).
    query_start_loc_cpu: torch.Tensor | None = None
    has_initial_state_cpu: torch.Tensor | None = None
    state_indices_cpu: torch.Tensor | None = None
    # [num_reqs] bool, host: the request's tokens this step are prompt tokens. Set only
    # for models whose state layers tell the two apart (MambaMixer(limit_decode_steps=
    # False)); None otherwise, and inside CUDA graphs, which the runner then keeps to
    # generated tokens.
    prompt_rows_cpu: torch.Tensor | None = None
    # What the layers derive from this step's metadata once and share (the SSD scan's
    # chunk table, the split of a mixed step): one metadata object serves every layer
    # of its group in one forward, and lives for that step only.
    derived: dict[str, Any] = field(default_factory=dict)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1
