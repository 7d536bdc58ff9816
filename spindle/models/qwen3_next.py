"""Qwen3NextForCausalLM: Gated DeltaNet layers (``linear_attention``) with gated
attention every few layers (``full_attention``), and mixtures of experts with a shared
expert.

Bamba's layout (models/bamba.py) with other pieces:
- the ``linear_attn`` mixer is a Gated DeltaNet (layers/mamba/gated_delta_net.py): a
  conv state and a float32 recurrent state per sequence, in the state slots;
- attention normalises each head of q and k, rotates the first
  ``partial_rotary_factor`` of each head (a quarter by default), and multiplies its
  output by a sigmoid gate that q_proj computes beside q (checkpoints interleave the
  two per head: [q | gate] of head 0, then head 1, ...);
- every RMSNorm is Gemma's (a weight offset from one; the gated norm of the linear
  layers excepted);
- the MLP of layer i is sparse unless i is in ``mlp_only_layers`` or
  (i + 1) % ``decoder_sparse_step`` != 0: softmax routing to ``num_experts_per_tok`` of
  ``num_experts`` experts (renormalised where ``norm_topk_prob``), plus a shared expert
  scaled by sigmoid(``shared_expert_gate``).
The checkpoint's multi-token-prediction head (``mtp.*``) is not loaded.

Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM (Qwen3.5's text models) are the same
layers with the linear attention's input projections stored apart (``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``: gated_delta_net.SPLIT), a dense MLP in
every layer (Qwen3.5) or experts in every layer, always renormalised (Qwen3.5-MoE),
whose checkpoints may stack them (``experts.gate_up_proj``, ``experts.down_proj``).
Their rotary embedding is multimodal (``mrope_section``), which for text, whose three
position components are equal, is the plain rotary embedding.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import apply_linear, default_weight_loader, set_weight_loader
from spindle.layers.mamba.gated_delta_net import (INTERLEAVED, SPLIT, SPLIT_PROJECTIONS,
                                                   gated_delta_net, projection_param)
from spindle.layers.moe import SparseMoeBlock
from spindle.layers.norm import GemmaRMSNorm
from spindle.models.bamba import (BambaAttention, BambaForCausalLM, HybridLayout,
                                  PreNormHybridLayer, check_layer_types, check_silu,
                                  rotary_dim)
from spindle.models.llama import LlamaMLP, _to_param_name, head_dim_of
from spindle.models.moe import _QWEN_EXPERT_PARTS, _expert_param, stacked_experts_one_by_one

ATTENTION, LINEAR = "full_attention", "linear_attention"


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    check_silu(hf_config)
    check_layer_types(list(hf_config.layer_types), hf_config.num_hidden_layers,
                      {ATTENTION, LINEAR})


def qwen3_next_layout(hf_config: Any) -> HybridLayout:
    return HybridLayout(
        attention_layers=frozenset(i for i, kind in enumerate(hf_config.layer_types)
                                   if kind == ATTENTION),
        rotary_dim=rotary_dim(hf_config), attention_scale=head_dim_of(hf_config) ** -0.5,
        norm_class=GemmaRMSNorm)


class SharedExpertMoeBlock(nn.Module):
    """Qwen3-MoE's routed experts plus a shared expert (a SwiGLU MLP) that every token
    takes, weighted by sigmoid(shared_expert_gate(x)), one logit per token."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.routed = SparseMoeBlock(
            hf_config.hidden_size, hf_config.num_experts, hf_config.num_experts_per_tok,
            hf_config.moe_intermediate_size,
            normalize_top_k=bool(getattr(hf_config, "norm_topk_prob", True)),
            weights_in_activation_dtype=True, tp_group=tp_group)
        self.shared_expert = LlamaMLP(hf_config.hidden_size,
                                      hf_config.shared_expert_intermediate_size, False,
                                      tp_group)
        self.shared_expert_gate = nn.Parameter(torch.empty(1, hf_config.hidden_size),
                                               requires_grad=False)
        set_weight_loader(self.shared_expert_gate, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(apply_linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return self.routed(x) + shared


def qwen3_next_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                            ) -> nn.Module:
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    sparse = (layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
              and hf_config.num_experts > 0 and (layer_idx + 1) % step == 0)
    return (sparse_feed_forward if sparse else dense_feed_forward)(hf_config, layer_idx,
                                                                    tp_group)


def dense_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                       ) -> nn.Module:
    return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, False, tp_group)


def sparse_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                        ) -> nn.Module:
    return SharedExpertMoeBlock(hf_config, tp_group)


class Qwen3NextDecoderLayer(PreNormHybridLayer):
    norm_class = GemmaRMSNorm
    projections = INTERLEAVED  # the linear attention's checkpoint layout

    def make_attention(self, hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        return BambaAttention(hf_config, layout, tp_group, qk_norm_eps=hf_config.rms_norm_eps,
                              output_gate=True)

    def make_linear(self, hf_config: Any, tp_group: TensorParallelGroup) -> nn.Module:
        return gated_delta_net(hf_config, tp_group, self.projections)


class Qwen3NextForCausalLM(BambaForCausalLM):
    checkpoint_final_norm = "norm"
    check_config = staticmethod(check_supported_config)
    layout = staticmethod(qwen3_next_layout)
    feed_forward = staticmethod(qwen3_next_feed_forward)
    decoder_layer = Qwen3NextDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_in_our_names(weights, head_dim_of(self.config)))

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or _to_param_name(hf_name)

    def _skip_checkpoint_tensor(self, hf_name: str) -> bool:
        return hf_name.startswith("mtp.") or super()._skip_checkpoint_tensor(hf_name)


def _in_our_names(weights: Iterable[tuple[str, torch.Tensor]], head_dim: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's names and layout mapped onto this model's: q_proj's rows taken
    apart into q and the output gate, the routed experts and the shared gate under the
    MoE block's own names."""
    for name, tensor in weights:
        if ".self_attn.q_proj." in name:
            per_head = tensor.unflatten(0, (-1, 2, head_dim))  # [heads, (q, gate), D, ...]
            yield name, per_head[:, 0].flatten(0, 1)
            yield name.replace(".q_proj.", ".output_gate."), per_head[:, 1].flatten(0, 1)
        else:
            yield from shared_expert_block_names([(name, tensor)])


def shared_expert_block_names(weights: Iterable[tuple[str, torch.Tensor]]
                              ) -> Iterator[tuple[str, torch.Tensor]]:
    """A SharedExpertMoeBlock's checkpoint names as its parameters': the router and the
    routed experts under ``mlp.routed.``, the shared gate's weight as the parameter
    ``shared_expert_gate`` itself (Qwen3-Next's, Qwen2-MoE's)."""
    for name, tensor in weights:
        if ".mlp.shared_expert_gate." in name:
            yield name.replace(".shared_expert_gate.weight", ".shared_expert_gate"), tensor
        elif ".mlp.gate." in name or ".mlp.experts." in name:
            yield name.replace(".mlp.", ".mlp.routed.", 1), tensor
        else:
            yield name, tensor


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    projections = SPLIT


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Also the text model of Qwen3_5ForConditionalGeneration checkpoints (registry
    TEXT_MODEL_OF; loader.text_model_tensors renames their tensors)."""

    feed_forward = staticmethod(dense_feed_forward)
    decoder_layer = Qwen3_5DecoderLayer

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        """in_proj_qkv / _z / _b / _a onto the two input projections, by shard id."""
        return projection_param(hf_name, SPLIT_PROJECTIONS) or super().param_name(hf_name)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    feed_forward = staticmethod(sparse_feed_forward)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(stacked_experts_one_by_one(
            weights, ".mlp.experts.", ("gate_proj", "up_proj", "down_proj")))
