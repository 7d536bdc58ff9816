"""OlmoHybridForCausalLM: AI2's OLMo Hybrid, Gated DeltaNet layers (``linear_attention``)
with OLMo 3 attention layers (``full_attention``) among them; Olmo2ForCausalLM and
Olmo3ForCausalLM, the attention layers alone (OLMo 3: some within a sliding window, a
rotary table per layer type).

Bamba's layout (models/bamba.py), with OLMo's layers:
- a linear layer is pre-norm: x + GDN(norm(x)), then x + MLP(norm(x)). Its Gated
  DeltaNet (layers/mamba/gated_delta_net.py) has separate q/k/v/g/a/b projections
  (gated_delta_net.SEPARATE), beta scaled by 2 where ``linear_allow_neg_eigval``
  (a step may then reverse what the state holds), and an output norm of epsilon 1e-5;
- an attention layer is post-norm: x + norm(attn(x)), then x + norm(MLP(x)). Its
  q and k are RMS-normalised over their whole width (all heads at once: under tensor
  parallelism the sum of squares is all-reduced), then rotated, unless the config
  has no ``rope_theta`` (the released checkpoints: no positional encoding at all);
- every norm multiplies its weight in float32 before the cast back
  (norm.Float32WeightRMSNorm), as OLMo's do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spindle.attention import Attention
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import QKVParallelLinear, RowParallelLinear, set_weight_loader
from spindle.layers.mamba.gated_delta_net import (SEPARATE, SEPARATE_PROJECTIONS,
                                                   gated_delta_net, projection_param)
from spindle.layers.mamba.mixer import rows_loader
from spindle.layers.norm import Float32WeightRMSNorm
from spindle.models.bamba import (BambaForCausalLM, FeedForwardFactory, HybridLayout,
                                  apply_partial_rotary, attention_only_layout,
                                  check_layer_types, check_silu)
from spindle.models.llama import LlamaMLP, _to_param_name, checked_window, head_dim_of

ATTENTION, LINEAR, SLIDING = "full_attention", "linear_attention", "sliding_attention"
# transformers' OlmoHybridGatedDeltaNet: its output norm's epsilon, whatever rms_norm_eps.
OUTPUT_NORM_EPS = 1e-5


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    check_silu(hf_config)
    check_layer_types(list(hf_config.layer_types), hf_config.num_hidden_layers,
                      {ATTENTION, LINEAR})


def uses_rope(hf_config: Any) -> bool:
    """transformers' rule: rotary only where rope_parameters names a rope_theta."""
    params = getattr(hf_config, "rope_parameters", None)
    return params is not None and params.get("rope_theta") is not None


def olmo_hybrid_layout(hf_config: Any) -> HybridLayout:
    head_dim = head_dim_of(hf_config)
    return HybridLayout(
        attention_layers=frozenset(i for i, kind in enumerate(hf_config.layer_types)
                                   if kind == ATTENTION),
        rotary_dim=head_dim if uses_rope(hf_config) else 0, attention_scale=head_dim ** -0.5,
        norm_class=Float32WeightRMSNorm)


class WholeWidthRMSNorm(nn.Module):
    """OLMo's q/k norm: one RMSNorm over every head's features together, of which this
    rank holds rows ``first:first + width`` (its heads); the mean square is all-reduced
    over the ranks. float_weight: the weight multiplies in float32 before the cast (as
    Float32WeightRMSNorm; OLMo's), else after it (Llama's; MiniMax-M2's)."""

    def __init__(self, width: int, full_width: int, first: int, eps: float,
                 tp_group: TensorParallelGroup, float_weight: bool = True) -> None:
        super().__init__()
        self.full_width, self.eps, self.tp_group = full_width, eps, tp_group
        self.float_weight = float_weight
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        set_weight_loader(self.weight, rows_loader([(first, width)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        square_sum = self.tp_group.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(square_sum / self.full_width + self.eps)
        if self.float_weight:
            return (self.weight.float() * h).to(x.dtype)
        return self.weight * h.to(x.dtype)


class OlmoAttention(nn.Module):
    """Attention whose q and k are normalised over their whole width (WholeWidthRMSNorm,
    its float_weight as given), then rotated by layout.rotary_dim features of each head
    (all of them, a part, or none). clip_qkv: q, k (after their norms) and v clamped to
    [-clip_qkv, clip_qkv] (OLMoE's)."""

    def __init__(self, hf_config: Any, layout: HybridLayout, tp_group: TensorParallelGroup,
                 sliding_window: int | None = None, float_weight_norms: bool = True,
                 clip_qkv: float | None = None) -> None:
        super().__init__()
        self.clip_qkv = clip_qkv
        self.head_dim = head_dim_of(hf_config)
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        if kv_heads % tp_group.size != 0:
            raise ValueError(f"num_key_value_heads ({kv_heads}) must be a multiple of the "
                             f"tensor parallel size ({tp_group.size}): the k norm spans "
                             "every key head once")
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hf_config.hidden_size, self.head_dim, heads, kv_heads,
                                          bias=bias, tp_group=tp_group)
        self.num_heads = self.qkv_proj.num_heads  # rank-local
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * self.head_dim, hf_config.hidden_size, bias=bias,
                                        tp_group=tp_group)
        self.attn = Attention(self.num_heads, self.head_dim, layout.attention_scale,
                              self.num_kv_heads, sliding_window=sliding_window)
        rank, eps = tp_group.rank, hf_config.rms_norm_eps
        q_width, k_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_norm = WholeWidthRMSNorm(q_width, heads * self.head_dim, rank * q_width, eps,
                                        tp_group, float_weight_norms)
        self.k_norm = WholeWidthRMSNorm(k_width, kv_heads * self.head_dim, rank * k_width, eps,
                                        tp_group, float_weight_norms)
        self.rotates = layout.rotary_dim > 0

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden_states))
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            clip = self.clip_qkv
            q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
        if self.rotates:
            q = apply_partial_rotary(q.reshape(num_tokens, self.num_heads, self.head_dim),
                                     cos, sin).reshape(num_tokens, -1)
            k = apply_partial_rotary(k.reshape(num_tokens, self.num_kv_heads, self.head_dim),
                                     cos, sin).reshape(num_tokens, -1)
        return self.o_proj(self.attn(q, k, v))


def sliding_window_of(hf_config: Any, layer_idx: int) -> int | None:
    """OLMo 3's window on its ``sliding_attention`` layers (None: full attention)."""
    kinds = getattr(hf_config, "layer_types", None)  # (OLMo 2 has none)
    if kinds is None or kinds[layer_idx] != SLIDING:
        return None
    return checked_window(hf_config.sliding_window)


def olmo_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                      ) -> nn.Module:
    return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, False, tp_group)


class OlmoHybridDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, layout: HybridLayout,
                 feed_forward: FeedForwardFactory, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps, size = hf_config.rms_norm_eps, hf_config.hidden_size
        self.is_attention = layer_idx in layout.attention_layers
        self.mlp = feed_forward(hf_config, layer_idx, tp_group)
        self.post_attention_layernorm = Float32WeightRMSNorm(size, eps=eps)
        if self.is_attention:
            self.self_attn = OlmoAttention(hf_config, layout, tp_group,
                                           sliding_window_of(hf_config, layer_idx))
            self.post_feedforward_layernorm = Float32WeightRMSNorm(size, eps=eps)
        else:
            self.linear_attn = gated_delta_net(
                hf_config, tp_group, SEPARATE, eps=OUTPUT_NORM_EPS,
                beta_scale=2.0 if getattr(hf_config, "linear_allow_neg_eigval", True) else 1.0)
            self.input_layernorm = Float32WeightRMSNorm(size, eps=eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual is carried separately (the next norm, or the next attention
        layer, adds it)."""
        if not self.is_attention:
            hidden_states, residual = self.input_layernorm.pre_norm(hidden_states, residual)
            hidden_states = self.linear_attn(hidden_states)
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            return self.mlp(hidden_states), residual
        return post_norm_attention_block(self, hidden_states, residual, cos, sin)


def post_norm_attention_block(layer: nn.Module, hidden_states: torch.Tensor,
                              residual: torch.Tensor | None, cos: torch.Tensor | None,
                              sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMo 2's attention layer (EXAONE 4's too): attention, its norm, the residual; MLP,
    its norm; no input norm. The residual is carried separately: the next layer, or the
    final norm, adds the returned output to it."""
    if residual is not None:
        hidden_states = hidden_states + residual
    residual = hidden_states + layer.post_attention_layernorm(
        layer.self_attn(hidden_states, cos, sin))
    return layer.post_feedforward_layernorm(layer.mlp(residual)), residual


class OlmoHybridForCausalLM(BambaForCausalLM):
    check_config = staticmethod(check_supported_config)
    layout = staticmethod(olmo_hybrid_layout)
    feed_forward = staticmethod(olmo_feed_forward)
    decoder_layer = OlmoHybridDecoderLayer

    checkpoint_final_norm = "norm"

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        """The linear attention's projections onto its two, by shard id (its o_proj and
        o_norm are the layer's out_proj and norm)."""
        hf_name = hf_name.replace(".linear_attn.o_proj.", ".linear_attn.out_proj.")
        hf_name = hf_name.replace(".linear_attn.o_norm.", ".linear_attn.norm.")
        return projection_param(hf_name, SEPARATE_PROJECTIONS) or _to_param_name(hf_name)


def olmo2_layout(hf_config: Any) -> HybridLayout:
    """Every layer attends, with a rotary of the whole head."""
    return attention_only_layout(hf_config, head_dim_of(hf_config),
                                 norm_class=Float32WeightRMSNorm)


class Olmo2ForCausalLM(OlmoHybridForCausalLM):
    """OLMo 2: OLMo Hybrid's attention layers alone (post-norm, q/k normalised over
    their whole width, a rotary of the whole head), so an attention-only decoder."""

    model_kind = "decoder"
    check_config = staticmethod(check_silu)
    layout = staticmethod(olmo2_layout)


def check_olmo3_config(hf_config: Any) -> None:
    check_silu(hf_config)
    check_layer_types(list(hf_config.layer_types), hf_config.num_hidden_layers,
                      {ATTENTION, SLIDING})


def olmo3_layout(hf_config: Any) -> HybridLayout:
    """Every layer attends (a window on the sliding ones), each rotating with its layer
    type's rotary table."""
    return attention_only_layout(hf_config, head_dim_of(hf_config),
                                 norm_class=Float32WeightRMSNorm,
                                 rope_layer_types=tuple(hf_config.layer_types))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3: OLMo 2 with sliding-window attention on the ``sliding_attention`` layers
    (``sliding_window``) and rope parameters per layer type (YaRN on the full ones in
    the long-context checkpoints)."""

    check_config = staticmethod(check_olmo3_config)
    layout = staticmethod(olmo3_layout)
