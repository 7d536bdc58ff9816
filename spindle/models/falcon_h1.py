"""FalconH1ForCausalLM: TII's Falcon-H1, whose every layer runs attention and a Mamba2
mixer side by side on the same normed input and adds their outputs.

Built on Bamba's pieces (models/bamba.py: the mixer, the attention module, the model
and its checkpoint names, which FalconH1 shares: ``mamba``, ``self_attn``,
``feed_forward``, ``input_layernorm``, ``pre_ff_layernorm``, ``final_layernorm``).
What FalconH1 adds, each as transformers computes it:

- maximal-update multipliers: on the embeddings, on the attention's input and output,
  on its keys (before the rotary embedding), on the mixer's input and output, on each
  of in_proj's five outputs (z, x, B, C, dt: ``ssm_multipliers``), on the MLP's gate
  (inside the activation) and its output (``mlp_multipliers``), and on the logits
  (``lm_head_multiplier``);
- the mixer's gate: ``mamba_rms_norm`` off multiplies by silu(z) with no norm;
  on, the grouped norm comes before the gate (``mamba_norm_before_gate``) or after it;
- the mixer's width ``mamba_d_ssm`` (default expand * hidden), its out_proj bias
  ``projectors_bias`` apart from in_proj's ``mamba_proj_bias``.
Attention rotates whole heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.mamba.mixer import (GATE_ONLY, GATE_THEN_NORM, NORM_THEN_GATE, MambaMixer,
                                        time_step_limit)
from spindle.layers.norm import RMSNorm
from spindle.models import bamba
from spindle.models.bamba import (BambaAttention, BambaForCausalLM, FeedForwardFactory,
                                  HybridLayout)
from spindle.models.llama import LlamaMLP, head_dim_of


def mamba_intermediate(hf_config: Any) -> int:
    d_ssm = getattr(hf_config, "mamba_d_ssm", None)
    if d_ssm is not None:
        return int(d_ssm)
    return int(getattr(hf_config, "mamba_expand", 2) * hf_config.hidden_size)


def mamba_head_dim(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "mamba_d_head", "auto")
    if head_dim == "auto":  # as FalconH1Config resolves it
        return mamba_intermediate(hf_config) // hf_config.mamba_n_heads
    return int(head_dim)


def multipliers(hf_config: Any, name: str, count: int) -> list[float]:
    values = getattr(hf_config, name, None)
    values = [1.0] * count if values is None else [float(v) for v in values]
    if len(values) != count:
        raise ValueError(f"{name} must hold {count} numbers, got {values}")
    return values


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    inter, heads = mamba_intermediate(hf_config), hf_config.mamba_n_heads
    if heads * mamba_head_dim(hf_config) != inter:
        raise ValueError(f"mamba_n_heads ({heads}) * mamba_d_head "
                         f"({mamba_head_dim(hf_config)}) must equal the mixer's width "
                         f"mamba_d_ssm (or mamba_expand * hidden_size): {inter}")
    multipliers(hf_config, "ssm_multipliers", 5)
    multipliers(hf_config, "mlp_multipliers", 2)
    time_step_limit(hf_config)  # (refuses a bad one)


def falcon_layout(hf_config: Any) -> HybridLayout:
    head_dim = head_dim_of(hf_config)
    return HybridLayout(attention_layers=frozenset(range(hf_config.num_hidden_layers)),
                        rotary_dim=head_dim, attention_scale=head_dim ** -0.5,
                        embedding_multiplier=float(getattr(hf_config, "embedding_multiplier",
                                                           1.0)))


def gate_mode(hf_config: Any) -> str:
    if not getattr(hf_config, "mamba_rms_norm", False):
        return GATE_ONLY
    return NORM_THEN_GATE if getattr(hf_config, "mamba_norm_before_gate", True) \
        else GATE_THEN_NORM


def make_mixer(hf_config: Any, tp_group: TensorParallelGroup) -> MambaMixer:
    """Bamba's mixer with FalconH1's width, out_proj bias, gate and multipliers."""
    return bamba.make_mixer(
        hf_config, tp_group, head_dim=mamba_head_dim(hf_config),
        out_proj_bias=bool(getattr(hf_config, "projectors_bias", False)),
        gate=gate_mode(hf_config),
        in_proj_multipliers=multipliers(hf_config, "ssm_multipliers", 5))


class FalconH1MLP(LlamaMLP):
    """down(up(x) * silu(gate(x) * gate_multiplier)) * down_multiplier; without
    multipliers, Llama's MLP and its fused kernels."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__(hf_config.hidden_size, hf_config.intermediate_size,
                         bool(getattr(hf_config, "mlp_bias", False)), tp_group)
        self.gate_multiplier, self.down_multiplier = multipliers(hf_config, "mlp_multipliers", 2)

    def forward(self, x: torch.Tensor, defer_merge: bool = False) -> torch.Tensor:
        if self.gate_multiplier == 1.0 and self.down_multiplier == 1.0:
            return super().forward(x, defer_merge)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(up * F.silu(gate * self.gate_multiplier))
        return out * self.down_multiplier if self.down_multiplier != 1.0 else out


def falcon_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                        ) -> nn.Module:
    return FalconH1MLP(hf_config, tp_group)


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, layout: HybridLayout,
                 feed_forward: FeedForwardFactory, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.mamba = make_mixer(hf_config, tp_group)
        self.self_attn = BambaAttention(
            hf_config, layout, tp_group,
            key_multiplier=float(getattr(hf_config, "key_multiplier", 1.0)))
        self.feed_forward = feed_forward(hf_config, layer_idx, tp_group)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.pre_ff_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.ssm_in = float(getattr(hf_config, "ssm_in_multiplier", 1.0))
        self.ssm_out = float(getattr(hf_config, "ssm_out_multiplier", 1.0))
        self.attention_in = float(getattr(hf_config, "attention_in_multiplier", 1.0))
        self.attention_out = float(getattr(hf_config, "attention_out_multiplier", 1.0))

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm, the mixer and attention side by side; the residual is carried
        separately (the next norm adds this layer's output)."""
        hidden_states, residual = self.input_layernorm.pre_norm(hidden_states, residual)
        mixed = _scaled(self.mamba(_scaled(hidden_states, self.ssm_in)), self.ssm_out)
        attended = _scaled(self.self_attn(_scaled(hidden_states, self.attention_in), cos, sin),
                           self.attention_out)
        hidden_states, residual = self.pre_ff_layernorm(mixed + attended, residual)
        return self.feed_forward(hidden_states), residual


def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1.0 else x * factor


class FalconH1ForCausalLM(BambaForCausalLM):
    check_config = staticmethod(check_supported_config)
    layout = staticmethod(falcon_layout)
    feed_forward = staticmethod(falcon_feed_forward)
    decoder_layer = FalconH1DecoderLayer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lm_head_multiplier = float(getattr(self.config, "lm_head_multiplier", 1.0))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _scaled(super().compute_logits(hidden_states), self.lm_head_multiplier)
