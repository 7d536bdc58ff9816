"""Kimi delta attention (KDA, the linear-attention layers of Moonshot's KimiLinear):
q_proj, k_proj and v_proj -> a causal conv1d over each (SiLU) -> the gated delta rule
with a decay per key feature (layers/mamba/gated_delta.py) -> an RMSNorm of each head
times sigmoid of a low-rank output gate -> o_proj, over per-sequence state slots.

Against Gated DeltaNet (gated_delta_net.py): as many key heads as value heads, each of
head_dim features; the decay's input a is a low-rank projection of the layer's input
(f_a_proj, then f_b_proj to heads x head_dim), so a token decays each key feature of
the state on its own; the output gate is low-rank too (g_a_proj, g_b_proj) and meets
the norm through a sigmoid, not SiLU.

Checkpoints keep every projection apart, and the convolutions of q, k and v
(``q_conv1d`` ...). Those of the layer's input load into one projection (``in_proj``,
INPUT_SHARDS: rows [q | k | v | b | f_a | g_a], one matmul a step) and the convs into one
conv weight (rows [q | k | v]), by shard id, so the conv input is a slice of that
matmul's output. ``A_log`` is stored [1, 1, H, 1] and ``dt_bias`` [H * head_dim].

Tensor parallelism splits the heads across ranks, and with them q, k, v, the conv
channels, f_b_proj's and g_b_proj's rows, dt_bias, A_log and the states; f_a_proj and
g_a_proj (head_dim outputs) are replicated, o_proj is row parallel.

On CUDA the convolutions, the decode step and the output norm are Triton kernels (the
conv kernels and gated_rms_norm with a sigmoid gate of triton_ops.py, gated_delta_triton's
decode with a decay per key feature); the prefill is gated_delta.py's torch code, every
chunk of the step batched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spindle.cache.spec import MambaCacheSpec
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import RowParallelLinear, divide, set_weight_loader
from spindle.layers.mamba.gated_delta_net import delta_rule_step, tiled_loader
from spindle.layers.mamba.mixer import (DepthwiseConvWeights, GatedRMSNorm, RowPiecesLinear,
                                        rows_loader)

# Tokens per chunk of the prefill. A decay per key feature makes the in-chunk products
# [L, L, Dk] per head: chunks of 16 took 264 ms where 64 took 1,423 ms (a 2,048-token
# prompt, 8 heads of 128, the 2-core CPU; docs/benchmarks.md), and hold a quarter of the
# batched form's decays per token.
KDA_CHUNK = 16
# The checkpoint's projections of the layer's input -> their shard ids in in_proj.
INPUT_SHARDS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "b_proj": "b",
                "f_a_proj": "f_a", "g_a_proj": "g_a"}


class KimiDeltaAttention(nn.Module):
    """forward(hidden_states [T, hidden]) -> [T, hidden] for the step's flat batch.

    ``kv_cache`` is None (the memory-profiling forward) or [conv_state [S, 3 * H * D,
    K-1], recurrent_state [S, H, D, D]] with this rank's heads, assigned by the runner;
    the recurrent state is float32 (see GatedDeltaNet)."""

    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int,
                 eps: float, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        if conv_kernel < 2:
            raise ValueError(f"short_conv_kernel_size must be >= 2, got {conv_kernel}")
        rank = tp_group.rank
        self.num_heads = divide(num_heads, tp_group.size, "linear_attn_config num_heads")
        self.head_dim, self.conv_kernel = head_dim, conv_kernel
        self.width = self.num_heads * head_dim  # rank-local q (or k, or v) features
        heads = [(rank * self.num_heads, self.num_heads)]
        features = [(rank * self.width, self.width)]
        qkv = {"q": features, "k": features, "v": features}
        low_rank = [(0, head_dim)]  # (replicated)
        self.in_proj = RowPiecesLinear(hidden_size, {**qkv, "b": heads, "f_a": low_rank,
                                                     "g_a": low_rank}, bias=False)
        self.conv1d = DepthwiseConvWeights(qkv, conv_kernel, bias=False)
        self.f_b_proj = RowPiecesLinear(head_dim, features, bias=False)
        self.g_b_proj = RowPiecesLinear(head_dim, features, bias=False)
        # (float32 whatever the model's dtype, as transformers keeps it)
        self.dt_bias = nn.Parameter(torch.empty(self.width, dtype=torch.float32),
                                    requires_grad=False)
        set_weight_loader(self.dt_bias, rows_loader(features))
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        set_weight_loader(self.A_log, flat_rows_loader(heads))
        # One weight [D] for every head, stored tiled (as GatedDeltaNet's).
        self.o_norm = GatedRMSNorm(self.width, self.width, eps, tp_group, [],
                                   group_size=head_dim, norm_first=True, sigmoid_gate=True)
        set_weight_loader(self.o_norm.weight, tiled_loader(self.num_heads))
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=False,
                                        tp_group=tp_group)
        self.kv_cache: list[torch.Tensor] | None = None
        self.cache_group = 0  # which cache group's metadata this layer reads (the runner sets it)

    def cache_spec(self, dtype: torch.dtype) -> MambaCacheSpec:
        """Per sequence: the conv state [3 * H * D, K-1] in the model's dtype and the
        recurrent state [H, D, D] in float32."""
        return MambaCacheSpec(
            shapes=((3 * self.width, self.conv_kernel - 1),
                    (self.num_heads, self.head_dim, self.head_dim)),
            dtypes=(dtype, torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv, b, f, g = self.in_proj(hidden_states).split(
            [3 * self.width, self.num_heads, self.head_dim, self.head_dim], dim=-1)
        a = self.f_b_proj(f).view(num_tokens, self.num_heads, self.head_dim)
        y = delta_rule_step(self, qkv, a, b, self.dt_bias.view(self.num_heads, self.head_dim),
                            KDA_CHUNK)
        return self.o_proj(self.o_norm(y.reshape(num_tokens, self.width), self.g_b_proj(g)))

    def _split_qkv(self, qkv: torch.Tensor):
        shape = (qkv.shape[0], self.num_heads, self.head_dim)
        return tuple(part.reshape(shape) for part in qkv.split(self.width, dim=-1))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, conv={self.conv_kernel} "
                "(per rank)")


def flat_rows_loader(rows) -> Any:
    """rows_loader of the checkpoint tensor flattened (A_log, stored [1, 1, H, 1])."""
    load_rows = rows_loader(rows)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        load_rows(param, loaded.reshape(-1), shard_id)

    return load
