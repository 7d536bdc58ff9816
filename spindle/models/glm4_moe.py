"""Glm4MoeForCausalLM: Zhipu's GLM-4.5 / GLM-4.6 mixture-of-experts decoders.

Every layer is pre-norm (Llama's RMSNorm) with grouped-query attention (biases on q, k
and v but not on o; per-head q/k norms where ``use_qk_norm``; the first
``partial_rotary_factor`` of each head rotated), then a dense SwiGLU MLP for the first
``first_k_dense_replace`` layers and, after them, experts routed as DeepSeek-V3 routes
(nemotron_h.NemotronHRouter: float32 sigmoid scores, a correction bias for the choice,
the best ``topk_group`` of ``n_group`` groups, renormalised and scaled) plus
``n_shared_experts`` shared experts as one MLP. Built on the hybrid base (models/bamba.py)
as an attention-only decoder. The checkpoint's multi-token-prediction layers (indices
from ``num_hidden_layers`` on) are not loaded.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.moe import FusedExperts
from spindle.models.bamba import (AttentionOnlyDecoder, BambaAttention, HybridLayout,
                                  PreNormAttentionLayer, attention_only_layout, rotary_dim)
from spindle.models.llama import LlamaMLP, _to_param_name
from spindle.models.moe import _QWEN_EXPERT_PARTS, _expert_param
from spindle.models.nemotron_h import NemotronHRouter


def glm4_moe_layout(hf_config: Any) -> HybridLayout:
    return attention_only_layout(hf_config, rotary_dim(hf_config))


class Glm4MoeBlock(nn.Module):
    """Routed experts (the router's float32 weights) plus the shared experts. router:
    the module that picks and weighs each token's experts (DeepSeek-V3's by default;
    DeepSeek-V2's in models/deepseek_v3.py)."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 router: Callable[[Any], nn.Module] = NemotronHRouter) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.gate = router(hf_config)
        self.experts = FusedExperts(hf_config.n_routed_experts, hf_config.hidden_size,
                                    hf_config.moe_intermediate_size, tp_group)
        self.shared_experts = LlamaMLP(
            hf_config.hidden_size, hf_config.moe_intermediate_size * hf_config.n_shared_experts,
            bool(getattr(hf_config, "mlp_bias", False)), tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        return self.tp_group.all_reduce(self.experts(x, ids, weights)) + self.shared_experts(x)


def glm4_moe_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup,
                          router: Callable[[Any], nn.Module] = NemotronHRouter) -> nn.Module:
    """A dense MLP in the first first_k_dense_replace layers, experts after them."""
    if layer_idx < (getattr(hf_config, "first_k_dense_replace", 0) or 0):
        return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size,
                        bool(getattr(hf_config, "mlp_bias", False)), tp_group)
    return Glm4MoeBlock(hf_config, tp_group, router)


class Glm4MoeDecoderLayer(PreNormAttentionLayer):
    @staticmethod
    def make_attention(hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        """q/k/v biases without one on o; per-head q/k norms where use_qk_norm."""
        qk_norm = hf_config.rms_norm_eps if getattr(hf_config, "use_qk_norm", False) else None
        return BambaAttention(hf_config, layout, tp_group, o_bias=False, qk_norm_eps=qk_norm)


class Glm4MoeForCausalLM(AttentionOnlyDecoder):
    layout = staticmethod(glm4_moe_layout)
    feed_forward = staticmethod(glm4_moe_feed_forward)
    decoder_layer = Glm4MoeDecoderLayer

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or _to_param_name(hf_name)

    def _skip_checkpoint_tensor(self, hf_name: str) -> bool:
        return _mtp_layer(hf_name, self.config.num_hidden_layers) or \
            super()._skip_checkpoint_tensor(hf_name)


def _mtp_layer(hf_name: str, num_layers: int) -> bool:
    """model.layers.N.* with N >= num_layers: a multi-token-prediction layer."""
    parts = hf_name.split(".")
    return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= num_layers)
