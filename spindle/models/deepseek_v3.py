"""DeepseekV3ForCausalLM: DeepSeek-V3 / R1 and the models built on its architecture (Kimi
K2, ...): multi-head latent attention (MLA), then a dense SwiGLU MLP for the first
``first_k_dense_replace`` layers and routed experts with shared experts after them (the
same routing as GLM-4.5: models/glm4_moe.py). DeepseekV2ForCausalLM (DeepSeek-V2,
V2-Lite, V2.5): the same attention, experts routed by softmax (``topk_method`` greedy or
group_limited_greedy: the best ``topk_group`` groups by their best expert), the chosen
probabilities times ``routed_scaling_factor`` and never renormalised (as transformers
routes them, whatever norm_topk_prob says).

MLA, as transformers computes it: queries from ``q_proj`` (or a low-rank ``q_a_proj``,
RMSNorm, ``q_b_proj``), each head ``qk_nope_head_dim`` features without position and
``qk_rope_head_dim`` rotated ones; one latent per token, ``kv_a_proj_with_mqa``'s first
``kv_lora_rank`` features RMS-normed (c) and its last ``qk_rope_head_dim`` rotated (the
key's rotary part, shared by all heads); ``kv_b_proj`` expands c into each head's
non-rotary key and its value. Scores scale by qk_head_dim ** -0.5, times YaRN's
``mscale_all_dim`` factor squared where the rope is YaRN.

spindle caches the latent, not the expanded keys and values: the expansion is folded
into the query and the output (the "absorbed" form). Head h's score q_nope . (W_k c) +
q_rot . k_rot equals [W_k^T q_nope, q_rot] . [c, k_rot], so attention runs as one KV head
of kv_lora_rank + qk_rope_head_dim features shared by every query head (multi-query);
its values are its keys (the output's first kv_lora_rank features are the weighted sum
of c; times W_v they are the head's output, the rest is dropped). The cache keeps the
keys only (``Attention(values_are_keys=True)``): a token costs kv_lora_rank +
qk_rope_head_dim values per layer (576 for DeepSeek-V3), as transformers caches it,
against heads x (qk_head_dim + v_head_dim) expanded.
Under tensor parallelism the heads (q, kv_b_proj, o_proj) split across ranks and every
rank holds the whole latent.

``rope_interleave`` (the default) rotates interleaved pairs (x0, x1), (x2, x3), ...;
transformers returns them de-interleaved (evens' results, then odds'), and so does this,
for q and k alike. The checkpoint's multi-token-prediction layers (indices from
``num_hidden_layers`` on) are not loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spindle.attention import Attention
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import (ColumnParallelLinear, RowParallelLinear, apply_linear,
                                   default_weight_loader, set_weight_loader)
from spindle.layers.norm import RMSNorm
from spindle.layers.rotary import apply_rotary, rope_parameters_from_config
from spindle.models.bamba import (AttentionOnlyDecoder, HybridLayout, PreNormAttentionLayer,
                                  attention_only_layout)
from spindle.models.glm4_moe import Glm4MoeForCausalLM, glm4_moe_feed_forward
from spindle.models.llama import require_activation
from spindle.models.nemotron_h import check_routing


def check_latent_attention(hf_config: Any) -> None:
    """What DeepSeek-V2 and V3 both need: SiLU, an even number of rotated features."""
    require_activation(hf_config, "silu")
    if hf_config.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {hf_config.qk_rope_head_dim}")


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    check_latent_attention(hf_config)
    check_routing(hf_config)


def softmax_scale(hf_config: Any) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared (the
    reference implementation's scale of the non-rotary features too)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters_from_config(hf_config)
    all_dim = params.get("mscale_all_dim") or 0
    factor = params.get("factor") or 1.0
    if params.get("rope_type", "default") != "default" and all_dim and factor > 1:
        mscale = 0.1 * all_dim * torch.log(torch.tensor(float(factor))).item() + 1.0
        scale *= mscale * mscale
    return scale


def mla_layout(hf_config: Any) -> HybridLayout:
    """The rotary table covers the rotated part of a head (qk_rope_head_dim)."""
    return attention_only_layout(hf_config, hf_config.qk_rope_head_dim)


def deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1, x2, x3, ...)] -> [..., x0, x2, ..., x1, x3, ...]: interleaved rotary
    pairs laid out as rotate-half pairs, where the rotation is the same."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 interleaved: bool | None = None, rotary: bool = True) -> None:
        """interleaved: whether the rotary pairs are interleaved (default: the config's
        rope_interleave, True where it names none, as DeepSeek's); rotary False: no
        positional encoding at all, the "rotary" features taken as they are and scores
        scaled by qk_head_dim ** -0.5 (KimiLinear's)."""
        super().__init__()
        self.rotary = rotary
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.nope_dim, self.rope_dim = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
        self.v_dim, self.lora_rank = hf_config.v_head_dim, hf_config.kv_lora_rank
        self.interleaved = (bool(getattr(hf_config, "rope_interleave", True))
                            if interleaved is None else interleaved)
        bias = bool(getattr(hf_config, "attention_bias", False))
        single = TensorParallelGroup.single()
        q_width = heads * (self.nope_dim + self.rope_dim)
        self.q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_width, bias=False, tp_group=tp_group)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, self.q_lora_rank, bias=bias,
                                                 tp_group=single)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_width, bias=False,
                                                 tp_group=tp_group)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.lora_rank + self.rope_dim,
                                                       bias=bias, tp_group=single)
        self.kv_a_layernorm = RMSNorm(self.lora_rank, eps=1e-6)
        self.kv_b_proj = ColumnParallelLinear(self.lora_rank, heads * (self.nope_dim + self.v_dim),
                                              bias=False, tp_group=tp_group)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias, tp_group=tp_group)
        self.num_heads = heads // tp_group.size  # rank-local (the column splits' divide)
        scale = softmax_scale(hf_config) if rotary else (self.nope_dim + self.rope_dim) ** -0.5
        self.attn = Attention(self.num_heads, self.lora_rank + self.rope_dim, scale,
                              num_kv_heads=1, values_are_keys=True)

    def _queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            return self.q_proj(hidden_states)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))

    def _rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.rotary:
            return x
        return apply_rotary(deinterleaved(x) if self.interleaved else x, cos, sin)

    def _expansion(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as this rank's heads' key map [H, nope, lora] and value map
        [H, v, lora]."""
        weight = self.kv_b_proj.weight
        if weight.dim() != 2 or not weight.dtype.is_floating_point:
            raise ValueError("multi-head latent attention needs kv_b_proj as a dense weight, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        per_head = weight.to(dtype).view(self.num_heads, self.nope_dim + self.v_dim,
                                         self.lora_rank)
        return per_head[:, :self.nope_dim], per_head[:, self.nope_dim:]

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        q = self._queries(hidden_states).view(tokens, self.num_heads,
                                              self.nope_dim + self.rope_dim)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rot = self._rotated(q_rot, cos, sin)
        k_rot = self._rotated(k_rot.reshape(tokens, 1, self.rope_dim), cos, sin)
        key_map, value_map = self._expansion(q.dtype)
        # (the key expansion folded into the query: [T, H, nope] x [H, nope, lora])
        q_latent = torch.einsum("thn,hnl->thl", q_nope, key_map)
        query = torch.cat([q_latent, q_rot], dim=-1).reshape(tokens, -1)
        key = torch.cat([latent, k_rot.reshape(tokens, self.rope_dim)], dim=-1)
        # (values: the keys themselves; the output's rotary features are dropped)
        out = self.attn(query, key, key).view(tokens, self.num_heads, -1)[..., :self.lora_rank]
        out = torch.einsum("thl,hvl->thv", out, value_map)  # the value expansion
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))


class DeepseekV3DecoderLayer(PreNormAttentionLayer):
    @staticmethod
    def make_attention(hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        return MultiHeadLatentAttention(hf_config, tp_group)


class DeepseekV3ForCausalLM(Glm4MoeForCausalLM):
    check_config = staticmethod(check_supported_config)
    layout = staticmethod(mla_layout)
    feed_forward = staticmethod(glm4_moe_feed_forward)
    decoder_layer = DeepseekV3DecoderLayer

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        if ".self_attn." in hf_name:  # (MLA's projections are its own, nothing merged)
            return hf_name, None
        return super().param_name(hf_name)


# DeepSeek-V2's ways to pick a token's experts.
GREEDY, GROUP_LIMITED = "greedy", "group_limited_greedy"


def check_v2_config(hf_config: Any) -> None:
    check_latent_attention(hf_config)
    method = getattr(hf_config, "topk_method", GREEDY)
    if method not in (GREEDY, GROUP_LIMITED):
        raise ValueError(f"topk_method {method!r} is not supported ({GREEDY!r} or "
                         f"{GROUP_LIMITED!r})")
    experts, top_k = hf_config.n_routed_experts, hf_config.num_experts_per_tok
    if method == GROUP_LIMITED:
        groups, top_groups = hf_config.n_group, hf_config.topk_group
        if not groups or experts % groups or not 1 <= (top_groups or 0) <= groups:
            raise ValueError(f"group_limited_greedy needs n_group dividing n_routed_experts "
                             f"({experts}) and topk_group in 1..n_group; got {groups}, "
                             f"{top_groups}")
        experts = top_groups * (experts // groups)
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..{experts}")


class DeepseekV2Router(nn.Module):
    """Softmax scores of a float32 [E, H] linear; the top k (greedy, or within the best
    topk_group groups by their best score) times routed_scaling_factor. Replicated."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.top_k = hf_config.num_experts_per_tok
        self.method = getattr(hf_config, "topk_method", GREEDY)
        self.num_groups = getattr(hf_config, "n_group", None) or 1
        self.top_groups = getattr(hf_config, "topk_group", None) or 1
        self.scaling = float(getattr(hf_config, "routed_scaling_factor", 1.0))
        self.weight = nn.Parameter(torch.empty(hf_config.n_routed_experts, hf_config.hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)
        self.batch_invariant = False  # set by enable_batch_invariance

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(apply_linear(x.float(), self.weight,
                                            invariant=self.batch_invariant), dim=-1)
        if self.method == GROUP_LIMITED:
            grouped = scores.view(x.shape[0], self.num_groups, -1)
            best = grouped.amax(dim=-1).topk(self.top_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros(grouped.shape[:2], dtype=torch.bool,
                               device=x.device).scatter_(1, best, True)
            scores = grouped.masked_fill(~keep[..., None], 0.0).view_as(scores)
        weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return ids, weights * self.scaling


def deepseek_v2_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                             ) -> nn.Module:
    return glm4_moe_feed_forward(hf_config, layer_idx, tp_group, router=DeepseekV2Router)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2: its rotary pairs are interleaved (transformers rotates them as complex
    numbers and keeps them interleaved; de-interleaving q and k alike leaves their dot
    products the same)."""

    check_config = staticmethod(check_v2_config)
    feed_forward = staticmethod(deepseek_v2_feed_forward)


class MiniCPM3DecoderLayer(PreNormAttentionLayer):
    """Latent attention with rotate-half rotary, Llama's MLP, each output times
    scale_depth / sqrt(num_hidden_layers) before it joins the residual stream."""

    def __init__(self, hf_config: Any, layer_idx: int, layout: HybridLayout,
                 feed_forward: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__(hf_config, layer_idx, layout, feed_forward, tp_group)
        self.scale = layout.residual_multiplier

    @staticmethod
    def make_attention(hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        return MultiHeadLatentAttention(hf_config, tp_group, interleaved=False)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm.pre_norm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, sin) * self.scale
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * self.scale, residual


def minicpm3_layout(hf_config: Any) -> HybridLayout:
    """The rotated part of a head; the embeddings times scale_emb, each sublayer's output
    times scale_depth / sqrt(num_hidden_layers)."""
    import math

    depth = getattr(hf_config, "scale_depth", None) or math.sqrt(hf_config.num_hidden_layers)
    return attention_only_layout(
        hf_config, hf_config.qk_rope_head_dim,
        embedding_multiplier=float(getattr(hf_config, "scale_emb", 1.0)),
        residual_multiplier=float(depth) / math.sqrt(hf_config.num_hidden_layers))


class MiniCPM3ForCausalLM(AttentionOnlyDecoder):
    """OpenBMB's MiniCPM3: Llama's dense layers around DeepSeek's latent attention (with
    the plain rotate-half rotary), maximal-update scalings: the embeddings times
    scale_emb, each sublayer's output times scale_depth / sqrt(layers), and the final
    hidden states divided by hidden_size / dim_model_base before the LM head."""

    layout = staticmethod(minicpm3_layout)
    decoder_layer = MiniCPM3DecoderLayer

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        base = getattr(self.config, "dim_model_base", None) or self.config.hidden_size
        return super().compute_logits(hidden_states / (self.config.hidden_size / base))

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        if ".self_attn." in hf_name:  # (MLA's projections are its own, nothing merged)
            return hf_name, None
        return super().param_name(hf_name)
