"""HunYuanDenseV1ForCausalLM (Tencent's Hunyuan dense models: Hunyuan-0.5B to 7B): Llama's
layers whose attention normalises each head of q and k (``query_layernorm`` /
``key_layernorm``) after the rotation, not before. Their rotary is "dynamic" with a
fixed ``alpha`` in the checkpoints, which only stretches the base: rope_theta times
alpha ** (head_dim / (head_dim - 2)), the same at every length (transformers' own
reading). Built on the hybrid base as an attention-only decoder. HunYuanMoEV1ForCausalLM
(Hunyuan-A13B): the same attention with routed experts and a shared MLP in every
layer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import apply_linear, default_weight_loader, set_weight_loader
from spindle.layers.moe import FusedExperts
from spindle.layers.rotary import rope_parameters_from_config
from spindle.models.bamba import (AttentionOnlyDecoder, BambaAttention, HybridLayout,
                                  PreNormAttentionLayer, attention_only_layout, check_silu)
from spindle.models.llama import LlamaMLP, head_dim_of

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


def _of_layer(value: Any, layer_idx: int) -> Any:
    """A config value given once or per layer (Hunyuan-MoE's num_experts, moe_topk)."""
    return value[layer_idx] if isinstance(value, (list, tuple)) else value


class HunYuanMoeRouter(nn.Module):
    """A float32 [E, H] linear on the float32 input (``gate.wg``), softmax, the top k
    weighed by their renormalised probabilities, kept in float32. Replicated."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"moe_topk ({top_k}) must be in 1..num_experts ({num_experts})")
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)
        self.batch_invariant = False  # set by enable_batch_invariance

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = apply_linear(x.float(), self.weight, invariant=self.batch_invariant)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)


class HunYuanMoeBlock(nn.Module):
    """Routed experts plus a shared SwiGLU MLP, all of intermediate_size (as
    transformers builds them), summed."""

    def __init__(self, hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        experts = _of_layer(hf_config.num_experts, layer_idx)
        self.tp_group = tp_group
        self.gate = HunYuanMoeRouter(hidden, experts, _of_layer(hf_config.moe_topk, layer_idx))
        self.experts = FusedExperts(experts, hidden, inter, tp_group)
        self.shared_mlp = LlamaMLP(hidden, inter, False, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        return self.tp_group.all_reduce(self.experts(x, ids, weights)) + self.shared_mlp(x)


class HunYuanMoEV1ForCausalLM(HunYuanDenseV1ForCausalLM):
    """Tencent's Hunyuan-A13B: the dense model's attention with HunYuanMoeBlock in every
    layer. Checkpoints name the router ``mlp.gate.wg`` and each expert's projections
    ``mlp.experts.E.{gate,up,down}_proj``."""

    @staticmethod
    def check_config(hf_config: Any) -> None:
        check_silu(hf_config)
        sizes = getattr(hf_config, "moe_intermediate_size", None)
        for size in sizes if isinstance(sizes, (list, tuple)) else [sizes]:
            if size is not None and size != hf_config.intermediate_size:
                raise ValueError(f"moe_intermediate_size {sizes} differs from intermediate_size "
                                 f"({hf_config.intermediate_size}); transformers builds the "
                                 "experts of intermediate_size, and so does spindle")

    @staticmethod
    def feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                     ) -> nn.Module:
        return HunYuanMoeBlock(hf_config, layer_idx, tp_group)

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        from spindle.models.moe import _QWEN_EXPERT_PARTS, _expert_param

        hf_name = hf_name.replace(".mlp.gate.wg.", ".mlp.gate.")
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or super().param_name(hf_name)
