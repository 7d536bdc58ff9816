"""OPTForCausalLM (Meta's OPT 125M to 66B, and the models built on it): learned
positions whose table is offset by two rows (position p reads row p + 2), LayerNorms
before attention and the MLP (or after them, ``do_layer_norm_before`` false: OPT-350M),
attention with biases and no rotary, a ReLU MLP (``fc1``, ``fc2``), and an LM head tied
to the embedding. Where the embedding is narrower than the model
(``word_embed_proj_dim``, OPT-350M), ``project_in`` widens each token's embedding and
``project_out`` narrows the final hidden states for the head."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.embedding import VocabParallelEmbedding
from spindle.models.causal_lm import DecoderForCausalLM, embedded, renamed, single_stage
from spindle.models.gpt2 import GPT2Attention
from spindle.models.gpt_neox import ACTIVATIONS as GELUS
from spindle.models.llama import check_activation
from spindle.models.starcoder2 import Starcoder2MLP

ACTIVATIONS = {**GELUS, "relu": F.relu}
POSITION_OFFSET = 2  # OPT's table holds two rows before position 0
_RENAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".fc1.", ".mlp.c_fc."),
            (".fc2.", ".mlp.c_proj."))


def embed_width(hf_config: Any) -> int:
    return getattr(hf_config, "word_embed_proj_dim", None) or hf_config.hidden_size


class OPTLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        affine = bool(getattr(hf_config, "layer_norm_elementwise_affine", True))
        bias = bool(getattr(hf_config, "enable_bias", True))
        self.norm_first = bool(getattr(hf_config, "do_layer_norm_before", True))
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.self_attn = GPT2Attention(hf_config, layer_idx, tp_group, bias=bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.mlp = Starcoder2MLP(SimpleNamespace(hidden_size=hidden,
                                                 intermediate_size=hf_config.ffn_dim),
                                 tp_group, bias=bias,
                                 act=ACTIVATIONS[hf_config.activation_function])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.norm_first:
            hidden_states = hidden_states + self.self_attn(self.self_attn_layer_norm(hidden_states))
            return hidden_states + self.mlp(self.final_layer_norm(hidden_states))
        hidden_states = self.self_attn_layer_norm(hidden_states + self.self_attn(hidden_states))
        return self.final_layer_norm(hidden_states + self.mlp(hidden_states))


class OPTModel(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, width = hf_config.hidden_size, embed_width(hf_config)
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, width,
                                                   tp_group=tp_group)
        # (Replicated on every rank: one row per position is read.)
        self.embed_positions = nn.Embedding(hf_config.max_position_embeddings
                                            + POSITION_OFFSET, hidden)
        self.project_in = nn.Linear(width, hidden, bias=False) if width != hidden else None
        self.project_out = nn.Linear(hidden, width, bias=False) if width != hidden else None
        self.layers = nn.ModuleList(OPTLayer(hf_config, i, tp_group)
                                    for i in range(hf_config.num_hidden_layers))
        self.final_layer_norm = None
        if getattr(hf_config, "do_layer_norm_before", True) \
                and not getattr(hf_config, "_remove_final_layer_norm", False):
            self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=bool(
                getattr(hf_config, "layer_norm_elementwise_affine", True)))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: Any = None) -> torch.Tensor:
        hidden_states = embedded(self.embed_tokens, input_ids, inputs_embeds)
        if self.project_in is not None:
            hidden_states = self.project_in(hidden_states)
        hidden_states = hidden_states + self.embed_positions(
            positions + POSITION_OFFSET).to(hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states


class OPTForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        self.stage = single_stage(type(self).__name__, stage)
        self.config = hf_config
        self.tp_group = tp_group
        self.model = OPTModel(hf_config, tp_group)
        # The head reads the (projected) final states: as wide as the embedding.
        self.build_lm_head(SimpleNamespace(vocab_size=hf_config.vocab_size,
                                           hidden_size=embed_width(hf_config)), tp_group,
                           tie=bool(getattr(hf_config, "tie_word_embeddings", True)))

    @staticmethod
    def check_config(hf_config: Any) -> None:
        check_activation(hf_config, "activation_function", ACTIVATIONS)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._our_names(weights))

    @staticmethod
    def _our_names(weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """OPT's names (``model.decoder.*``, or ``decoder.*`` in older checkpoints) as
        this model's."""
        for name, tensor in renamed(weights, _RENAMES):
            name = name.removeprefix("model.")
            if name.startswith("decoder."):
                name = "model." + name[len("decoder."):]
            yield name, tensor
