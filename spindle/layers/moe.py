"""Sparse mixture-of-experts blocks (Qwen3-MoE, Mixtral), computed as transformers does.

A router (a replicated [E, H] linear) scores every token against E experts; each token
goes to its top_k experts, weighted by their softmax probabilities (renormalised over
the chosen ones when the model says so), and the block's output is the weighted sum
of those experts' SwiGLU MLPs. (FusedExperts also serves NemotronH's experts, of
squared-ReLU MLPs without a gate, routed by models/nemotron_h.py, and gpt-oss's, with
biases and a clamped SwiGLU: models/gpt_oss.py.)

Tensor parallelism splits every expert like the dense MLP: each rank holds its slice of
every expert's intermediate features (gate and up column-parallel, down row-parallel),
so a rank computes a partial sum of each token's output and one all-reduce per block
adds them. The router is replicated, so every rank routes every token alike.

On CPU (and in batch-invariant mode) the experts run as torch code, one at a time over
the tokens routed to it (the experts in increasing order, each token's contributions
added in that order, as transformers does). On CUDA they run as two fused grouped
GEMMs over the tokens sorted by expert (fused_moe.py), with no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.activation import relu_squared
from spindle.layers.linear import (apply_linear, copy_checked, default_weight_loader, divide,
                                   set_weight_loader)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: gate clamped to <= limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float


class FusedExperts(nn.Module):
    """E experts' weights stacked: w13 [E, 2 * I_local, H] ([gate | up] of this rank's
    slice) and w2 [E, H, I_local]. Checkpoint tensors load with shard ids (e, "gate"),
    (e, "up") and (e, "down").

    gated=False: experts of two projections, down(relu(up(x))^2) (NemotronH's): w13 is
    [E, I_local, H], the up projection alone, and there is no "gate" shard.
    bias: biases on both projections (w13_bias [E, 2 * I_local], w2_bias [E, H], shard
    ids (e, part) as the weights'; w2's added on rank 0 only, before the all-reduce).
    activation: a ClampedSwiGLU in place of SiLU (gated experts only)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp_group: TensorParallelGroup, gated: bool = True, bias: bool = False,
                 activation: ClampedSwiGLU | None = None) -> None:
        super().__init__()
        if activation is not None and not gated:
            raise ValueError("a clamped SwiGLU needs gated experts")
        self.num_experts = num_experts
        self.tp_group = tp_group
        self.gated = gated
        self.activation = activation
        self.local_size = divide(intermediate_size, tp_group.size, "moe intermediate size")
        self.w13_parts = ("gate", "up") if gated else ("up",)
        self.w13 = nn.Parameter(
            torch.empty(num_experts, len(self.w13_parts) * self.local_size, hidden_size),
            requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_size),
                               requires_grad=False)
        set_weight_loader(self.w13, self.weight_loader,
                          [(e, part) for e in range(num_experts) for part in self.w13_parts])
        set_weight_loader(self.w2, self.weight_loader, [(e, "down") for e in range(num_experts)])
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(
                torch.empty(num_experts, len(self.w13_parts) * self.local_size),
                requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size),
                                        requires_grad=False)
            set_weight_loader(self.w13_bias, self.weight_loader,
                              [(e, part) for e in range(num_experts) for part in self.w13_parts])
            set_weight_loader(self.w2_bias, self.weight_loader,
                              [(e, "down") for e in range(num_experts)])
        self.batch_invariant = False  # set by enable_batch_invariance

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
                      ) -> None:
        parts = (*self.w13_parts, "down")
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2
                and isinstance(shard_id[0], int) and 0 <= shard_id[0] < self.num_experts
                and shard_id[1] in parts):
            raise ValueError(f"expert weights need a shard id (expert, "
                             f"{'|'.join(repr(p) for p in parts)}), got {shard_id!r}")
        expert, part = shard_id
        size, rank = self.local_size, self.tp_group.rank
        if part == "down" and param is self.w2_bias:
            copy_checked(param.data[expert], loaded)  # (whole: added on rank 0 only)
        elif part == "down":
            copy_checked(param.data[expert], loaded.narrow(1, rank * size, size))
        else:
            offset = size if part == "up" and self.gated else 0
            copy_checked(param.data[expert].narrow(0, offset, size),
                         loaded.narrow(0, rank * size, size))

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H], top_ids / top_weights [T, k] -> this rank's part of the output.
        On CUDA the fused grouped GEMMs (fused_moe.py: no host sync, CUDA-graph safe),
        unless batch-invariant; elsewhere one expert at a time in torch."""
        w2_bias = self.w2_bias if self.tp_group.rank == 0 else None
        if x.is_cuda and not self.batch_invariant:
            from spindle.layers.fused_moe import fused_experts

            return fused_experts(x, self.w13, self.w2, top_ids, top_weights, self.gated,
                                 self.w13_bias, w2_bias, self.activation)
        out = torch.zeros_like(x)
        by_rank = top_ids.T  # [k, T]: where() lists (rank, token) pairs rank-major, as HF
        for expert in torch.unique(top_ids).tolist():
            rank_of, tokens = torch.where(by_rank == expert)
            h = apply_linear(x[tokens], self.w13[expert], invariant=self.batch_invariant)
            if self.w13_bias is not None:
                h = h + self.w13_bias[expert].to(h.dtype)
            h = self._activate(h)
            h = apply_linear(h, self.w2[expert], invariant=self.batch_invariant)
            if w2_bias is not None:
                h = h + w2_bias[expert].to(h.dtype)
            h = h * top_weights[tokens, rank_of, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        return out

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return relu_squared(h)
        gate, up = h.chunk(2, dim=-1)
        if self.activation is None:
            return F.silu(gate) * up
        limit = self.activation.limit
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.activation.alpha))


class Router(nn.Module):
    """The router's replicated weight [E, H] (checkpoint name `gate.weight`)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)


class SparseMoeBlock(nn.Module):
    """Router + experts. weights_in_activation_dtype: the routing weights are cast to
    the activation dtype before they scale the experts' outputs (Qwen3-MoE) rather
    than kept in float32 (Mixtral)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 intermediate_size: int, normalize_top_k: bool,
                 weights_in_activation_dtype: bool, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts "
                             f"({num_experts})")
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.weights_in_activation_dtype = weights_in_activation_dtype
        self.tp_group = tp_group
        self.gate = Router(num_experts, hidden_size)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, tp_group)
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = apply_linear(x, self.gate.weight, invariant=self.batch_invariant)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weights, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        if self.weights_in_activation_dtype:
            top_weights = top_weights.to(logits.dtype)
        return self.tp_group.all_reduce(self.experts(x, top_ids, top_weights))

    def extra_repr(self) -> str:
        return (f"experts={self.experts.num_experts}, top_k={self.top_k}, "
                f"intermediate per rank={self.experts.local_size}")

