"""MiniMaxM2ForCausalLM: MiniMax-M2, a mixture-of-experts decoder.

Every layer is pre-norm (Llama's RMSNorm) with attention whose q and k are normalised
over their whole width (models/olmo_hybrid.OlmoAttention, the weight after the cast)
and rotated on a part of each head (``partial_rotary_factor``; the released configs say
``rotary_dim``, which transformers turns into it), then experts: sigmoid scores in
float32, the choice by score plus ``e_score_correction_bias``, the chosen scores
renormalised (float32 weights). Built on the hybrid base (models/bamba.py) as an
attention-only decoder. Checkpoint names: the hub's ``block_sparse_moe`` with experts
one by one (``w1``, ``w3``, ``w2``: gate, up, down), or transformers' ``mlp`` with
experts stacked.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import apply_linear, default_weight_loader, set_weight_loader
from spindle.layers.moe import FusedExperts, Router
from spindle.models.bamba import (AttentionOnlyDecoder, HybridLayout, PreNormAttentionLayer,
                                  attention_only_layout)
from spindle.models.llama import _to_param_name, head_dim_of
from spindle.models.moe import _MIXTRAL_EXPERT_PARTS, _expert_param, stacked_experts_one_by_one
from spindle.models.olmo_hybrid import OlmoAttention


def minimax_m2_layout(hf_config: Any) -> HybridLayout:
    factor = (getattr(hf_config, "rope_parameters", None) or {}).get("partial_rotary_factor",
                                                                     1.0)
    return attention_only_layout(hf_config, int(head_dim_of(hf_config) * factor))


class CorrectedSigmoidMoeBlock(nn.Module):
    """Experts chosen by sigmoid score plus a per-expert correction bias; weighted by
    their scores renormalised over the chosen ones, in float32."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        experts, self.top_k = hf_config.num_local_experts, hf_config.num_experts_per_tok
        if not 1 <= self.top_k <= experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in 1..num_local_experts "
                             f"({experts})")
        self.tp_group = tp_group
        self.gate = Router(experts, hf_config.hidden_size)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32),
                                                    requires_grad=False)
        set_weight_loader(self.e_score_correction_bias, default_weight_loader)
        self.experts = FusedExperts(experts, hf_config.hidden_size, hf_config.intermediate_size,
                                    tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(apply_linear(x, self.gate.weight).float())
        ids = (scores + self.e_score_correction_bias).topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.tp_group.all_reduce(self.experts(x, ids, weights))


def minimax_m2_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                            ) -> nn.Module:
    return CorrectedSigmoidMoeBlock(hf_config, tp_group)


class MiniMaxM2DecoderLayer(PreNormAttentionLayer):
    @staticmethod
    def make_attention(hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        return OlmoAttention(hf_config, layout, tp_group, float_weight_norms=False)


class MiniMaxM2ForCausalLM(AttentionOnlyDecoder):
    layout = staticmethod(minimax_m2_layout)
    feed_forward = staticmethod(minimax_m2_feed_forward)
    decoder_layer = MiniMaxM2DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(stacked_experts_one_by_one(
            _in_our_names(weights), ".mlp.experts.", ("w1", "w3", "w2")))

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        return _expert_param(hf_name, _MIXTRAL_EXPERT_PARTS) or _to_param_name(hf_name)


def _in_our_names(weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The hub's block_sparse_moe as mlp."""
    for name, tensor in weights:
        yield name.replace(".block_sparse_moe.", ".mlp."), tensor
