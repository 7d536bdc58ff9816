"""KimiLinearForCausalLM: Moonshot's Kimi Linear, Kimi delta attention layers
(``linear_attention``: layers/mamba/kimi_delta.py) with multi-head latent attention
layers (``full_attention``) among them, DeepSeek-V3's feed-forward after each.

Built on the hybrid base (models/bamba.py), as OLMo Hybrid is:
- every layer is pre-norm (Llama's RMSNorm): x + mixer(norm(x)), then x + MLP(norm(x));
- the attention layers are DeepSeek's latent attention (models/deepseek_v3.py) without
  any positional encoding: the config's qk_rope_head_dim features of each key are shared
  by the heads, as DeepSeek's rotated ones, but nothing rotates them;
- ``mlp_layer_types`` says which layers have a dense SwiGLU MLP ("dense") and which
  routed experts with shared experts ("sparse"), routed as DeepSeek-V3 routes
  (nemotron_h.NemotronHRouter: sigmoid scores, a correction bias for the choice, groups,
  renormalised, scaled).

Checkpoint names are the released ones: the experts ``block_sparse_moe.experts.E.w1``
(gate), ``w3`` (up) and ``w2`` (down), the dense MLPs under ``mlp`` or
``block_sparse_moe``; the linear layers' projections and convs as kimi_delta.py says.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.mamba.kimi_delta import INPUT_SHARDS, KimiDeltaAttention
from spindle.models.bamba import (BambaForCausalLM, HybridLayout, PreNormHybridLayer,
                                  bamba_feed_forward, check_layer_types, check_silu)
from spindle.models.deepseek_v3 import MultiHeadLatentAttention
from spindle.models.glm4_moe import Glm4MoeBlock
from spindle.models.llama import _to_param_name
from spindle.models.moe import _MIXTRAL_EXPERT_PARTS, _expert_param
from spindle.models.nemotron_h import check_routing

ATTENTION, LINEAR = "full_attention", "linear_attention"
DENSE, SPARSE = "dense", "sparse"


def routing_fields(hf_config: Any) -> SimpleNamespace:
    """The fields DeepSeek-V3's expert block reads, under its names (KimiLinearConfig
    calls the expert count num_local_experts and has no mlp_bias)."""
    return SimpleNamespace(
        n_routed_experts=hf_config.num_local_experts, hidden_size=hf_config.hidden_size,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        n_shared_experts=getattr(hf_config, "n_shared_experts", 1) or 0,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        n_group=getattr(hf_config, "n_group", 1), topk_group=getattr(hf_config, "topk_group", 1),
        norm_topk_prob=getattr(hf_config, "norm_topk_prob", True),
        routed_scaling_factor=getattr(hf_config, "routed_scaling_factor", 1.0), mlp_bias=False)


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    check_silu(hf_config)
    layers = hf_config.num_hidden_layers
    check_layer_types(list(hf_config.layer_types), layers, {ATTENTION, LINEAR})
    kinds = list(hf_config.mlp_layer_types)
    if len(kinds) != layers or set(kinds) - {DENSE, SPARSE}:
        raise ValueError(f"mlp_layer_types must name {DENSE!r} or {SPARSE!r} for each of the "
                         f"{layers} layers, got {kinds}")
    if SPARSE in kinds:
        check_routing(routing_fields(hf_config))


def kimi_linear_layout(hf_config: Any) -> HybridLayout:
    """No rotary anywhere; the latent attention scales its own scores."""
    return HybridLayout(
        attention_layers=frozenset(i for i, kind in enumerate(hf_config.layer_types)
                                   if kind == ATTENTION),
        rotary_dim=0, attention_scale=1.0)


def kimi_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                      ) -> nn.Module:
    if hf_config.mlp_layer_types[layer_idx] == SPARSE:
        return Glm4MoeBlock(routing_fields(hf_config), tp_group)
    return bamba_feed_forward(hf_config, layer_idx, tp_group)


class KimiLinearDecoderLayer(PreNormHybridLayer):
    def make_attention(self, hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        return MultiHeadLatentAttention(hf_config, tp_group, rotary=False)

    def make_linear(self, hf_config: Any, tp_group: TensorParallelGroup) -> nn.Module:
        return KimiDeltaAttention(
            hidden_size=hf_config.hidden_size, num_heads=hf_config.linear_num_heads,
            head_dim=hf_config.linear_head_dim, conv_kernel=hf_config.linear_conv_kernel_dim,
            eps=hf_config.rms_norm_eps, tp_group=tp_group)


class KimiLinearForCausalLM(BambaForCausalLM):
    check_config = staticmethod(check_supported_config)
    layout = staticmethod(kimi_linear_layout)
    feed_forward = staticmethod(kimi_feed_forward)
    decoder_layer = KimiLinearDecoderLayer
    checkpoint_final_norm = "norm"

    def build_lm_head(self, hf_config: Any, tp_group: TensorParallelGroup,
                      tie: bool | None = None, bias: bool = False) -> None:
        """Never tied: transformers' KimiLinear keeps a head of its own whatever
        tie_word_embeddings says (the released configs say false)."""
        super().build_lm_head(hf_config, tp_group, tie=False, bias=bias)

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        """Experts onto the fused ones; the latent attention's names as they are; a
        linear layer's (``self_attn`` in the checkpoint, ``linear_attn`` here) projections
        of its input and q/k/v convs onto its merged ones by shard id."""
        hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        expert = _expert_param(hf_name, _MIXTRAL_EXPERT_PARTS)
        if expert is not None:
            return expert
        stem, found, leaf = hf_name.partition(".self_attn.")
        if not found:
            return _to_param_name(hf_name)
        index, kinds = stem.rsplit(".", 1)[-1], self.config.layer_types
        if index.isdigit() and int(index) < len(kinds) and kinds[int(index)] == ATTENTION:
            return hf_name, None
        projection, _, tail = leaf.partition(".")
        if projection in INPUT_SHARDS:
            return f"{stem}.linear_attn.in_proj.{tail}", INPUT_SHARDS[projection]
        for part in ("q", "k", "v"):
            if leaf == f"{part}_conv1d.weight":
                return f"{stem}.linear_attn.conv1d.weight", part
        return f"{stem}.linear_attn.{leaf}", None
