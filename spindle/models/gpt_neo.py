"""GPTNeoForCausalLM (EleutherAI's GPT-Neo 125M-2.7B, and the TinyStories models): GPT-2's
layer shape (learned positions, LayerNorms, a GELU MLP, a tied head) with ``nn.Linear``
projections, q/k/v without biases (o with one), scores not scaled by the head size, and
layers that attend globally or within a window of ``window_size`` tokens ("local"), as
``attention_layers`` lists them."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.models.causal_lm import DecoderForCausalLM, renamed
from spindle.models.gpt2 import GPT2Attention, GPT2Block, GPT2Model
from spindle.models.gpt_neox import ACTIVATIONS
from spindle.models.llama import check_activation

_BUFFERS = (".attn.attention.bias", ".attn.attention.masked_bias")
_RENAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.wpe.", "model.wpe."),
            ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers."),
            (".attn.attention.out_proj.", ".attn.o_proj."), (".attn.attention.", ".attn."))
LAYER_KINDS = ("global", "local")


def windows_of(hf_config: Any) -> list[int | None]:
    """Each layer's window: window_size for a "local" layer, None for a "global" one."""
    kinds = list(hf_config.attention_layers)
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown or len(kinds) != hf_config.num_hidden_layers:
        raise ValueError(f"attention_layers must name {hf_config.num_hidden_layers} layers, "
                         f"each one of {LAYER_KINDS}; got {kinds}")
    return [hf_config.window_size if kind == "local" else None for kind in kinds]


class GPTNeoBlock(GPT2Block):
    """GPT-2's block with GPT-Neo's attention (no q/k/v biases, o with one, unscaled
    scores, this layer's window) and its MLP width field."""

    inner_size_field = "intermediate_size"

    @staticmethod
    def make_attention(hf_config: Any, layer_idx: int,
                       tp_group: TensorParallelGroup) -> nn.Module:
        return GPT2Attention(hf_config, layer_idx, tp_group, bias=False, o_bias=True,
                             scale=1.0, sliding_window=windows_of(hf_config)[layer_idx])


class GPTNeoForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.build_single_stage(
            hf_config, tp_group, stage,
            lambda config, group: GPT2Model(config, group, block=GPTNeoBlock),
            tie=bool(getattr(hf_config, "tie_word_embeddings", True)))

    @staticmethod
    def check_config(hf_config: Any) -> None:
        check_activation(hf_config, "activation_function", ACTIVATIONS)
        windows_of(hf_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(renamed(weights, _RENAMES, skip=_BUFFERS))
