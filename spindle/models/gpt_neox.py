"""GPTNeoXForCausalLM (EleutherAI's GPT-NeoX-20B and the Pythia suite, and the models
trained with their code): LayerNorms with biases; attention with biases whose rotary
turns the first ``partial_rotary_factor`` of each head (``rotary_pct``, a quarter by
default) the rotate-half way; a plain GELU MLP; and by default the "parallel residual"
layer, where attention and the MLP both read the layer's input through their own norms
and their outputs join the residual stream together (``use_parallel_residual``).

The checkpoint fuses q, k and v into ``query_key_value`` with each head's q, k and v
rows side by side ([heads, 3, head_dim] rows); they are split at load into the merged
projection's shards. The head (``embed_out``) is not tied to the embedding."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from spindle.attention.layer import Attention
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.linear import QKVParallelLinear, RowParallelLinear
from spindle.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from spindle.models.bamba import apply_partial_rotary
from spindle.models.causal_lm import DecoderForCausalLM, RotaryDecoderModel, renamed
from spindle.models.llama import check_activation, head_dim_of
from spindle.models.starcoder2 import Starcoder2MLP

# HF's names for the exact GELU and its tanh approximations (gelu_new and gelu_fast are
# the tanh formula written two ways).
ACTIVATIONS = {"gelu": F.gelu,
               **{name: (lambda x: F.gelu(x, approximate="tanh"))
                  for name in ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")}}
# Tensors of older checkpoints that are buffers, not weights (the causal mask, the
# rotary frequencies).
_BUFFERS = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
_RENAMES = (("gpt_neox.embed_in.", "model.embed_tokens."),
            ("gpt_neox.final_layer_norm.", "model.norm."), ("gpt_neox.layers.", "model.layers."),
            ("embed_out.", "lm_head."), (".attention.dense.", ".self_attn.o_proj."),
            (".mlp.dense_h_to_4h.", ".mlp.c_fc."), (".mlp.dense_4h_to_h.", ".mlp.c_proj."))


def rotary_dim(hf_config: Any) -> int:
    factor = rope_parameters_from_config(hf_config).get(
        "partial_rotary_factor", getattr(hf_config, "rotary_pct", 1.0))
    return int(head_dim_of(hf_config) * factor)


def partial_rotary_table(hf_config: Any) -> RotaryEmbedding:
    """The rotary table of the rotated features only (rotary_dim of each head)."""
    params = dict(rope_parameters_from_config(hf_config))
    params.pop("partial_rotary_factor", None)
    return RotaryEmbedding(rotary_dim(hf_config), hf_config.max_position_embeddings, params)


def check_rotary_dim(hf_config: Any) -> None:
    if rotary_dim(hf_config) % 2:
        raise ValueError(f"the rotary turns {rotary_dim(hf_config)} features of each head; "
                         "it needs an even number")


class PartialRotaryAttention(nn.Module):
    """Attention whose rotary turns the first features of each head (the step's table
    says how many); bias: on q, k, v (and o, unless o_bias says otherwise); qk_norm_eps:
    a LayerNorm on each head of q and k first (Phi's ``qk_layernorm``); clip_qkv: q, k
    and v clamped to [-clip_qkv, clip_qkv] (OLMo's); sliding_window: the layer's window
    (Phi-3's)."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup, num_kv_heads: int,
                 bias: bool, qk_norm_eps: float | None = None,
                 o_bias: bool | None = None, clip_qkv: float | None = None,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        heads = hf_config.num_attention_heads
        self.head_dim = head_dim_of(hf_config)
        self.qkv_proj = QKVParallelLinear(hf_config.hidden_size, self.head_dim, heads,
                                          num_kv_heads, bias=bias, tp_group=tp_group)
        self.num_heads = self.qkv_proj.num_heads  # rank-local
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * self.head_dim, hf_config.hidden_size,
                                        bias=bias if o_bias is None else o_bias,
                                        tp_group=tp_group)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads, sliding_window=sliding_window)
        self.clip_qkv = clip_qkv
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = nn.LayerNorm(self.head_dim, eps=qk_norm_eps)
            self.k_norm = nn.LayerNorm(self.head_dim, eps=qk_norm_eps)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = self.qkv_proj.split_qkv(qkv)
        q = q.reshape(q.shape[0], self.num_heads, self.head_dim)
        k = k.reshape(k.shape[0], self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_partial_rotary(q, cos, sin).flatten(1)
        k = apply_partial_rotary(k, cos, sin).flatten(1)
        return self.o_proj(self.attn(q, k, v))


class GPTNeoXLayer(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps = hf_config.layer_norm_eps
        self.parallel_residual = bool(getattr(hf_config, "use_parallel_residual", True))
        self.input_layernorm = nn.LayerNorm(hf_config.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(hf_config.hidden_size, eps=eps)
        self.self_attn = PartialRotaryAttention(
            hf_config, tp_group, hf_config.num_attention_heads,
            bool(getattr(hf_config, "attention_bias", True)))
        self.mlp = Starcoder2MLP(hf_config, tp_group, bias=True,
                                 act=ACTIVATIONS[hf_config.hidden_act])

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden_states), cos, sin)
        if self.parallel_residual:  # (summed in transformers' order)
            return self.mlp(self.post_attention_layernorm(hidden_states)) + attended \
                + hidden_states
        hidden_states = attended + hidden_states
        return self.mlp(self.post_attention_layernorm(hidden_states)) + hidden_states


class PreNormRotaryLayer(nn.Module):
    """x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x)): the
    sequential layer of the families below, which build the four parts."""

    input_layernorm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states),
                                                       cos, sin)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def layer_norm_rotary_model(layer: Callable[[Any, TensorParallelGroup], nn.Module]
                            ) -> Callable[[Any, TensorParallelGroup], RotaryDecoderModel]:
    """The model builder of a family whose layers are layer(hf_config, tp_group), with a
    final LayerNorm of ``layer_norm_eps`` and the partial rotary table (GPT-NeoX's, Phi's,
    StableLM's)."""
    def build(hf_config: Any, tp_group: TensorParallelGroup) -> RotaryDecoderModel:
        return RotaryDecoderModel(
            hf_config, tp_group, lambda i: layer(hf_config, tp_group),
            nn.LayerNorm(hf_config.hidden_size, eps=hf_config.layer_norm_eps),
            rotary=partial_rotary_table(hf_config), with_positions=False)

    return build


class GPTNeoXForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.build_single_stage(hf_config, tp_group, stage,
                                layer_norm_rotary_model(GPTNeoXLayer))

    @staticmethod
    def check_config(hf_config: Any) -> None:
        check_activation(hf_config, "hidden_act", ACTIVATIONS)
        check_rotary_dim(hf_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._our_names(weights))

    def checkpoint_renames(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The renaming load_weights applies before param_name (what LoRA adapters'
        module names and B rows go through, lora/layers.py)."""
        return self._our_names(weights)

    def _our_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """GPT-NeoX's checkpoint names as the Llama-style ones this model's parameters
        load from; query_key_value split into q, k and v; the buffers skipped."""
        heads = self.config.num_attention_heads
        for name, tensor in renamed(weights, _RENAMES, skip=_BUFFERS):
            if ".attention.query_key_value." in name:
                per_head = tensor.unflatten(0, (heads, 3, -1))
                for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                    yield (name.replace(".attention.query_key_value.", f".self_attn.{part}."),
                           per_head[:, i].flatten(0, 1))
            else:
                yield name, tensor
