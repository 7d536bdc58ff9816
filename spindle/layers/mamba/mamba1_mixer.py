"""The Mamba (version 1) mixer: in_proj to x and the gate z -> causal conv1d (SiLU) over
x -> x_proj to the step's dt (low rank), B and C -> dt_proj -> the selective scan
(selective_scan.py), gated by silu(z) -> out_proj, over per-sequence state slots.

dt, B and C are RMS-normalised in Jamba (norms with weights) and FalconMamba (without
weights), and used as they come in Mamba (``selection_norms``).

Tensor parallelism splits the intermediate channels: each rank holds its share of x
and z (column-parallel pieces of in_proj), of the conv, of dt_proj's rows, A_log, D
and out_proj's input (row parallel). x_proj reads every channel, so it is row parallel
too: its output (dt's low-rank input, B, C), all-reduced, is the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spindle.cache.spec import MambaCacheSpec
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import (RowParallelLinear, apply_linear, divide,
                                   set_weight_loader)
from spindle.layers.mamba import selective_scan
from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.mixer import (DepthwiseConvWeights, RowPiecesLinear, _ops_for,
                                        by_step_kind, rows_loader, step_metadata)
from spindle.layers.norm import RMSNorm, rms_normalized


class Mamba1Mixer(nn.Module):
    """forward(hidden_states [T, hidden]) -> [T, hidden] for the step's flat batch.
    ``kv_cache`` is None (the profiling forward) or [conv_state [S, D, K-1], ssm_state
    [S, D, N]] with this rank's D channels, assigned by the runner."""

    def __init__(self, *, hidden_size: int, intermediate_size: int, state_size: int,
                 conv_kernel: int, dt_rank: int, eps: float, conv_bias: bool, proj_bias: bool,
                 tp_group: TensorParallelGroup, selection_norms: str = "weighted",
                 state_dtype: torch.dtype | None = None) -> None:
        """selection_norms: "weighted" (Jamba's dt/b/c_layernorm), "weightless"
        (FalconMamba's) or "none" (Mamba's). state_dtype: the SSM state's dtype (None:
        the model's)."""
        super().__init__()
        if conv_kernel < 2:
            raise ValueError(f"mamba_d_conv must be >= 2, got {conv_kernel}")
        if dt_rank < 1:
            raise ValueError(f"mamba_dt_rank must be >= 1, got {dt_rank}")
        if selection_norms not in ("weighted", "weightless", "none"):
            raise ValueError(f"selection_norms must be 'weighted', 'weightless' or 'none', "
                             f"got {selection_norms!r}")
        tp, rank = tp_group.size, tp_group.rank
        self.tp_group = tp_group
        self.channels = divide(intermediate_size, tp, "the mamba intermediate size")
        self.state_size, self.conv_kernel, self.dt_rank = state_size, conv_kernel, dt_rank
        channels = [(rank * self.channels, self.channels)]
        # Checkpoint in_proj rows: [x | z], each intermediate_size wide.
        self.in_proj = RowPiecesLinear(
            hidden_size, channels + [(intermediate_size + rank * self.channels, self.channels)],
            bias=proj_bias)
        self.conv1d = DepthwiseConvWeights(channels, conv_kernel, bias=conv_bias)
        self.x_proj = RowParallelLinear(intermediate_size, dt_rank + 2 * state_size, bias=False,
                                        tp_group=tp_group)
        self.selection_norms, self.eps, self.state_dtype = selection_norms, eps, state_dtype
        if selection_norms == "weighted":
            self.dt_layernorm = RMSNorm(dt_rank, eps=eps)
            self.b_layernorm = RMSNorm(state_size, eps=eps)
            self.c_layernorm = RMSNorm(state_size, eps=eps)
        # dt_proj's bias joins dt inside the scan, before the softplus.
        self.dt_proj = RowPiecesLinear(dt_rank, channels, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.channels, state_size), requires_grad=False)
        set_weight_loader(self.A_log, rows_loader(channels))
        self.D = nn.Parameter(torch.empty(self.channels), requires_grad=False)
        set_weight_loader(self.D, rows_loader(channels))
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, bias=proj_bias,
                                          tp_group=tp_group)
        self.kv_cache: list[torch.Tensor] | None = None
        self.cache_group = 0  # which cache group's metadata this layer reads (the runner sets it)

    def cache_spec(self, dtype: torch.dtype) -> MambaCacheSpec:
        """Per sequence: the conv state [D, K-1] in the model's dtype and the SSM state
        [D, N] in state_dtype (default: the model's)."""
        return MambaCacheSpec(shapes=((self.channels, self.conv_kernel - 1),
                                      (self.channels, self.state_size)),
                              dtypes=(dtype, self.state_dtype or dtype))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        md = step_metadata(self, hidden_states.shape[0], hidden_states.device)
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)
        conv_ops, scan_ops = _ops_for(hidden_states), scan_ops_for(hidden_states)
        conv_state, ssm_state = self.kv_cache if self.kv_cache is not None else (None, None)

        def decode(x: torch.Tensor, z: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            x = conv_ops.causal_conv1d_decode(x, self.conv1d.weight, self.conv1d.bias,
                                              conv_state, slots)
            return scan_ops.selective_scan_decode(x, *self._selection(x), z, ssm_state, slots)

        def prefill(x: torch.Tensor, z: torch.Tensor, md: MambaMetadata) -> torch.Tensor:
            x = conv_ops.causal_conv1d_prefill(x, self.conv1d.weight, self.conv1d.bias,
                                               conv_state, md)
            return scan_ops.selective_scan_prefill(x, *self._selection(x), z, ssm_state, md)

        y = by_step_kind(md, self.kv_cache is not None, (x, z), decode, prefill)
        return self.out_proj(y)

    def _selection(self, x: torch.Tensor):
        """(dt without its bias, A_log, B, C, D, dt_bias) of the convolved x."""
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.state_size, self.state_size],
                                        dim=-1)
        if self.selection_norms == "weighted":
            dt, B, C = (self.dt_layernorm(dt.contiguous()), self.b_layernorm(B.contiguous()),
                        self.c_layernorm(C.contiguous()))
        elif self.selection_norms == "weightless":
            dt, B, C = (rms_normalized(t, self.eps).to(t.dtype) for t in (dt, B, C))
        dt = apply_linear(dt.contiguous(), self.dt_proj.weight)
        return dt, self.A_log, B.contiguous(), C.contiguous(), self.D, self.dt_proj.bias

    def extra_repr(self) -> str:
        return (f"channels={self.channels} (per rank), state={self.state_size}, "
                f"conv={self.conv_kernel}, dt_rank={self.dt_rank}, "
                f"tp_size={self.tp_group.size}")


def scan_ops_for(x: torch.Tensor) -> Any:
    """The selective scan's ops: torch on the CPU, the Triton kernels on CUDA."""
    if x.is_cuda:
        from spindle.layers.mamba import selective_scan_triton

        return selective_scan_triton
    return selective_scan


def jamba_mixer(hf_config: Any, tp_group: TensorParallelGroup) -> Mamba1Mixer:
    """The mixer of a Jamba config's ``mamba_*`` fields."""
    return Mamba1Mixer(
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.mamba_expand * hf_config.hidden_size,
        state_size=hf_config.mamba_d_state, conv_kernel=hf_config.mamba_d_conv,
        dt_rank=hf_config.mamba_dt_rank, eps=hf_config.rms_norm_eps,
        conv_bias=bool(hf_config.mamba_conv_bias), proj_bias=bool(hf_config.mamba_proj_bias),
        tp_group=tp_group)


def mamba_mixer(hf_config: Any, tp_group: TensorParallelGroup) -> Mamba1Mixer:
    """The mixer of a Mamba config (``state_size``, ``conv_kernel``, ``time_step_rank``,
    ...). The SSM state is float32, as transformers keeps it (its scan runs in float32)."""
    return _mamba_config_mixer(hf_config, tp_group, "none", hf_config.layer_norm_epsilon)


def falcon_mamba_mixer(hf_config: Any, tp_group: TensorParallelGroup) -> Mamba1Mixer:
    """Mamba's mixer with FalconMamba's weightless norms on dt, B and C."""
    return _mamba_config_mixer(hf_config, tp_group, "weightless", hf_config.mixer_rms_eps)


def _mamba_config_mixer(hf_config: Any, tp_group: TensorParallelGroup, selection_norms: str,
                        eps: float) -> Mamba1Mixer:
    return Mamba1Mixer(
        hidden_size=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size,
        state_size=hf_config.state_size, conv_kernel=hf_config.conv_kernel,
        dt_rank=int(hf_config.time_step_rank), eps=eps,
        conv_bias=bool(hf_config.use_conv_bias), proj_bias=bool(hf_config.use_bias),
        tp_group=tp_group, selection_norms=selection_norms, state_dtype=torch.float32)
