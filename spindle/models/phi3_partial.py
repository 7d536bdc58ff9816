"""Phi-3's layers with a rotary over the first ``partial_rotary_factor`` of each head
(Phi-4-mini: 0.75 of 128 features, LongRoPE tables over those 96): RMSNorms, grouped-
query attention without biases, Llama's SiLU MLP, each layer's window as Mistral's, the
rotation done in torch on every device (gpt_neox.PartialRotaryAttention over the
table of the rotated features), since Llama's fused kernels rotate whole heads."""

from __future__ import annotations

from typing import Any

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.norm import RMSNorm
from spindle.models.causal_lm import RotaryDecoderModel
from spindle.models.gpt_neox import (PartialRotaryAttention, PreNormRotaryLayer,
                                     check_rotary_dim, partial_rotary_table, rotary_dim)
from spindle.models.llama import LlamaMLP, head_dim_of


def rotates_part_of_each_head(hf_config: Any) -> bool:
    return rotary_dim(hf_config) != head_dim_of(hf_config)


class Phi3PartialRotaryLayer(PreNormRotaryLayer):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 sliding_window: int | None) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.self_attn = PartialRotaryAttention(hf_config, tp_group,
                                                hf_config.num_key_value_heads, bias=False,
                                                sliding_window=sliding_window)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.mlp = LlamaMLP(hidden, hf_config.intermediate_size, False, tp_group)


def phi3_partial_model(hf_config: Any, tp_group: TensorParallelGroup,
                       windows: list[int | None]) -> RotaryDecoderModel:
    """windows: each layer's sliding window (None: full attention)."""
    check_rotary_dim(hf_config)
    return RotaryDecoderModel(
        hf_config, tp_group, lambda i: Phi3PartialRotaryLayer(hf_config, tp_group, windows[i]),
        RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps),
        rotary=partial_rotary_table(hf_config), with_positions=False)
