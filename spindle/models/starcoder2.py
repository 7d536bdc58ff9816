"""Starcoder2ForCausalLM (StarCoder2 3B / 7B / 15B): pre-norm layers with LayerNorms
(weight and bias), attention with biases (``use_bias``) within ``sliding_window`` on
every layer when the config sets one, and a plain MLP: c_proj(gelu_tanh(c_fc(x))), both
with biases. The rotation is Llama's (rotate-half), in torch on every device."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.linear import ColumnParallelLinear, RowParallelLinear
from spindle.models.causal_lm import DecoderForCausalLM, RotaryDecoderModel
from spindle.models.llama import (AttentionOptions, LlamaAttention, _to_param_name,
                                  checked_window, head_dim_of)
from spindle.models.weights import load_named_weights, not_on_this_rank

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu": F.gelu}


class Starcoder2MLP(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        bias = bool(getattr(hf_config, "use_bias", True))
        self.c_fc = ColumnParallelLinear(hf_config.hidden_size, hf_config.intermediate_size,
                                         bias=bias, tp_group=tp_group)
        self.c_proj = RowParallelLinear(hf_config.intermediate_size, hf_config.hidden_size,
                                        bias=bias, tp_group=tp_group)
        self.act = ACTIVATIONS[hf_config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        bias = bool(getattr(hf_config, "use_bias", True))
        eps = hf_config.norm_epsilon
        window = checked_window(getattr(hf_config, "sliding_window", None))
        self.input_layernorm = nn.LayerNorm(hf_config.hidden_size, eps=eps)
        self.self_attn = LlamaAttention(hf_config, AttentionOptions(bias, bias, False),
                                        tp_group, window)
        self.post_attention_layernorm = nn.LayerNorm(hf_config.hidden_size, eps=eps)
        self.mlp = Starcoder2MLP(hf_config, tp_group)

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
        if hf_config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (known: "
                             f"{sorted(ACTIVATIONS)})")
        self.build_single_stage(hf_config, tp_group, stage, lambda c, tp: RotaryDecoderModel(
            c, tp, lambda i: Starcoder2DecoderLayer(c, tp),
            nn.LayerNorm(c.hidden_size, eps=c.norm_epsilon), head_dim_of(c)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, self._param_name)

    def _param_name(self, hf_name: str) -> tuple[str, Any] | None:
        return None if not_on_this_rank(self, hf_name) else _to_param_name(hf_name)
