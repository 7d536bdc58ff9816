"""Zamba2ForCausalLM: Zyphra's Zamba2 (1.2B, 2.7B, 7B): a stack of Mamba2 layers, some of
which ("hybrid" layers) first run a transformer block whose weights are shared.

- A ``linear_attention`` layer is ``x + mixer(norm(x))``, the mixer Mamba2's
  (spindle/layers/mamba/mixer.py) with its gated norm over each B/C group.
- A ``hybrid`` layer runs one of ``num_mem_blocks`` shared transformer blocks (hybrid
  layer j uses block j % num_mem_blocks) on ``[x, embeddings]`` (the layer's input beside
  the token embeddings, 2 x hidden features): RMSNorm, attention (heads of head_dim, 2 x
  hidden / heads in the released models) with scores scaled by (head_dim / 2) ** -0.5 (rotary when
  ``use_mem_rope``), RMSNorm, a gated MLP (``hidden_act``, GELU by default); no residual
  inside the block. A linear map of its own (hidden -> hidden) takes the block's output,
  which is added to x before the layer's Mamba2 norm only: ``x + mixer(norm(x + t))``.
- Shared weights, per-position adapters: every block holds low-rank adapters (rank
  ``adapter_rank``) for the hybrid positions that use it, added to its gate/up
  projection and, with ``use_shared_attention_adapter``, to q, k and v.

Each hybrid layer caches its own keys and values (spindle's Attention sits in the layer,
the projections in the shared block), so the cache has one paged attention group per
hybrid layer beside the Mamba2 state slots. Checkpoint names are transformers'
(``model.layers.N.shared_transformer.*`` of the first hybrid layers using each block;
transformers does not store the tied copies, and loads the same values where a
checkpoint does); the fused gate_up projections are split into the merged layer's
shards, so tensor parallelism splits gate and up each on its own.

Numerics follow transformers' Zamba2, including one asymmetry: the step size dt is held
at or above ``time_step_min`` in the chunked scan of a prompt, and not in the one-token
update of a decode step (as mamba_ssm's Mamba2 does too).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from spindle.attention import Attention
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.embedding import VocabParallelEmbedding
from spindle.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                   QKVParallelLinear, RowParallelLinear)
from spindle.layers.mamba.mixer import MambaMixer, norm_group_size
from spindle.layers.norm import RMSNorm
from spindle.layers.rotary import RotaryEmbedding, apply_rotary
from spindle.models.causal_lm import DecoderForCausalLM, embedded
from spindle.models.llama import _to_param_name
from spindle.models.weights import load_named_weights, not_on_this_rank

MAMBA, HYBRID = "linear_attention", "hybrid"
# Older configs' names of the layer kinds.
LEGACY_KINDS = {"mamba": MAMBA}
# hidden_act -> the activation of the shared MLP's gate (transformers' ACT2FN meanings).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}
# The Mamba2 mixer's gated norm: transformers' Zamba2 fixes its epsilon.
MIXER_NORM_EPS = 1e-5


def layer_kinds(hf_config: Any) -> list[str]:
    return [LEGACY_KINDS.get(kind, kind) for kind in hf_config.layers_block_type]


def hybrid_layer_ids(hf_config: Any) -> list[int]:
    return [i for i, kind in enumerate(layer_kinds(hf_config)) if kind == HYBRID]


def attention_head_dim(hf_config: Any) -> int:
    """transformers' attention_head_dim (head_dim in config.json), 2 x hidden / heads
    where the config names none."""
    return (getattr(hf_config, "attention_head_dim", None)
            or 2 * hf_config.hidden_size // hf_config.num_attention_heads)


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    kinds = layer_kinds(hf_config)
    if len(kinds) != hf_config.num_hidden_layers:
        raise ValueError(f"layers_block_type has {len(kinds)} entries for "
                         f"{hf_config.num_hidden_layers} layers")
    unknown = sorted(set(kinds) - {MAMBA, HYBRID})
    if unknown:
        raise ValueError(f"layers_block_type holds unknown layer types {unknown} (known: "
                         f"{MAMBA!r} or 'mamba', {HYBRID!r})")
    act = getattr(hf_config, "hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported (known: {sorted(ACTIVATIONS)})")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    width = 2 * hf_config.hidden_size
    if getattr(hf_config, "use_shared_attention_adapter", False) and (
            kv_heads != heads or heads * attention_head_dim(hf_config) != width):
        raise ValueError(f"use_shared_attention_adapter needs num_key_value_heads ({kv_heads}) "
                         f"equal to num_attention_heads ({heads}) and heads of 2 * hidden_size "
                         f"/ heads features (head_dim {attention_head_dim(hf_config)}): the "
                         f"q, k and v adapters return {width} features")
    if getattr(hf_config, "num_mem_blocks", 1) < 1:
        raise ValueError(f"num_mem_blocks must be >= 1, got {hf_config.num_mem_blocks}")


def time_step_limit(hf_config: Any) -> tuple[float, float]:
    """transformers' Zamba2: dt held at or above time_step_min, no upper bound."""
    return float(getattr(hf_config, "time_step_min", 0.001)), float("inf")


def make_mixer(hf_config: Any, tp_group: TensorParallelGroup) -> MambaMixer:
    heads, groups = hf_config.n_mamba_heads, getattr(hf_config, "mamba_ngroups", 1)
    head_dim = int(hf_config.mamba_expand * hf_config.hidden_size) // heads
    if heads * head_dim != int(hf_config.mamba_expand * hf_config.hidden_size):
        raise ValueError(f"n_mamba_heads ({heads}) must divide mamba_expand * hidden_size "
                         f"({int(hf_config.mamba_expand * hf_config.hidden_size)})")
    bias = bool(getattr(hf_config, "add_bias_linear", False))
    return MambaMixer(
        hidden_size=hf_config.hidden_size, num_heads=heads, head_dim=head_dim,
        n_groups=groups, norm_group_size=norm_group_size(heads, head_dim, groups),
        state_size=hf_config.mamba_d_state, conv_kernel=hf_config.mamba_d_conv,
        chunk_size=hf_config.chunk_size, eps=MIXER_NORM_EPS,
        time_step_limit=time_step_limit(hf_config), limit_decode_steps=False,
        conv_bias=True,  # (transformers' conv1d always has one, whatever use_conv_bias says)
        proj_bias=bias, tp_group=tp_group)


def low_rank_adapter(input_size: int, rank: int, up: nn.Module) -> nn.Sequential:
    """x -> up(down(x)): the down projection replicated on every rank (it is small), the up
    projection split across ranks as the projection it adds to."""
    down = ColumnParallelLinear(input_size, rank, bias=False,
                                tp_group=TensorParallelGroup.single())
    return nn.Sequential(down, up)


class Zamba2SharedAttention(nn.Module):
    """The shared block's attention projections (and q/k/v adapters); the keys and values
    go to the calling hybrid layer's own Attention."""

    def __init__(self, hf_config: Any, positions: list[int], tp_group: TensorParallelGroup):
        super().__init__()
        width, head_dim = 2 * hf_config.hidden_size, attention_head_dim(hf_config)
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(width, head_dim, heads, kv_heads, bias=False,
                                          tp_group=tp_group)
        self.num_heads = self.qkv_proj.num_heads  # rank-local
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * head_dim, hf_config.hidden_size, bias=False,
                                        tp_group=tp_group)
        self.adapters = bool(getattr(hf_config, "use_shared_attention_adapter", False))
        if self.adapters:
            rank = hf_config.adapter_rank
            for part, heads_of_part in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                setattr(self, f"linear_{part}_adapter_list", nn.ModuleDict({
                    str(p): low_rank_adapter(width, rank, ColumnParallelLinear(
                        rank, heads_of_part * head_dim, bias=False, tp_group=tp_group))
                    for p in positions}))

    def forward(self, x: torch.Tensor, position: int, attn: Attention,
                cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(x))
        if self.adapters:
            key = str(position)
            q = q + self.linear_q_adapter_list[key](x)
            k = k + self.linear_k_adapter_list[key](x)
            v = v + self.linear_v_adapter_list[key](x)
        if cos is not None:
            tokens = x.shape[0]
            q = apply_rotary(q.reshape(tokens, self.num_heads, self.head_dim), cos, sin)
            k = apply_rotary(k.reshape(tokens, self.num_kv_heads, self.head_dim), cos, sin)
            q, k = q.reshape(tokens, -1), k.reshape(tokens, -1)
        return self.o_proj(attn(q, k, v))


class Zamba2SharedMLP(nn.Module):
    """down(act(gate) * up), gate and up from one projection plus the position's adapter."""

    def __init__(self, hf_config: Any, positions: list[int], tp_group: TensorParallelGroup):
        super().__init__()
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        bias = bool(getattr(hf_config, "add_bias_linear", False))
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias,
                                                       tp_group=tp_group)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias, tp_group=tp_group)
        self.gate_up_proj_adapter_list = nn.ModuleDict({
            str(p): low_rank_adapter(hidden, hf_config.adapter_rank, MergedColumnParallelLinear(
                hf_config.adapter_rank, [inter, inter], bias=False, tp_group=tp_group))
            for p in positions})
        self.act = ACTIVATIONS[getattr(hf_config, "hidden_act", "gelu")]

    def forward(self, x: torch.Tensor, position: int) -> torch.Tensor:
        gate_up = self.gate_up_proj(x) + self.gate_up_proj_adapter_list[str(position)](x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Zamba2SharedBlock(nn.Module):
    """One shared transformer block: its weights, and the adapters of the hybrid
    positions (indices among the hybrid layers) that use it."""

    def __init__(self, hf_config: Any, positions: list[int], tp_group: TensorParallelGroup):
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(2 * hf_config.hidden_size, eps=eps)
        self.self_attn = Zamba2SharedAttention(hf_config, positions, tp_group)
        self.pre_ff_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.feed_forward = Zamba2SharedMLP(hf_config, positions, tp_group)

    def forward(self, hidden_states: torch.Tensor, embeddings: torch.Tensor, position: int,
                attn: Attention, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> torch.Tensor:
        x = self.input_layernorm(torch.cat([hidden_states, embeddings], dim=-1))
        x = self.pre_ff_layernorm(self.self_attn(x, position, attn, cos, sin))
        return self.feed_forward(x, position)


class Zamba2MambaLayer(nn.Module):
    """x + mixer(norm(x + t)), t the hybrid layer's transformer output (or nothing)."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.mamba = make_mixer(hf_config, tp_group)

    def forward(self, hidden_states: torch.Tensor,
                transformer_out: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden_states if transformer_out is None else hidden_states + transformer_out
        return hidden_states + self.mamba(self.input_layernorm(x))


class Zamba2HybridLayer(nn.Module):
    """A shared block at this position, with this layer's own attention cache and linear
    map, then the layer's Mamba2 part."""

    def __init__(self, hf_config: Any, position: int, tp_group: TensorParallelGroup,
                 attention_shape: Zamba2SharedAttention) -> None:
        super().__init__()
        self.position = position
        self.block_index = position % getattr(hf_config, "num_mem_blocks", 1)
        head_dim = attention_shape.head_dim
        self.attn = Attention(attention_shape.num_heads, head_dim, (head_dim / 2) ** -0.5,
                              attention_shape.num_kv_heads)
        self.linear = ColumnParallelLinear(hf_config.hidden_size, hf_config.hidden_size,
                                           bias=False, tp_group=TensorParallelGroup.single())
        self.mamba_decoder = Zamba2MambaLayer(hf_config, tp_group)

    def forward(self, hidden_states: torch.Tensor, embeddings: torch.Tensor,
                blocks: nn.ModuleList, cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> torch.Tensor:
        block = blocks[self.block_index]
        t = block(hidden_states, embeddings, self.position, self.attn, cos, sin)
        return self.mamba_decoder(hidden_states, self.linear(t))


class Zamba2Model(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                                   tp_group=tp_group)
        hybrid = hybrid_layer_ids(hf_config)
        blocks = getattr(hf_config, "num_mem_blocks", 1)
        self.shared_blocks = nn.ModuleList(
            Zamba2SharedBlock(hf_config, [p for p in range(len(hybrid)) if p % blocks == b],
                              tp_group)
            for b in range(min(blocks, len(hybrid))))
        layers = []
        for i, kind in enumerate(layer_kinds(hf_config)):
            if kind == HYBRID:
                position = hybrid.index(i)
                shape = self.shared_blocks[position % blocks].self_attn
                layers.append(Zamba2HybridLayer(hf_config, position, tp_group, shape))
            else:
                layers.append(Zamba2MambaLayer(hf_config, tp_group))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.rotary_emb = None
        if getattr(hf_config, "use_mem_rope", False) and hybrid:
            self.rotary_emb = RotaryEmbedding.from_config(hf_config, attention_head_dim(hf_config))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: Any = None) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden]."""
        embeddings = embedded(self.embed_tokens, input_ids, inputs_embeds)
        cos = sin = None
        if self.rotary_emb is not None:
            cos, sin = self.rotary_emb(positions, embeddings.dtype)
        hidden_states = embeddings
        for layer in self.layers:
            if isinstance(layer, Zamba2HybridLayer):
                hidden_states = layer(hidden_states, embeddings, self.shared_blocks, cos, sin)
            else:
                hidden_states = layer(hidden_states)
        return self.final_layernorm(hidden_states)


class Zamba2ForCausalLM(DecoderForCausalLM):
    model_kind = "hybrid"
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        check_supported_config(hf_config)
        self.build_single_stage(hf_config, tp_group, stage, Zamba2Model)
        self._block_of_layer = {
            layer: position % getattr(hf_config, "num_mem_blocks", 1)
            for position, layer in enumerate(hybrid_layer_ids(hf_config))}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into this rank's parameters: a hybrid layer's
        shared_transformer.* into its block's (a tied copy loads the same values again),
        q/k/v into the merged qkv_proj, fused gate_up tensors as their two shards."""
        return load_named_weights(self, _gate_up_halves(self._copies_checked(weights)),
                                  self._param_name)

    def _copies_checked(self, weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors as they come; a second copy of a shared block's tensor (another
        hybrid layer's, which transformers writes too when it does not tie them) must
        equal the first, or the checkpoint is not a Zamba2 with shared blocks."""
        first: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
        for name, tensor in weights:
            prefix, sep, rest = name.partition(".shared_transformer.")
            layer = int(prefix.rsplit(".", 1)[1]) if sep else None
            if layer in self._block_of_layer:
                key = (self._block_of_layer[layer], rest)
                if key not in first:
                    first[key] = (name, tensor)
                elif not torch.equal(first[key][1], tensor):
                    raise ValueError(
                        f"checkpoint tensors {first[key][0]!r} and {name!r} differ, but both "
                        f"are shared block {key[0]}'s {rest!r} (hybrid layers share "
                        "num_mem_blocks blocks in turn)")
            yield name, tensor

    def _param_name(self, hf_name: str) -> tuple[str, Any] | None:
        if not_on_this_rank(self, hf_name, final_norm="final_layernorm"):
            return None
        name, half = hf_name, None
        if SHARD_MARK in name:
            name, shard = name.split(SHARD_MARK)
            half = int(shard)
        prefix, sep, rest = name.partition(".shared_transformer.")
        if sep:
            layer = int(prefix.rsplit(".", 1)[1])
            if layer not in self._block_of_layer:
                raise ValueError(f"checkpoint tensor {hf_name!r}: layer {layer} is not a "
                                 "hybrid layer")
            name = f"model.shared_blocks.{self._block_of_layer[layer]}.{rest}"
        if half is not None:
            return name, half
        return _to_param_name(name)


# Marks a fused gate/up tensor's half: name + SHARD_MARK + "0" (gate) or "1" (up).
SHARD_MARK = "#shard"


def _gate_up_halves(weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The shared MLP's fused gate_up_proj weights (and its adapters' up projections,
    [2 x intermediate, rank]) as their gate and up halves; other tensors as they are."""
    for name, tensor in weights:
        if name.endswith((".feed_forward.gate_up_proj.weight", ".feed_forward.gate_up_proj.bias")
                         ) or (".gate_up_proj_adapter_list." in name
                               and name.endswith(".1.weight")):
            gate, up = tensor.chunk(2, dim=0)
            yield name + SHARD_MARK + "0", gate
            yield name + SHARD_MARK + "1", up
        else:
            yield name, tensor
