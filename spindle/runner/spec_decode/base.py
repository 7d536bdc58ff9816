"""The Proposer interface: what the runner asks of a way to guess tokens."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from spindle.config import SpeculativeConfig
    from spindle.runner.input_batch import StepBatch
    from spindle.runner.model_runner import ModelRunner


@dataclass
class Proposal:
    """Drafts for one request: the token ids, and the distribution each was drawn
    from ([len, V] on the device), or None when each draft stands alone (a lookup,
    or a greedy draft: rejection sampling then treats it as certain)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(abc.ABC):
    """Owned by a ModelRunner. Hooks are called in this order: load_model (inside
    the runner's load_model), block_bytes and allocate_cache (with the runner's
    cache), after_forward (every step, after the target's forward), propose
    (after a speculating step's tokens are known)."""

    def __init__(self, config: "SpeculativeConfig", runner: "ModelRunner") -> None:
        self.config = config
        self.runner = runner
        self.num_speculative_tokens = config.num_speculative_tokens

    def load_model(self) -> None:
        """Load what the proposer runs (called with the runner's weights scope)."""

    def block_bytes(self, block_size: int) -> int:
        """Bytes the proposer's own cache adds to one KV block id."""
        return 0

    def allocate_cache(self, num_blocks: int,
                       allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
                       ) -> list[torch.Tensor]:
        """Allocate the proposer's cache for num_blocks block ids; returns its tensors."""
        return []

    def weights(self) -> list[torch.Tensor]:
        """The proposer's parameters and buffers (sleep mode moves them with the target's;
        the runner drops repeats)."""
        return []

    def buffers(self) -> list[torch.Tensor]:
        """Tensors derived from config rather than loaded (a reload does not restore them)."""
        return []

    def reload_weights(self) -> None:
        """Load the proposer's weights again from their checkpoint (sleep level 2)."""

    def release(self) -> None:
        """Drop every device tensor."""

    def after_forward(self, batch: "StepBatch", feed, hidden: torch.Tensor) -> None:
        """Runs after the target's forward of every step (feed writes the in-flight
        input ids into a step's input_ids, or is None)."""

    @abc.abstractmethod
    def propose(self, req_ids: list[str]) -> dict[str, Proposal]:
        """Drafts to follow each request's known tokens (the runner's input batch holds
        them); a request may get none."""
