"""HunYuanDenseV1ForCausalLM (Tencent's Hunyuan dense models: Hunyuan-0.5B to 7B): Llama's
layers whose attention normalises each head of q and k (``query_layernorm`` /
``key_layernorm``) after the rotation, not before. Their rotary is "dynamic" with a
fixed ``alpha`` in the checkpoints, which only stretches the base: rope_theta times
alpha ** (head_dim / (head_dim - 2)), the same at every length (transformers' own
reading). Built on the hybrid base as an attention-only decoder."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.rotary import rope_parameters_from_config
from spindle.models.bamba import (AttentionOnlyDecoder, BambaAttention, HybridLayout,
                                  PreNormAttentionLayer, attention_only_layout)
from spindle.models.llama import head_dim_of

ALL_LAYERS = "all"


def hunyuan_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's rope parameters, a fixed NTK alpha folded into the base."""
    params = dict(rope_parameters_from_config(hf_config))
    if params.get("rope_type") == "dynamic" and params.get("alpha"):
        head_dim = head_dim_of(hf_config)
        theta = float(params["rope_theta"]) * float(params["alpha"]) ** (head_dim / (head_dim - 2))
        params = {"rope_type": "default", "rope_theta": theta}
    return params


def hunyuan_layout(hf_config: Any) -> HybridLayout:
    layout = attention_only_layout(hf_config, head_dim_of(hf_config))
    return replace(layout, rope_layer_types=(ALL_LAYERS,) * hf_config.num_hidden_layers,
                   rope_parameters_of={ALL_LAYERS: hunyuan_rope_parameters(hf_config)})


class HunYuanDecoderLayer(PreNormAttentionLayer):
    @staticmethod
    def make_attention(hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        return BambaAttention(hf_config, layout, tp_group, qk_norm_eps=hf_config.rms_norm_eps,
                              norm_after_rotary=True)


class HunYuanDenseV1ForCausalLM(AttentionOnlyDecoder):
    layout = staticmethod(hunyuan_layout)
    decoder_layer = HunYuanDecoderLayer

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        hf_name = hf_name.replace(".self_attn.query_layernorm.", ".self_attn.q_norm.")
        hf_name = hf_name.replace(".self_attn.key_layernorm.", ".self_attn.k_norm.")
        return super().param_name(hf_name)
