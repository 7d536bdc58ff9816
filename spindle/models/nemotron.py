"""NemotronForCausalLM (NVIDIA's Nemotron-4 and the Minitron / Nemotron-Mini models pruned
from it): LayerNorms whose weight is stored minus one ("1P": the norm multiplies by
weight + 1), grouped-query attention rotating the first ``partial_rotary_factor`` of
each head (half by default) the rotate-half way, and a squared-ReLU MLP without a gate
(``up_proj``, ``down_proj``); biases where ``attention_bias`` and ``mlp_bias`` say."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.models.causal_lm import DecoderForCausalLM, RotaryDecoderModel
from spindle.models.gpt_neox import (PartialRotaryAttention, PreNormRotaryLayer,
                                     check_rotary_dim, partial_rotary_table)
from spindle.models.llama import require_activation, ungated_param_name
from spindle.models.nemotron_h import NemotronHMLP


class LayerNorm1P(nn.LayerNorm):
    """nn.LayerNorm multiplying by weight + 1 (the checkpoint holds weight - 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


class NemotronLayer(PreNormRotaryLayer):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.norm_eps
        self.input_layernorm = LayerNorm1P(hidden, eps=eps)
        self.self_attn = PartialRotaryAttention(
            hf_config, tp_group, hf_config.num_key_value_heads,
            bias=bool(getattr(hf_config, "attention_bias", False)))
        self.post_attention_layernorm = LayerNorm1P(hidden, eps=eps)
        self.mlp = NemotronHMLP(hf_config, tp_group)


class NemotronForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        require_activation(hf_config, "relu2")
        check_rotary_dim(hf_config)
        self.build_single_stage(hf_config, tp_group, stage, lambda config, group: (
            RotaryDecoderModel(config, group, lambda i: NemotronLayer(config, group),
                               LayerNorm1P(config.hidden_size, eps=config.norm_eps),
                               rotary=partial_rotary_table(config), with_positions=False)))

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        return ungated_param_name(hf_name)
