"""JambaForCausalLM: AI21's Jamba, Mamba (version 1) layers with attention every
``attn_layer_period`` layers (at ``attn_layer_offset``), and mixtures of experts every
``expert_layer_period`` layers (at ``expert_layer_offset``).

Bamba's layout (models/bamba.py) with another mixer: the ``mamba`` layers are Mamba1
mixers (layers/mamba/mamba1_mixer.py: the selective scan, each state element with its
own decay, with Jamba's norms on dt, B and C). Attention has no positional encoding
at all (the Mamba layers carry the order). The experts take the top ``num_experts_per_tok``
of a softmax, their weights not renormalised, in the activation dtype; checkpoints name
the router ``feed_forward.router`` and keep the experts one by one (the hub's) or
stacked (transformers').
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.mamba.mamba1_mixer import jamba_mixer
from spindle.layers.moe import SparseMoeBlock
from spindle.models.bamba import (BambaDecoderLayer, BambaForCausalLM, HybridLayout,
                                  check_silu)
from spindle.models.llama import LlamaMLP, _to_param_name, head_dim_of
from spindle.models.moe import _QWEN_EXPERT_PARTS, _expert_param, stacked_experts_one_by_one


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    check_silu(hf_config)
    for name in ("attn_layer", "expert_layer"):
        period, offset = getattr(hf_config, f"{name}_period"), getattr(hf_config, f"{name}_offset")
        if not 0 <= offset < period:
            raise ValueError(f"{name}_offset ({offset}) must be in 0..{name}_period - 1 "
                             f"({period - 1})")


def jamba_layout(hf_config: Any) -> HybridLayout:
    every, at = hf_config.attn_layer_period, hf_config.attn_layer_offset
    return HybridLayout(
        attention_layers=frozenset(i for i in range(hf_config.num_hidden_layers)
                                   if i % every == at),
        rotary_dim=0, attention_scale=head_dim_of(hf_config) ** -0.5)


def jamba_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                       ) -> nn.Module:
    sparse = (hf_config.num_experts > 1 and layer_idx % hf_config.expert_layer_period
              == hf_config.expert_layer_offset)
    if not sparse:
        return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, False, tp_group)
    return SparseMoeBlock(hf_config.hidden_size, hf_config.num_experts,
                          hf_config.num_experts_per_tok, hf_config.intermediate_size,
                          normalize_top_k=False, weights_in_activation_dtype=True,
                          tp_group=tp_group)


class JambaDecoderLayer(BambaDecoderLayer):
    mixer_factory = staticmethod(jamba_mixer)


class JambaForCausalLM(BambaForCausalLM):
    check_config = staticmethod(check_supported_config)
    layout = staticmethod(jamba_layout)
    feed_forward = staticmethod(jamba_feed_forward)
    decoder_layer = JambaDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_router_as_gate(stacked_experts_one_by_one(
            weights, ".feed_forward.experts.", ("gate_proj", "up_proj", "down_proj"))))

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or _to_param_name(hf_name)


def _router_as_gate(weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """feed_forward.router.weight is the MoE block's gate here."""
    for name, tensor in weights:
        yield name.replace(".feed_forward.router.", ".feed_forward.gate."), tensor
