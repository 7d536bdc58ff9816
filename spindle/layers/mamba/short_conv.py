"""A gated short convolution (LFM2's ``conv`` layers): in_proj to B, C and x, a
depthwise causal convolution of B * x over the last few tokens, then C times that,
and out_proj.

Its state per sequence is the convolution's history, conv_state [S, C, K-1]: one
state tensor, in the state slots the runner gives state layers (MambaCacheSpec), and
the same conv ops as a Mamba2 mixer's, without the activation. Tensor parallelism
splits the channels: each rank holds its share of B, C and x (column-parallel pieces
of in_proj), of the convolution, and of out_proj's input (row parallel).
"""

from __future__ import annotations

import torch
from torch import nn

from spindle.cache.spec import MambaCacheSpec
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import RowParallelLinear, divide
from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.mixer import (DepthwiseConvWeights, RowPiecesLinear, _ops_for,
                                        by_step_kind, step_metadata)


class ShortConv(nn.Module):
    """forward(hidden_states [T, hidden]) -> [T, hidden] for the step's flat batch.
    ``kv_cache`` is None (the profiling forward) or [conv_state [S, C, K-1]] with this
    rank's C channels, assigned by the runner."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool,
                 tp_group: TensorParallelGroup) -> None:
        super().__init__()
        if kernel < 2:
            raise ValueError(f"conv_L_cache must be >= 2, got {kernel}")
        self.channels = divide(hidden_size, tp_group.size, "hidden_size")  # rank-local
        self.kernel = kernel
        first = tp_group.rank * self.channels
        # Checkpoint in_proj rows: [B | C | x], each hidden_size wide.
        self.in_proj = RowPiecesLinear(
            hidden_size, [(part * hidden_size + first, self.channels) for part in range(3)],
            bias=bias)
        self.conv = DepthwiseConvWeights([(first, self.channels)], kernel, bias=bias)
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias=bias,
                                          tp_group=tp_group)
        self.kv_cache: list[torch.Tensor] | None = None
        self.cache_group = 0  # which cache group's metadata this layer reads (the runner sets it)

    def cache_spec(self, dtype: torch.dtype) -> MambaCacheSpec:
        """Per sequence: the convolution's history [C, K-1], in the model's dtype."""
        return MambaCacheSpec(shapes=((self.channels, self.kernel - 1),), dtypes=(dtype,))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        md = step_metadata(self, hidden_states.shape[0], hidden_states.device)
        ops = _ops_for(hidden_states)
        b, c, x = self.in_proj(hidden_states).chunk(3, dim=-1)
        conv_state = self.kv_cache[0] if self.kv_cache is not None else None

        def decode(bx: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            return ops.causal_conv1d_decode(bx, self.conv.weight, self.conv.bias, conv_state,
                                            slots, activation=None)

        def prefill(bx: torch.Tensor, md: MambaMetadata) -> torch.Tensor:
            return ops.causal_conv1d_prefill(bx, self.conv.weight, self.conv.bias,
                                             conv_state, md, activation=None)

        y = by_step_kind(md, conv_state is not None, (b * x,), decode, prefill)
        return self.out_proj(c * y)

    def extra_repr(self) -> str:
        return f"channels={self.channels} (per rank), kernel={self.kernel}"
