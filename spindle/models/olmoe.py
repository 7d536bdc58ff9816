"""OlmoeForCausalLM (OLMoE): pre-norm layers whose attention normalises q and k over
their whole width (OLMo's WholeWidthRMSNorm, Llama's rounding) and may clamp q, k and v
(``clip_qkv``), and a mixture of experts in every layer routed as Qwen3-MoE's (softmax,
top-k, renormalised where norm_topk_prob, the weights in the activation dtype). Built on
the hybrid base as an attention-only decoder, like GLM-4.5."""

from __future__ import annotations

from typing import Any

from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.moe import SparseMoeBlock
from spindle.models.bamba import (AttentionOnlyDecoder, HybridLayout, PreNormAttentionLayer,
                                  attention_only_layout)
from spindle.models.llama import _to_param_name, head_dim_of
from spindle.models.moe import _QWEN_EXPERT_PARTS, _expert_param
from spindle.models.olmo_hybrid import OlmoAttention


def olmoe_layout(hf_config: Any) -> HybridLayout:
    return attention_only_layout(hf_config, head_dim_of(hf_config))


def olmoe_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                       ) -> nn.Module:
    return SparseMoeBlock(hf_config.hidden_size, hf_config.num_experts,
                          hf_config.num_experts_per_tok, hf_config.intermediate_size,
                          normalize_top_k=bool(getattr(hf_config, "norm_topk_prob", False)),
                          weights_in_activation_dtype=True, tp_group=tp_group)


class OlmoeDecoderLayer(PreNormAttentionLayer):
    @staticmethod
    def make_attention(hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        return OlmoAttention(hf_config, layout, tp_group, float_weight_norms=False,
                             clip_qkv=getattr(hf_config, "clip_qkv", None))


class OlmoeForCausalLM(AttentionOnlyDecoder):
    layout = staticmethod(olmoe_layout)
    feed_forward = staticmethod(olmoe_feed_forward)
    decoder_layer = OlmoeDecoderLayer

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or _to_param_name(hf_name)
