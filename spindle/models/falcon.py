"""FalconForCausalLM (TII's Falcon 7B / 40B / 180B and the models trained with its code;
Falcon 3 is Llama's architecture): rotary attention over the whole head, LayerNorms, a
GELU MLP (``dense_h_to_4h``, ``dense_4h_to_h``), biases where ``bias`` says, an LM head
tied to the embedding by default. Three layer forms:

- ``new_decoder_architecture`` (40B, 180B): grouped-query attention (``num_kv_heads``)
  and the MLP side by side, each after its own LayerNorm (``ln_attn``, ``ln_mlp``; one
  ``input_layernorm`` for both where ``num_ln_in_parallel_attn`` is 1);
- ``parallel_attn`` (7B): multi-query attention (one key/value head, ``multi_query``)
  and the MLP side by side after one ``input_layernorm``;
- neither: attention, then the MLP after ``post_attention_layernorm``.

The checkpoint fuses q, k and v into ``query_key_value``: per key/value group (each
group's query heads, then its key and value) in the new architecture, [q | k | v] with
one key/value head under ``multi_query``, else each head's q, k and v side by side.
ALiBi Falcons (``alibi``) are refused by name."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.models.causal_lm import DecoderForCausalLM, RotaryDecoderModel, renamed
from spindle.models.gpt_neox import ACTIVATIONS, PartialRotaryAttention
from spindle.models.llama import check_activation
from spindle.models.starcoder2 import Starcoder2MLP


_RENAMES = (("transformer.word_embeddings.", "model.embed_tokens."),
            ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers."),
            (".self_attention.dense.", ".self_attention.o_proj."),
            (".mlp.dense_h_to_4h.", ".mlp.c_fc."), (".mlp.dense_4h_to_h.", ".mlp.c_proj."),
            (".ln_attn.", ".attention_norm."), (".ln_mlp.", ".mlp_norm."),
            (".input_layernorm.", ".attention_norm."))


def kv_heads_of(hf_config: Any) -> int:
    if getattr(hf_config, "new_decoder_architecture", False):
        return hf_config.num_kv_heads
    if getattr(hf_config, "multi_query", True):
        return 1
    return getattr(hf_config, "num_kv_heads", None) or hf_config.num_attention_heads


def layer_norms_of(hf_config: Any) -> int:
    """How many LayerNorms a layer has before attention and the MLP: 2 (its own for
    each: the new architecture's default, or the sequential layer's), or 1 (shared)."""
    if getattr(hf_config, "new_decoder_architecture", False):
        return getattr(hf_config, "num_ln_in_parallel_attn", None) or 2
    return 1 if getattr(hf_config, "parallel_attn", True) else 2


class FalconLayer(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.layer_norm_epsilon
        bias = bool(getattr(hf_config, "bias", False))
        self.parallel = bool(getattr(hf_config, "new_decoder_architecture", False)
                             or getattr(hf_config, "parallel_attn", True))
        self.self_attention = PartialRotaryAttention(hf_config, tp_group,
                                                     kv_heads_of(hf_config), bias=bias)
        inner = getattr(hf_config, "ffn_hidden_size", None) or 4 * hidden
        self.mlp = Starcoder2MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inner),
                                 tp_group, bias=bias,
                                 act=ACTIVATIONS[getattr(hf_config, "activation", "gelu")])
        # The norm before attention, and the MLP's own where it has one.
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps) if layer_norms_of(hf_config) == 2 \
            else None

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        normed = self.attention_norm(hidden_states)
        attended = self.self_attention(normed, cos, sin)
        if not self.parallel:
            hidden_states = attended + hidden_states
            return self.mlp(self.mlp_norm(hidden_states)) + hidden_states
        mlp_input = normed if self.mlp_norm is None else self.mlp_norm(hidden_states)
        return (self.mlp(mlp_input) + attended) + hidden_states


def falcon_model(hf_config: Any, tp_group: TensorParallelGroup) -> RotaryDecoderModel:
    return RotaryDecoderModel(
        hf_config, tp_group, lambda i: FalconLayer(hf_config, tp_group),
        nn.LayerNorm(hf_config.hidden_size, eps=hf_config.layer_norm_epsilon),
        head_dim=hf_config.hidden_size // hf_config.num_attention_heads,
        with_positions=False)


class FalconForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.build_single_stage(hf_config, tp_group, stage, falcon_model,
                                tie=bool(getattr(hf_config, "tie_word_embeddings", True)))

    @staticmethod
    def check_config(hf_config: Any) -> None:
        if getattr(hf_config, "alibi", False):
            # (Falcon-RW's bias is each slope * position rounded to bf16, as its code and
            # transformers' compute it: unlike BLOOM's exact one, off by up to a tenth
            # of a score past 256 positions.)
            raise ValueError("Falcon with ALiBi positions (alibi: Falcon-RW, whose bias is "
                             "rounded to bf16 per position) is not supported")
        check_activation(hf_config, "activation", ACTIVATIONS, default="gelu")
        if getattr(hf_config, "new_decoder_architecture", False) \
                and not getattr(hf_config, "parallel_attn", True):
            raise ValueError("Falcon's new decoder architecture without parallel_attn is "
                             "not supported")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._our_names(weights))

    def _split_qkv(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """query_key_value's rows (or bias) as q, k and v (see the module doc)."""
        config = self.config
        heads, kv_heads = config.num_attention_heads, kv_heads_of(config)
        if getattr(config, "new_decoder_architecture", False):
            grouped = tensor.unflatten(0, (kv_heads, heads // kv_heads + 2, -1))
            return (grouped[:, :-2].flatten(0, 2), grouped[:, -2].flatten(0, 1),
                    grouped[:, -1].flatten(0, 1))
        if kv_heads == 1 and getattr(config, "multi_query", True):
            head_dim = config.hidden_size // heads
            return tensor.split([config.hidden_size, head_dim, head_dim], dim=0)
        per_head = tensor.unflatten(0, (heads, 3, -1))
        return tuple(per_head[:, i].flatten(0, 1) for i in range(3))

    def _our_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        mlp_norm = ".mlp_norm." if layer_norms_of(self.config) == 2 \
            else ".post_attention_layernorm."
        for name, tensor in renamed(weights, _RENAMES + ((".post_attention_layernorm.",
                                                           mlp_norm),)):
            if ".self_attention.query_key_value." in name:
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), self._split_qkv(tensor)):
                    yield name.replace(".query_key_value.", f".{part}."), piece
            else:
                yield name, tensor
