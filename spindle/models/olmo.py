"""OlmoForCausalLM (AI2's first OLMo: OLMo-1B-hf, OLMo-7B-hf and their 0424 / 0724
updates): Llama's attention and gated SiLU MLP without biases, LayerNorms without any
weight or bias (computed in float32, epsilon 1e-5), and q, k and v clamped to
[-clip_qkv, clip_qkv] where the config sets ``clip_qkv``. (OLMo 2 and 3 are
models/olmo_hybrid.py's.)"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.models.causal_lm import DecoderForCausalLM, RotaryDecoderModel
from spindle.models.gpt_neox import PartialRotaryAttention, PreNormRotaryLayer
from spindle.models.llama import LlamaMLP, head_dim_of, require_activation

EPS = 1e-5  # transformers' OlmoLayerNorm, whatever the config says


class WeightlessLayerNorm(nn.Module):
    """LayerNorm with no weight or bias, in float32 and back (OLMo's)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.shape, None, None, EPS).to(x.dtype)


class OlmoLayer(PreNormRotaryLayer):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.input_layernorm = WeightlessLayerNorm(hf_config.hidden_size)
        self.self_attn = PartialRotaryAttention(hf_config, tp_group,
                                                hf_config.num_key_value_heads, bias=bias,
                                                clip_qkv=getattr(hf_config, "clip_qkv", None))
        self.post_attention_layernorm = WeightlessLayerNorm(hf_config.hidden_size)
        self.mlp = LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, False, tp_group)


class OlmoForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        require_activation(hf_config, "silu")
        self.build_single_stage(hf_config, tp_group, stage, lambda config, group: (
            RotaryDecoderModel(config, group, lambda i: OlmoLayer(config, group),
                               WeightlessLayerNorm(config.hidden_size),
                               head_dim=head_dim_of(config), with_positions=False)))
