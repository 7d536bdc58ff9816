"""Pipeline parallelism: which layers a stage owns, and the hand-off between stages.

Ranks are laid out stage-major: rank = stage * tp + tp_rank, so the tp ranks of a
stage are contiguous (and an executor that keeps each node's ranks contiguous never
splits a TP group across nodes). A stage sends its hidden states and residual to the
rank of the same tp_rank in the next stage (torch.distributed send/recv: gloo on CPU,
NCCL on CUDA). The last stage samples and reports; the other stages learn the
sampled tokens from the next SchedulerOutput (CachedRequestData.new_token_ids), so no
stage waits for the last one and up to P batches can be in flight.
Nothing here knows an architecture: models read a PipelineStage's layer range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


def partition_layers(num_layers: int, num_stages: int,
                     partition: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) layer range of every stage. partition: explicit layers per stage
    (must sum to num_layers); default: as even as possible, earlier stages one fewer
    (the last stage also computes logits and samples)."""
    if partition is not None:
        counts = list(partition)
        if len(counts) != num_stages or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(f"pipeline_layer_partition {counts} must give each of the "
                             f"{num_stages} stages at least one layer, {num_layers} in all")
    else:
        if num_layers < num_stages:
            raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's "
                             f"{num_layers} layers")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s >= num_stages - extra else 0) for s in range(num_stages)]
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


@dataclass(frozen=True)
class IntermediateTensors:
    """What one stage hands the next: hidden states and the residual stream [T, H]."""

    hidden_states: torch.Tensor
    residual: torch.Tensor


@dataclass(frozen=True)
class PipelineStage:
    rank: int = 0  # stage index
    size: int = 1  # number of stages
    start_layer: int = 0
    end_layer: int | None = None  # None: every layer (one stage)
    tp_size: int = 1
    global_rank: int = 0

    @staticmethod
    def single() -> "PipelineStage":
        return PipelineStage()

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns_layer(self, index: int) -> bool:
        return self.start_layer <= index and (self.end_layer is None or index < self.end_layer)

    # ---- hand-off (called only when size > 1) -------------------------------------
    def send(self, tensors: IntermediateTensors) -> None:
        dst = self.global_rank + self.tp_size
        torch.distributed.send(tensors.hidden_states.contiguous(), dst=dst)
        torch.distributed.send(tensors.residual.contiguous(), dst=dst)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> IntermediateTensors:
        src = self.global_rank - self.tp_size
        hidden = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
        residual = torch.empty_like(hidden)
        torch.distributed.recv(hidden, src=src)
        torch.distributed.recv(residual, src=src)
        return IntermediateTensors(hidden, residual)


def build_parallel_groups(rank: int, tp: int, pp: int, backend: str | None,
                          partition: Sequence[int] | None,
                          num_layers: int | None) -> tuple[Any, "PipelineStage"]:
    """Inside an initialised world of tp * pp ranks: this rank's TP process group and
    its PipelineStage. Every rank creates every TP group (torch.distributed requires it)."""
    if pp == 1:
        return torch.distributed.group.WORLD, PipelineStage(tp_size=tp, global_rank=rank)
    stage = rank // tp
    tp_group = None
    for s in range(pp):
        group = torch.distributed.new_group(list(range(s * tp, (s + 1) * tp)), backend=backend)
        if s == stage:
            tp_group = group
    start, end = partition_layers(num_layers, pp, partition)[stage]
    return tp_group, PipelineStage(rank=stage, size=pp, start_layer=start, end_layer=end,
                                   tp_size=tp, global_rank=rank)
