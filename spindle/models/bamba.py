"""BambaForCausalLM: Mamba2 layers with a few attention layers among them (IBM's Bamba;
the pattern of the Granite 4 hybrids).

Every decoder layer is pre-norm with a SwiGLU MLP; its mixer is either a Mamba2 block
(spindle/layers/mamba/mixer.py) or grouped-query attention, the latter at the indices
``attn_layer_indices``. Bamba's attention rotates only the first half of each head
(partial_rotary_factor 0.5, fixed by transformers' BambaConfig).

Caching is declared by the layers themselves: Attention layers page keys and values,
mixers keep a conv state and an SSM state per sequence; the runner groups them by
cache spec and sets each layer's ``cache_group``. Parameter names follow the HF
checkpoint, except the merged qkv_proj and gate_up_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from spindle.attention import Attention
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import IntermediateTensors, PipelineStage
from spindle.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from spindle.layers.mamba.mixer import MambaMixer, norm_group_size, time_step_limit
from spindle.layers.norm import RMSNorm
from spindle.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters_from_config
from spindle.models.llama import (LlamaMLP, _to_param_name, head_dim_of, head_sinks,
                                  require_activation)
from spindle.models.causal_lm import (DecoderForCausalLM, MissingLayer, embedded, stage_embedding,
                                      stage_layers)
from spindle.models.weights import load_named_weights, not_on_this_rank

# transformers' BambaConfig forces it for every Bamba checkpoint.
BAMBA_PARTIAL_ROTARY_FACTOR = 0.5


def check_silu(hf_config: Any) -> None:
    require_activation(hf_config, "silu")


def check_layer_types(kinds: list[str], num_layers: int, known: set[str]) -> None:
    """A hybrid's ``layer_types``: one per layer, each one of known."""
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types names {len(kinds)} layers, the model has {num_layers}")
    unknown = sorted(set(kinds) - known)
    if unknown:
        raise ValueError(f"layer_types holds unknown layer types {unknown}")


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    check_silu(hf_config)
    inter = int(getattr(hf_config, "mamba_expand", 2) * hf_config.hidden_size)
    heads, head_dim = hf_config.mamba_n_heads, mamba_head_dim(hf_config)
    if heads * head_dim != inter:
        raise ValueError(f"mamba_n_heads ({heads}) * mamba_d_head ({head_dim}) must equal "
                         f"mamba_expand * hidden_size ({inter})")
    for index in attention_layer_indices(hf_config):
        if not 0 <= index < hf_config.num_hidden_layers:
            raise ValueError(f"attn_layer_indices holds {index}, outside the model's "
                             f"{hf_config.num_hidden_layers} layers")
    time_step_limit(hf_config)  # (refuses a bad one)


def attention_layer_indices(hf_config: Any) -> set[int]:
    return set(getattr(hf_config, "attn_layer_indices", None) or [])


def mamba_head_dim(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "mamba_d_head", "auto")
    if head_dim == "auto":  # as BambaConfig resolves it
        inter = int(getattr(hf_config, "mamba_expand", 2) * hf_config.hidden_size)
        return inter // hf_config.mamba_n_heads
    return int(head_dim)


def rotary_dim(hf_config: Any) -> int:
    params = rope_parameters_from_config(hf_config)
    factor = params.get("partial_rotary_factor", BAMBA_PARTIAL_ROTARY_FACTOR)
    return int(head_dim_of(hf_config) * factor)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of each head of x [T, H, D], keep the rest."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:  # (the whole head: no split and concatenation)
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)


@dataclass(frozen=True)
class HybridLayout:
    """What sets a Bamba-pattern hybrid's layers apart from Bamba's own (GraniteMoeHybrid
    differs only in these): which layers attend, how much of each head the rotary
    embedding turns (0: none), the attention's score scale, and the multipliers on the
    embeddings and on each sublayer's output before it joins the residual stream."""

    attention_layers: frozenset[int]
    rotary_dim: int
    attention_scale: float
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    # The norms' epsilon where the config does not call it rms_norm_eps (LFM2's norm_eps).
    norm_eps: float | None = None
    # The RMSNorm of the final norm and the per-head q/k norms (Qwen3-Next: GemmaRMSNorm,
    # a weight offset from one).
    norm_class: type[RMSNorm] = RMSNorm
    # Each layer's key into rope parameters given per layer type (OLMo 3:
    # "sliding_attention" / "full_attention"), a rotary table per type; None: one table.
    rope_layer_types: tuple[str, ...] | None = None
    # The rope parameters of each of those keys where the config does not hold them by
    # layer type (GraniteSWA's theta per layer); a key mapped to None: no rotary there.
    rope_parameters_of: Mapping[str, Mapping[str, Any] | None] | None = None
    # Each layer's sliding window (None: none anywhere, or full attention there).
    sliding_windows: tuple[int | None, ...] | None = None
    # Attention sinks on every attention layer (a logit per head in each softmax).
    attention_sinks: bool = False

    def window_of(self, layer_idx: int) -> int | None:
        return None if self.sliding_windows is None else self.sliding_windows[layer_idx]


def attention_only_layout(hf_config: Any, rotary_dim: int, **fields: Any) -> HybridLayout:
    """The layout of a decoder built on this base whose every layer attends, rotating
    rotary_dim features of each head, scores scaled by head_dim ** -0.5; fields: the
    rest of HybridLayout's."""
    return HybridLayout(attention_layers=frozenset(range(hf_config.num_hidden_layers)),
                        rotary_dim=rotary_dim, attention_scale=head_dim_of(hf_config) ** -0.5,
                        **fields)


def bamba_layout(hf_config: Any) -> HybridLayout:
    return HybridLayout(frozenset(attention_layer_indices(hf_config)), rotary_dim(hf_config),
                        head_dim_of(hf_config) ** -0.5)


class BambaAttention(nn.Module):
    def __init__(self, hf_config: Any, layout: HybridLayout, tp_group: TensorParallelGroup,
                 key_multiplier: float = 1.0, qk_norm_eps: float | None = None,
                 output_gate: bool = False, o_bias: bool | None = None,
                 sliding_window: int | None = None, norm_after_rotary: bool = False) -> None:
        """key_multiplier: a factor on the keys before the rotary embedding (FalconH1's);
        qk_norm_eps: RMSNorm each head of q and k first (layout.norm_class), with this
        epsilon (LFM2's, Qwen3-Next's); output_gate: the attention's output times
        sigmoid(output_gate(x)), a projection of the layer's input per feature of every
        head (Qwen3-Next's, whose checkpoints interleave it with q in q_proj); o_bias:
        o_proj's bias where it differs from q/k/v's (``attention_bias``: GLM-4.5's);
        sliding_window: this layer's window. layout.attention_sinks: a sink logit per
        head (``sinks``). A layer handed no rotary tables (cos None) does not rotate.
        norm_after_rotary: the q/k norms after the rotation, not before (Hunyuan's)."""
        super().__init__()
        self.head_dim = head_dim_of(hf_config)
        self.rotates = layout.rotary_dim > 0
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size, self.head_dim, hf_config.num_attention_heads,
            hf_config.num_key_value_heads, bias=bias, tp_group=tp_group)
        self.num_heads = self.qkv_proj.num_heads  # rank-local
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(hf_config.num_attention_heads * self.head_dim,
                                        hf_config.hidden_size,
                                        bias=bias if o_bias is None else o_bias,
                                        tp_group=tp_group)
        self.sinks = head_sinks(self.num_heads, tp_group) if layout.attention_sinks else None
        self.attn = Attention(self.num_heads, self.head_dim, layout.attention_scale,
                              self.num_kv_heads, sliding_window=sliding_window,
                              sinks=self.sinks)
        self.key_multiplier = key_multiplier
        self.norm_after_rotary = norm_after_rotary
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = layout.norm_class(self.head_dim, eps=qk_norm_eps)
            self.k_norm = layout.norm_class(self.head_dim, eps=qk_norm_eps)
        self.output_gate = None
        if output_gate:
            self.output_gate = ColumnParallelLinear(
                hf_config.hidden_size, hf_config.num_attention_heads * self.head_dim,
                bias=bias, tp_group=tp_group)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden_states))
        if self.q_norm is not None and not self.norm_after_rotary:
            q, k = self._normed(q, k)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        if self.rotates and cos is not None:
            q, k = self._rotated(q, k, cos, sin)
        if self.q_norm is not None and self.norm_after_rotary:
            q, k = self._normed(q, k)
        out = self.attn(q, k, v)
        if self.output_gate is not None:
            out = out * torch.sigmoid(self.output_gate(hidden_states))
        return self.o_proj(out)

    def _normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head of q and k through its RMSNorm."""
        tokens = q.shape[0]
        q = self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim))
        return q.reshape(tokens, -1), k.reshape(tokens, -1)

    def _rotated(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = q.shape[0]
        q = apply_partial_rotary(q.reshape(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_partial_rotary(k.reshape(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        return q.reshape(tokens, -1), k.reshape(tokens, -1)


def make_mixer(hf_config: Any, tp_group: TensorParallelGroup, head_dim: int | None = None,
               **options: Any) -> MambaMixer:
    """The Mamba2 mixer of Bamba's config fields (``mamba_*``). head_dim: where a family
    resolves it otherwise; options: further MambaMixer arguments (FalconH1's)."""
    heads = hf_config.mamba_n_heads
    head_dim = head_dim or mamba_head_dim(hf_config)
    n_groups = getattr(hf_config, "mamba_n_groups", 1)
    return MambaMixer(
        hidden_size=hf_config.hidden_size, num_heads=heads, head_dim=head_dim,
        n_groups=n_groups, norm_group_size=norm_group_size(heads, head_dim, n_groups),
        state_size=hf_config.mamba_d_state, conv_kernel=getattr(hf_config, "mamba_d_conv", 4),
        chunk_size=hf_config.mamba_chunk_size, eps=hf_config.rms_norm_eps,
        time_step_limit=time_step_limit(hf_config),
        conv_bias=bool(getattr(hf_config, "mamba_conv_bias", True)),
        proj_bias=bool(getattr(hf_config, "mamba_proj_bias", False)), tp_group=tp_group,
        **options)


def bamba_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                       ) -> nn.Module:
    return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size,
                    bool(getattr(hf_config, "mlp_bias", False)), tp_group)


FeedForwardFactory = Callable[[Any, int, TensorParallelGroup], nn.Module]


class BambaDecoderLayer(nn.Module):
    # The state-space mixer of a non-attention layer (Jamba's: a Mamba1 mixer).
    mixer_factory = staticmethod(make_mixer)

    def __init__(self, hf_config: Any, layer_idx: int, layout: HybridLayout,
                 feed_forward: FeedForwardFactory, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.is_attention = layer_idx in layout.attention_layers
        self.residual_multiplier = layout.residual_multiplier
        if self.is_attention:
            self.self_attn = BambaAttention(hf_config, layout, tp_group,
                                            sliding_window=layout.window_of(layer_idx))
        else:
            self.mamba = self.mixer_factory(hf_config, tp_group)
        self.feed_forward = feed_forward(hf_config, layer_idx, tp_group)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.pre_ff_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block, residual carried separately (the next norm does the add of
        this layer's output, scaled by the residual multiplier where there is one)."""
        hidden_states, residual = self.input_layernorm.pre_norm(hidden_states, residual)
        if self.is_attention:
            hidden_states = self.self_attn(hidden_states, cos, sin)
        else:
            hidden_states = self.mamba(hidden_states)
        hidden_states, residual = self.pre_ff_layernorm(self._scaled(hidden_states), residual)
        return self._scaled(self.feed_forward(hidden_states)), residual

    def _scaled(self, output: torch.Tensor) -> torch.Tensor:
        return output if self.residual_multiplier == 1.0 else output * self.residual_multiplier


class PreNormAttentionLayer(nn.Module):
    """An attention-only decoder layer on this base: input norm, attention (the
    subclass's make_attention), post-attention norm, feed-forward; Llama's RMSNorm,
    the residual carried separately (the next norm adds it)."""

    def __init__(self, hf_config: Any, layer_idx: int, layout: HybridLayout,
                 feed_forward: FeedForwardFactory, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.self_attn = self.make_attention(hf_config, layout, tp_group)
        self.mlp = feed_forward(hf_config, layer_idx, tp_group)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)

    @staticmethod
    def make_attention(hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm.pre_norm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, sin)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class PreNormHybridLayer(nn.Module):
    """A hybrid's pre-norm layer: input norm, then attention (make_attention) on the
    layout's attention layers or the linear mixer (make_linear, held as ``linear_attn``)
    elsewhere, post-attention norm, feed-forward; norm_class's norms, the residual
    carried separately (the next norm adds it). Qwen3-Next's and KimiLinear's."""

    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, hf_config: Any, layer_idx: int, layout: HybridLayout,
                 feed_forward: FeedForwardFactory, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps, size = hf_config.rms_norm_eps, hf_config.hidden_size
        self.is_attention = layer_idx in layout.attention_layers
        if self.is_attention:
            self.self_attn = self.make_attention(hf_config, layout, tp_group)
        else:
            self.linear_attn = self.make_linear(hf_config, tp_group)
        self.mlp = feed_forward(hf_config, layer_idx, tp_group)
        self.input_layernorm = self.norm_class(size, eps=eps)
        self.post_attention_layernorm = self.norm_class(size, eps=eps)

    def make_attention(self, hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        raise NotImplementedError

    def make_linear(self, hf_config: Any, tp_group: TensorParallelGroup) -> nn.Module:
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm.pre_norm(hidden_states, residual)
        if self.is_attention:
            hidden_states = self.self_attn(hidden_states, cos, sin)
        else:
            hidden_states = self.linear_attn(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class BambaModel(nn.Module):
    def __init__(self, hf_config: Any, layout: HybridLayout, feed_forward: FeedForwardFactory,
                 tp_group: TensorParallelGroup, stage: PipelineStage,
                 decoder_layer: type[nn.Module] = BambaDecoderLayer) -> None:
        super().__init__()
        self.stage = stage
        self.embedding_multiplier = layout.embedding_multiplier
        self.embed_tokens = stage_embedding(hf_config, stage, tp_group)
        self.layers = stage_layers(stage, hf_config.num_hidden_layers, lambda i: decoder_layer(
            hf_config, i, layout, feed_forward, tp_group))
        eps = hf_config.rms_norm_eps if layout.norm_eps is None else layout.norm_eps
        self.final_layernorm = (layout.norm_class(hf_config.hidden_size, eps=eps)
                                if stage.is_last else None)
        self.rotary_emb = None
        self.rope_of_layer = layout.rope_layer_types
        if layout.rotary_dim > 0 and layout.rope_parameters_of is not None:
            self.rotary_emb = nn.ModuleDict({
                kind: RotaryEmbedding(layout.rotary_dim, hf_config.max_position_embeddings,
                                      dict(params))
                for kind, params in sorted(layout.rope_parameters_of.items())
                if params is not None})
        elif layout.rotary_dim > 0 and self.rope_of_layer is not None:
            self.rotary_emb = nn.ModuleDict({
                kind: RotaryEmbedding.from_config(hf_config, layout.rotary_dim, kind)
                for kind in sorted(set(self.rope_of_layer))})
        elif layout.rotary_dim > 0:
            params = dict(rope_parameters_from_config(hf_config))
            params.pop("partial_rotary_factor", None)  # the table covers the rotated part only
            self.rotary_emb = RotaryEmbedding(layout.rotary_dim,
                                              hf_config.max_position_embeddings, params)

    def own_layers(self) -> list[nn.Module]:
        return [layer for layer in self.layers if not isinstance(layer, MissingLayer)]

    def _step_rotary(self, positions: torch.Tensor, dtype: torch.dtype
                     ) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Each layer's (cos, sin) at this step's positions ((None, None) without a
        rotary), each table's rows gathered once and shared by its layers."""
        count = len(self.layers)
        if self.rotary_emb is None:
            return [(None, None)] * count
        if self.rope_of_layer is None:
            return [self.rotary_emb(positions, dtype)] * count
        tables = {kind: table(positions, dtype) for kind, table in self.rotary_emb.items()}
        return [tables.get(kind, (None, None)) for kind in self.rope_of_layer]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: IntermediateTensors | None = None,
                ) -> torch.Tensor | IntermediateTensors:
        if self.stage.is_first:
            hidden_states = embedded(self.embed_tokens, input_ids, inputs_embeds)
            if self.embedding_multiplier != 1.0:
                hidden_states = hidden_states * self.embedding_multiplier
            residual = None
        else:
            if intermediate_tensors is None:
                raise ValueError(f"pipeline stage {self.stage.rank} needs the previous "
                                 "stage's intermediate_tensors")
            hidden_states = intermediate_tensors.hidden_states
            residual = intermediate_tensors.residual
        rotary = self._step_rotary(positions, hidden_states.dtype)
        for layer, (cos, sin) in zip(self.layers, rotary):
            if not isinstance(layer, MissingLayer):
                hidden_states, residual = layer(hidden_states, residual, cos, sin)
        if not self.stage.is_last:
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.final_layernorm(hidden_states, residual)
        return hidden_states


class BambaForCausalLM(DecoderForCausalLM):
    model_kind = "hybrid"
    supports_pipeline_parallel = True

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.config = hf_config
        self.tp_group = tp_group
        self.stage = stage or PipelineStage.single()
        self.model = BambaModel(hf_config, self.layout(hf_config), self.feed_forward,
                                tp_group, self.stage, self.decoder_layer)
        self.build_lm_head(hf_config, tp_group)

    # What a Bamba-pattern model of another family overrides (granite_hybrid.py,
    # falcon_h1.py).
    check_config = staticmethod(check_supported_config)
    layout = staticmethod(bamba_layout)
    feed_forward = staticmethod(bamba_feed_forward)
    decoder_layer = BambaDecoderLayer
    # The final norm's checkpoint name (model.<name>.*), loaded as model.final_layernorm.
    checkpoint_final_norm = "final_layernorm"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into this rank's parameters (see
        DecoderForCausalLM.load_weights)."""
        return load_named_weights(self, weights, self._checkpoint_param)

    def _checkpoint_param(self, hf_name: str) -> tuple[str, Any] | None:
        theirs = f"model.{self.checkpoint_final_norm}."
        if hf_name.startswith(theirs):
            hf_name = "model.final_layernorm." + hf_name[len(theirs):]
        return None if self._skip_checkpoint_tensor(hf_name) else self.param_name(hf_name)

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        return _to_param_name(hf_name)

    def _skip_checkpoint_tensor(self, hf_name: str) -> bool:
        return not_on_this_rank(self, hf_name, final_norm="final_layernorm")


class AttentionOnlyDecoder(BambaForCausalLM):
    """A decoder of another family built on this base with every layer attending (no
    Mamba layers): what those models share unless they say otherwise (SiLU, the dense
    MLP, the final norm named ``norm``); each names its layout and decoder_layer."""

    model_kind = "decoder"
    checkpoint_final_norm = "norm"
    check_config = staticmethod(check_silu)
    feed_forward = staticmethod(bamba_feed_forward)
