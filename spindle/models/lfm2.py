"""Lfm2ForCausalLM: Liquid AI's LFM2, gated short convolutions with a few attention
layers among them (``layer_types``: ``conv`` / ``full_attention``); Lfm2MoeForCausalLM,
the same with mixtures of experts after the first ``num_dense_layers`` layers.

Bamba's layout (models/bamba.py) with other mixers: a ``conv`` layer is a gated
short convolution (layers/mamba/short_conv.py: its state per sequence is the last
``conv_L_cache`` - 1 inputs), an attention layer normalises each head of q and k
(``q_layernorm`` / ``k_layernorm``) before rotating whole heads. Every layer is
pre-norm (``operator_norm``, ``ffn_norm``) with a SwiGLU MLP (``w1``, ``w3``, ``w2``)
whose width LFM2 derives from ``intermediate_size`` (``block_auto_adjust_ff_dim``);
the final norm is ``embedding_norm``, and the head is tied by default.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import apply_linear, default_weight_loader, set_weight_loader
from spindle.layers.mamba.short_conv import ShortConv
from spindle.layers.moe import FusedExperts, Router
from spindle.layers.norm import RMSNorm
from spindle.models.bamba import (BambaAttention, BambaForCausalLM, FeedForwardFactory,
                                  HybridLayout, check_layer_types)
from spindle.models.llama import LlamaMLP, _to_param_name, head_dim_of
from spindle.models.moe import (_MIXTRAL_EXPERT_PARTS, _expert_param,
                                stacked_experts_one_by_one)

ATTENTION, CONV = "full_attention", "conv"


def layer_types(hf_config: Any) -> list[str]:
    kinds = getattr(hf_config, "layer_types", None)
    if kinds is None:  # (older configs: the attention layers by index)
        attention = set(getattr(hf_config, "full_attn_idxs", None)
                        or range(hf_config.num_hidden_layers))
        kinds = [ATTENTION if i in attention else CONV
                 for i in range(hf_config.num_hidden_layers)]
    return list(kinds)


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    check_layer_types(layer_types(hf_config), hf_config.num_hidden_layers, {ATTENTION, CONV})


def mlp_width(hf_config: Any) -> int:
    """The SwiGLU width, as LFM2 derives it from intermediate_size."""
    width = hf_config.intermediate_size
    if getattr(hf_config, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        multiplier = getattr(hf_config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            multiple = hf_config.block_multiple_of
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    return width


def lfm2_layout(hf_config: Any) -> HybridLayout:
    head_dim = head_dim_of(hf_config)
    return HybridLayout(
        attention_layers=frozenset(i for i, kind in enumerate(layer_types(hf_config))
                                   if kind == ATTENTION),
        rotary_dim=head_dim, attention_scale=head_dim ** -0.5, norm_eps=hf_config.norm_eps)


def lfm2_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                      ) -> nn.Module:
    return LlamaMLP(hf_config.hidden_size, mlp_width(hf_config), False, tp_group)


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, layout: HybridLayout,
                 feed_forward: FeedForwardFactory, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps = hf_config.norm_eps
        self.is_attention = layer_idx in layout.attention_layers
        if self.is_attention:
            self.self_attn = BambaAttention(hf_config, layout, tp_group, qk_norm_eps=eps)
        else:
            self.conv = ShortConv(hf_config.hidden_size, hf_config.conv_L_cache,
                                  bool(getattr(hf_config, "conv_bias", False)), tp_group)
        self.feed_forward = feed_forward(hf_config, layer_idx, tp_group)
        self.operator_norm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.ffn_norm = RMSNorm(hf_config.hidden_size, eps=eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block, residual carried separately (the next norm adds it)."""
        hidden_states, residual = self.operator_norm.pre_norm(hidden_states, residual)
        if self.is_attention:
            hidden_states = self.self_attn(hidden_states, cos, sin)
        else:
            hidden_states = self.conv(hidden_states)
        hidden_states, residual = self.ffn_norm(hidden_states, residual)
        return self.feed_forward(hidden_states), residual


# The checkpoint's names of what this model names otherwise (the rest are the same).
_RENAMES = ((".self_attn.q_layernorm.", ".self_attn.q_norm."),
            (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            (".self_attn.out_proj.", ".self_attn.o_proj."),
            (".feed_forward.w1.", ".feed_forward.gate_proj."),
            (".feed_forward.w3.", ".feed_forward.up_proj."),
            (".feed_forward.w2.", ".feed_forward.down_proj."))


class Lfm2ForCausalLM(BambaForCausalLM):
    checkpoint_final_norm = "embedding_norm"
    check_config = staticmethod(check_supported_config)
    layout = staticmethod(lfm2_layout)
    feed_forward = staticmethod(lfm2_feed_forward)
    decoder_layer = Lfm2DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_in_our_names(weights))


def _in_our_names(weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for theirs, ours in _RENAMES:
            if theirs in name:
                name = name.replace(theirs, ours)
                break
        yield name, tensor


class Lfm2MoeBlock(nn.Module):
    """LFM2-MoE's experts: sigmoid scores of the router's logits (in the model's dtype);
    the choice adds ``expert_bias`` (float32) where ``use_expert_bias``; the chosen
    experts weigh by their scores, renormalised (+1e-6) where ``norm_topk_prob``, times
    ``routed_scaling_factor``. SwiGLU experts (FusedExperts; the fused kernels on CUDA).
    Checkpoint names: the hub's experts one by one (``experts.E.w1/w3/w2``), or
    transformers' stacked ``experts.gate_up_proj`` / ``down_proj``."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        experts, self.top_k = hf_config.num_experts, hf_config.num_experts_per_tok
        if not 1 <= self.top_k <= experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in 1..num_experts "
                             f"({experts})")
        self.normalize = bool(getattr(hf_config, "norm_topk_prob", True))
        self.scaling = float(getattr(hf_config, "routed_scaling_factor", 1.0))
        self.tp_group = tp_group
        self.gate = Router(experts, hf_config.hidden_size)
        self.expert_bias = None
        if getattr(hf_config, "use_expert_bias", True):
            self.expert_bias = nn.Parameter(torch.empty(experts, dtype=torch.float32),
                                            requires_grad=False)
            set_weight_loader(self.expert_bias, default_weight_loader)
        self.experts = FusedExperts(experts, hf_config.hidden_size,
                                    hf_config.moe_intermediate_size, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(apply_linear(x, self.gate.weight))
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return self.tp_group.all_reduce(self.experts(x, ids, weights * self.scaling))


def lfm2_moe_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                          ) -> nn.Module:
    if layer_idx < hf_config.num_dense_layers:  # (its width as given: no LFM2 rule here)
        return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, False, tp_group)
    return Lfm2MoeBlock(hf_config, tp_group)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    feed_forward = staticmethod(lfm2_moe_feed_forward)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(experts_one_by_one(weights))

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        """The hub's experts.E.w1 / w3 / w2 (gate, up, down) onto the stacked experts."""
        return _expert_param(hf_name, _MIXTRAL_EXPERT_PARTS) or _to_param_name(hf_name)


def experts_one_by_one(weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' stacked experts as the hub's per-expert tensors; the rest as is."""
    return stacked_experts_one_by_one(weights, ".feed_forward.experts.", ("w1", "w3", "w2"))
