"""StableLmForCausalLM (Stability AI's StableLM 2 1.6B and 3B / Zephyr): Llama's gated
SiLU MLP and grouped-query attention, but LayerNorms (weight and bias), a rotary over
the first ``partial_rotary_factor`` of each head (a quarter by default), q/k/v biases
when ``use_qkv_bias`` (none on o), and optionally GPT-NeoX's parallel residual layer
(``use_parallel_residual``: attention and the MLP both read the one input norm).

StableLM 2 12B's per-head q/k LayerNorms (``qk_layernorm``, a norm of its own for every
head) are refused by name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.models.causal_lm import DecoderForCausalLM
from spindle.models.gpt_neox import (PartialRotaryAttention, check_rotary_dim,
                                     layer_norm_rotary_model)
from spindle.models.llama import LlamaMLP, require_activation


class StableLmLayer(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps = hf_config.layer_norm_eps
        self.parallel_residual = bool(getattr(hf_config, "use_parallel_residual", False))
        self.input_layernorm = nn.LayerNorm(hf_config.hidden_size, eps=eps)
        self.self_attn = PartialRotaryAttention(
            hf_config, tp_group, hf_config.num_key_value_heads,
            bias=bool(getattr(hf_config, "use_qkv_bias", False)), o_bias=False)
        self.mlp = LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, False,
                            tp_group)
        self.post_attention_layernorm = (None if self.parallel_residual
                                         else nn.LayerNorm(hf_config.hidden_size, eps=eps))

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        attended = self.self_attn(normed, cos, sin)
        if self.parallel_residual:  # (summed in transformers' order)
            return hidden_states + attended + self.mlp(normed)
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class StableLmForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.build_single_stage(hf_config, tp_group, stage,
                                layer_norm_rotary_model(StableLmLayer))

    @staticmethod
    def check_config(hf_config: Any) -> None:
        require_activation(hf_config, "silu")
        check_rotary_dim(hf_config)
        if getattr(hf_config, "qk_layernorm", False):
            raise ValueError("StableLM's per-head q/k LayerNorms (qk_layernorm, StableLM 2 "
                             "12B) are not supported")
