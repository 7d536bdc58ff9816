"""MptForCausalLM (MosaicML's MPT-7B and MPT-30B, with their Instruct, Chat and
StoryWriter fine-tunes): ALiBi instead of position embeddings, pre-norm layers with
LayerNorms without biases, projections without biases (q, k and v fused as [q | k | v],
optionally clamped), a plain GELU MLP four times as wide, a final LayerNorm and an LM
head tied to the embedding.

transformers' port leaves several of MPT's options out (it builds the model above
whatever they say); a checkpoint that sets one otherwise is refused by name rather
than served differently from its reference. The one it ignores that is only numbers,
``alibi_bias_max``, is followed here (transformers always takes 8, every released
model's value). ``max_seq_len`` bounds the context (65k for StoryWriter)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from spindle.attention.alibi import mpt_slopes
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.embedding import VocabParallelEmbedding
from spindle.models.causal_lm import DecoderForCausalLM, embedded, renamed
from spindle.models.gpt2 import GPT2Attention
from spindle.models.starcoder2 import Starcoder2MLP

_RENAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.blocks.", "model.layers."),
            ("transformer.norm_f.", "model.norm."), (".attn.out_proj.", ".attn.o_proj."),
            (".ffn.up_proj.", ".ffn.c_fc."), (".ffn.down_proj.", ".ffn.c_proj."))
# MPT options transformers does not build, and the value it builds as if they had.
_AS_TRANSFORMERS_BUILDS = {"expansion_ratio": 4, "no_bias": True, "logit_scale": None}
_ATTENTION_AS_TRANSFORMERS_BUILDS = {"alibi": True, "qk_ln": False, "prefix_lm": False,
                                     "attn_uses_sequence_id": False}


def attention_option(hf_config: Any, name: str, default: Any = None) -> Any:
    """A field of MPT's ``attn_config`` (a sub-config, or a dict where the config was
    read without transformers)."""
    attn = getattr(hf_config, "attn_config", None) or {}
    return attn.get(name, default) if isinstance(attn, dict) else getattr(attn, name, default)


class MptBlock(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.layer_norm_epsilon
        max_bias = attention_option(hf_config, "alibi_bias_max", 8)
        self.norm_1 = nn.LayerNorm(hidden, eps=eps, bias=False)
        self.attn = GPT2Attention(hf_config, layer_idx, tp_group, bias=False,
                                  scale=attention_option(hf_config, "softmax_scale"),
                                  alibi=lambda heads: mpt_slopes(heads, max_bias),
                                  clip_qkv=attention_option(hf_config, "clip_qkv"))
        self.norm_2 = nn.LayerNorm(hidden, eps=eps, bias=False)
        self.ffn = Starcoder2MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=4 * hidden),
                                 tp_group, bias=False, act=F.gelu)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.attn(self.norm_1(hidden_states)) + hidden_states
        return self.ffn(self.norm_2(hidden_states)) + hidden_states


class MptModel(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hidden,
                                                   tp_group=tp_group)
        self.layers = nn.ModuleList(MptBlock(hf_config, i, tp_group)
                                    for i in range(hf_config.num_hidden_layers))
        self.norm = nn.LayerNorm(hidden, eps=hf_config.layer_norm_epsilon, bias=False)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: Any = None) -> torch.Tensor:
        """(positions unused: ALiBi reads them from the attention metadata.)"""
        hidden_states = embedded(self.embed_tokens, input_ids, inputs_embeds)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class MptForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.build_single_stage(hf_config, tp_group, stage, MptModel,
                                tie=bool(getattr(hf_config, "tie_word_embeddings", True)))

    @staticmethod
    def check_config(hf_config: Any) -> None:
        for name, built in _AS_TRANSFORMERS_BUILDS.items():
            value = getattr(hf_config, name, built)
            if value != built:
                raise ValueError(f"MPT with {name}={value!r} is not supported (only "
                                 f"{built!r}, as transformers builds every MPT model)")
        for name, built in _ATTENTION_AS_TRANSFORMERS_BUILDS.items():
            value = attention_option(hf_config, name, built)
            if value != built:
                raise ValueError(f"MPT with attn_config.{name}={value!r} is not supported "
                                 f"(only {built!r}, as transformers builds every MPT model)")

    @staticmethod
    def max_model_len(hf_config: Any) -> int:
        """The longest context: ``max_seq_len`` (MPT has no max_position_embeddings)."""
        return int(getattr(hf_config, "max_seq_len", None) or 2048)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._our_names(weights))

    def _our_names(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """MPT's names as this model's; Wqkv split into q, k and v ([q | k | v])."""
        for name, tensor in renamed(weights, _RENAMES):
            if ".attn.Wqkv." in name:
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                    yield name.replace(".attn.Wqkv.", f".attn.{part}."), piece
                continue
            yield name, tensor
