"""Starcoder2ForCausalLM (StarCoder2 3B / 7B / 15B): pre-norm layers with LayerNorms
(weight and bias), attention with biases (``use_bias``) within ``sliding_window`` on
every layer when the config sets one, and a plain MLP: c_proj(gelu_tanh(c_fc(x))), both
with biases. The rotation is Llama's (rotate-half), in torch on every device.

Jais2ForCausalLM (Inception's Jais 2) is the same layer shape: LayerNorms, attention
with biases (``attention_bias``), and NemotronH's gate-less relu^2 MLP (``mlp_bias``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.linear import ColumnParallelLinear, RowParallelLinear
from spindle.models.causal_lm import DecoderForCausalLM, RotaryDecoderModel
from spindle.models.llama import (AttentionOptions, LlamaAttention, check_activation,
                                  checked_window, head_dim_of, require_activation,
                                  ungated_param_name)

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu": F.gelu}


class Starcoder2MLP(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup, bias: bool | None = None,
                 act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """bias, act: where a family names them otherwise (default: ``use_bias`` and
        ``hidden_act``)."""
        super().__init__()
        bias = bool(getattr(hf_config, "use_bias", True)) if bias is None else bias
        self.c_fc = ColumnParallelLinear(hf_config.hidden_size, hf_config.intermediate_size,
                                         bias=bias, tp_group=tp_group)
        self.c_proj = RowParallelLinear(hf_config.intermediate_size, hf_config.hidden_size,
                                        bias=bias, tp_group=tp_group)
        self.act = act or ACTIVATIONS[hf_config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup, bias: bool, eps: float,
                 mlp: nn.Module) -> None:
        super().__init__()
        window = checked_window(getattr(hf_config, "sliding_window", None))
        self.input_layernorm = nn.LayerNorm(hf_config.hidden_size, eps=eps)
        self.self_attn = LlamaAttention(hf_config, AttentionOptions(bias, bias, False),
                                        tp_group, window)
        self.post_attention_layernorm = nn.LayerNorm(hf_config.hidden_size, eps=eps)
        self.mlp = mlp

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), positions, cos, sin)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Starcoder2ForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.build_single_stage(hf_config, tp_group, stage, self._model)

    # What Jais2ForCausalLM overrides: the activations known, whether attention has
    # biases and the LayerNorms' epsilon, and the MLP.
    @staticmethod
    def check_config(hf_config: Any) -> None:
        check_activation(hf_config, "hidden_act", ACTIVATIONS)

    @staticmethod
    def layer_options(hf_config: Any) -> tuple[bool, float]:
        return bool(getattr(hf_config, "use_bias", True)), hf_config.norm_epsilon

    @staticmethod
    def mlp(hf_config: Any, tp_group: TensorParallelGroup) -> nn.Module:
        return Starcoder2MLP(hf_config, tp_group)

    def _model(self, hf_config: Any, tp_group: TensorParallelGroup) -> RotaryDecoderModel:
        bias, eps = self.layer_options(hf_config)
        return RotaryDecoderModel(
            hf_config, tp_group, lambda i: Starcoder2DecoderLayer(
                hf_config, tp_group, bias, eps, self.mlp(hf_config, tp_group)),
            nn.LayerNorm(hf_config.hidden_size, eps=eps), head_dim_of(hf_config))


class Jais2ForCausalLM(Starcoder2ForCausalLM):
    @staticmethod
    def check_config(hf_config: Any) -> None:
        require_activation(hf_config, "relu2")

    @staticmethod
    def layer_options(hf_config: Any) -> tuple[bool, float]:
        return bool(getattr(hf_config, "attention_bias", True)), hf_config.layer_norm_eps

    @staticmethod
    def mlp(hf_config: Any, tp_group: TensorParallelGroup) -> nn.Module:
        from spindle.models.nemotron_h import NemotronHMLP

        return NemotronHMLP(hf_config, tp_group)

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        return ungated_param_name(hf_name)
