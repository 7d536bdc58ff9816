"""Tensor-parallel group handle passed explicitly to model layers (no globals).

TensorParallelGroup.single() is the one-rank group used by the uni-process
executor; multi-rank groups wrap a torch.distributed process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup when size > 1

    @staticmethod
    def single() -> "TensorParallelGroup":
        return TensorParallelGroup()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x of group rank src, on every rank (in place; same shape everywhere)."""
        if self.size == 1:
            return x
        torch.distributed.broadcast(x, group=self.group, group_src=src)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim (same shape on every rank)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
