"""GPTNeoForCausalLM (EleutherAI's GPT-Neo 125M-2.7B, and the TinyStories models): GPT-2's
layer shape (learned positions, LayerNorms, a GELU MLP, a tied head) with ``nn.Linear``
projections, q/k/v without biases (o with one), scores not scaled by the head size, and
layers that attend globally or within a window of ``window_size`` tokens ("local"), as
``attention_layers`` lists them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.models.causal_lm import DecoderForCausalLM
from spindle.models.gpt2 import GPT2Attention, GPT2Model
from spindle.models.gpt_neox import ACTIVATIONS
from spindle.models.starcoder2 import Starcoder2MLP

_BUFFERS = (".attn.attention.bias", ".attn.attention.masked_bias")
LAYER_KINDS = ("global", "local")


def windows_of(hf_config: Any) -> list[int | None]:
    """Each layer's window: window_size for a "local" layer, None for a "global" one."""
    kinds = list(hf_config.attention_layers)
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown or len(kinds) != hf_config.num_hidden_layers:
        raise ValueError(f"attention_layers must name {hf_config.num_hidden_layers} layers, "
                         f"each one of {LAYER_KINDS}; got {kinds}")
    return [hf_config.window_size if kind == "local" else None for kind in kinds]


class GPTNeoBlock(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps, hidden = hf_config.layer_norm_epsilon, hf_config.hidden_size
        inner = getattr(hf_config, "intermediate_size", None) or 4 * hidden
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = GPT2Attention(hf_config, layer_idx, tp_group, bias=False, o_bias=True,
                                  scale=1.0, sliding_window=windows_of(hf_config)[layer_idx])
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = Starcoder2MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=inner),
                                 tp_group, bias=True,
                                 act=ACTIVATIONS[hf_config.activation_function])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.attn(self.ln_1(hidden_states)) + hidden_states
        return self.mlp(self.ln_2(hidden_states)) + hidden_states


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
        if hf_config.activation_function not in ACTIVATIONS:
            raise ValueError(f"activation_function {hf_config.activation_function!r} is not "
                             f"supported (known: {sorted(ACTIVATIONS)})")
        windows_of(hf_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._our_names(weights))

    @staticmethod
    def _our_names(weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(_BUFFERS):
                continue
            yield (name.replace("transformer.wte.", "model.embed_tokens.")
                   .replace("transformer.wpe.", "model.wpe.")
                   .replace("transformer.ln_f.", "model.norm.")
                   .replace("transformer.h.", "model.layers.")
                   .replace(".attn.attention.out_proj.", ".attn.o_proj.")
                   .replace(".attn.attention.", ".attn.")), tensor
