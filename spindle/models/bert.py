"""Bidirectional encoders for embeddings: BertModel, RobertaModel, XLMRobertaModel.

Post-norm blocks (x = LN(x + attn(x)); x = LN(x + mlp(x))) over word + position +
token-type embeddings. Tokens arrive packed, whole sequences one after another
([T] ids, [T] positions from 0); attention is full within each sequence and never
across (spindle.attention.encoder). There is no KV cache and no LM head: these are
`model_kind = "encoder"` models, served by EncoderOnlyModelState and a pooler.

RoBERTa and XLM-R differ from BERT only in their positions, which start at
pad_token_id + 1 (HF derives them from the non-padding tokens; the packed layout
has no padding, so the offset is a constant). All segments are token type 0.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from spindle.attention.encoder import EncoderAttention
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.embedding import VocabParallelEmbedding
from spindle.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from spindle.models.weights import load_named_weights

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Checkpoint prefixes of task heads built on these encoders (BertForMaskedLM saves "bert.").
_PREFIXES = ("bert.", "roberta.", "model.")
# Checkpoint tensors an embedding model does not use: the NSP/pooler head, MLM heads,
# and position/type id buffers that old checkpoints saved.
_UNUSED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup, position_offset: int) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(hf_config.vocab_size, hidden,
                                                      tp_group=tp_group)
        self.position_embeddings = nn.Embedding(hf_config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(getattr(hf_config, "type_vocab_size", 2), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=hf_config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        x = x + self.token_type_embeddings.weight[0]  # single-segment inputs: type 0
        x = x + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(x)


class BertAttention(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        heads = hf_config.num_attention_heads
        head_dim = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads, bias=True,
                                          tp_group=tp_group)
        self.attn = EncoderAttention(self.qkv_proj.num_heads, head_dim, head_dim ** -0.5,
                                     self.qkv_proj.num_kv_heads)
        self.output = _DenseAddNorm(hidden, hidden, hf_config, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(x))
        return self.output(self.attn(q, k, v), x)


class _DenseAddNorm(nn.Module):
    """LayerNorm(residual + dense(x)): the output half of every BERT sub-block."""

    def __init__(self, in_features: int, hidden: int, hf_config: Any,
                 tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_features, hidden, bias=True, tp_group=tp_group)
        self.LayerNorm = nn.LayerNorm(hidden, eps=hf_config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class BertIntermediate(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(hf_config.hidden_size, hf_config.intermediate_size,
                                          bias=True, tp_group=tp_group)
        self.act = _ACTIVATIONS[hf_config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.attention = BertAttention(hf_config, tp_group)
        self.intermediate = BertIntermediate(hf_config, tp_group)
        self.output = _DenseAddNorm(hf_config.intermediate_size, hf_config.hidden_size,
                                    hf_config, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hf_config, tp_group)
                                   for _ in range(hf_config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    act = getattr(hf_config, "hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
    kind = getattr(hf_config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"position_embedding_type {kind!r} is not supported (only 'absolute')")
    if getattr(hf_config, "is_decoder", False):
        raise ValueError("BERT configured as a decoder (is_decoder=True) is not supported")


class BertModel(nn.Module):
    """forward(input_ids [T], positions [T]) -> last hidden states [T, hidden] (what HF
    calls last_hidden_state, without padding)."""

    model_kind = "encoder"

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        check_supported_config(hf_config)
        self.config = hf_config
        self.embeddings = BertEmbeddings(hf_config, tp_group, self.position_offset(hf_config))
        self.encoder = BertEncoder(hf_config, tp_group)

    @classmethod
    def position_offset(cls, hf_config: Any) -> int:
        return 0

    @classmethod
    def max_model_len(cls, hf_config: Any) -> int:
        """Longest sequence the position table can hold."""
        return hf_config.max_position_embeddings - cls.position_offset(hf_config)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        return self.encoder(self.embeddings(input_ids, positions, inputs_embeds))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings.word_embeddings(input_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; returns the completely loaded
        names. Raises ValueError on a tensor that matches no parameter or does not fit."""
        return load_named_weights(self, weights, _map_checkpoint_name)


class RobertaModel(BertModel):
    @classmethod
    def position_offset(cls, hf_config: Any) -> int:
        return getattr(hf_config, "pad_token_id", 1) + 1


class XLMRobertaModel(RobertaModel):
    pass


def _strip_prefix(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


_QKV = {"attention.self.query.": "q", "attention.self.key.": "k", "attention.self.value.": "v"}


def _to_param_name(name: str) -> tuple[str, Any]:
    """encoder.layer.0.attention.self.key.weight -> (encoder.layer.0.attention.qkv_proj.weight, "k")."""
    for part, shard_id in _QKV.items():
        if part in name:
            return name.replace(part, "attention.qkv_proj."), shard_id
    return name, None


def _map_checkpoint_name(hf_name: str):
    """HF tensor name -> (parameter name, shard id), or None for unused tensors."""
    name = _strip_prefix(hf_name)
    if name.startswith(_UNUSED):
        return None
    return _to_param_name(name)
