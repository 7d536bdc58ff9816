"""What every decoder's outer class shares: the inner model (``self.model``) run over a
step's flat tokens, its embedding, and the LM head that the last pipeline stage holds
(tied to the embedding when the config says so)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import IntermediateTensors, PipelineStage
from spindle.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spindle.models.weights import load_named_weights, not_on_this_rank


def single_stage(model_name: str, stage: PipelineStage | None) -> PipelineStage:
    """The one stage of a model that does not split into pipeline stages; ValueError
    where a pipeline of several was asked for."""
    if stage is not None and stage.size > 1:
        raise ValueError(f"{model_name} does not support pipeline parallelism")
    return PipelineStage.single()


def embedded(embed_tokens: nn.Module, input_ids: torch.Tensor | None,
             inputs_embeds: torch.Tensor | None) -> torch.Tensor:
    """The step's input embeddings: embed_tokens(input_ids), or inputs_embeds as given
    (ValueError unless exactly one of the two is passed)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    return embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds


def renamed(weights: Iterable[tuple[str, torch.Tensor]],
            renames: Iterable[tuple[str, str]], skip: tuple[str, ...] = ()
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors under this model's names: each (theirs, ours) replaced in
    order; names ending in skip (buffers of older checkpoints) left out."""
    renames = tuple(renames)
    for name, tensor in weights:
        if skip and name.endswith(skip):
            continue
        for theirs, ours in renames:
            name = name.replace(theirs, ours)
        yield name, tensor


class MissingLayer(nn.Identity):
    """Placeholder for a layer another pipeline stage owns (no parameters)."""


def stage_layers(stage: PipelineStage, num_layers: int,
                 build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """build(i) for the layers this stage owns, a MissingLayer for the others: layer
    indices stay global, so checkpoint names map unchanged on every stage."""
    return nn.ModuleList(build(i) if stage.owns_layer(i) else MissingLayer()
                         for i in range(num_layers))


def stage_embedding(hf_config: Any, stage: PipelineStage,
                    tp_group: TensorParallelGroup) -> VocabParallelEmbedding | None:
    """The token embedding where this stage needs one: on the first stage, and on the
    last when the LM head is tied to it; None elsewhere."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if stage.is_first or (stage.is_last and tied):
        return VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                      tp_group=tp_group)
    return None


class DecoderForCausalLM(nn.Module):
    """Subclasses build ``self.model`` (with ``embed_tokens``), then call build_lm_head."""

    model: nn.Module
    lm_head: ParallelLMHead | None
    # The head's bias over the whole vocabulary (checkpoint ``lm_head.bias``: Phi, GPT-J),
    # the same on every rank: it is added to the gathered logits. Absent: no bias. (No
    # class default: a class attribute would hide the registered parameter.)
    lm_head_bias: nn.Parameter
    stage: PipelineStage

    def build_single_stage(self, hf_config: Any, tp_group: TensorParallelGroup,
                           stage: PipelineStage | None,
                           make_model: Callable[[Any, TensorParallelGroup], nn.Module],
                           tie: bool | None = None, head_bias: bool = False) -> None:
        """The whole model in one pipeline stage (a pipeline of several refused by
        name): stage, config, tp_group, make_model(hf_config, tp_group) as self.model,
        and the head (tie, head_bias: as build_lm_head's tie and bias)."""
        self.stage = single_stage(type(self).__name__, stage)
        self.config = hf_config
        self.tp_group = tp_group
        self.model = make_model(hf_config, tp_group)
        self.build_lm_head(hf_config, tp_group, tie=tie, bias=head_bias)

    def build_lm_head(self, hf_config: Any, tp_group: TensorParallelGroup,
                      tie: bool | None = None, bias: bool = False) -> None:
        """tie: whether the head shares the embedding (default: the config's
        tie_word_embeddings); bias: a head with a bias (lm_head_bias)."""
        if tie is None:
            tie = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.tie_word_embeddings = tie
        self.lm_head = None
        if self.stage.is_last:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                          tp_group=tp_group)
            if self.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)
            if bias:
                self.lm_head_bias = nn.Parameter(torch.zeros(hf_config.vocab_size),
                                                 requires_grad=False)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: IntermediateTensors | None = None,
                ) -> torch.Tensor | IntermediateTensors:
        """-> final-normed hidden states [T, hidden] (IntermediateTensors on a stage
        other than the last)."""
        return self.model(input_ids, positions, inputs_embeds, intermediate_tensors)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab_size], the full vocabulary on every rank."""
        logits = self.lm_head.compute_logits(hidden_states)
        bias = getattr(self, "lm_head_bias", None)
        return logits if bias is None else logits + bias.to(logits.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into this rank's parameters.

        Returns the names of the parameters that are completely loaded (merged
        parameters only once every shard arrived). Raises ValueError on a checkpoint
        tensor that matches no parameter, or whose shape does not fit.
        """
        return load_named_weights(
            self, weights,
            lambda hf_name: None if self._skip_checkpoint_tensor(hf_name)
            else self.param_name(hf_name))

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        """The parameter and shard id an HF checkpoint tensor loads into (q/k/v and
        gate/up into their merged parameters)."""
        from spindle.models.llama import _to_param_name

        return _to_param_name(hf_name)

    def _skip_checkpoint_tensor(self, hf_name: str) -> bool:
        """Whether this rank loads nothing of hf_name (another pipeline stage's layer, a
        tied head)."""
        return not_on_this_rank(self, hf_name)


class RotaryDecoderModel(nn.Module):
    """A decoder's inner model whose layers take the step's rotary tables and return the
    next hidden states, the tables read once per step and rotated in torch on every
    device (Cohere's, StarCoder2's, GPT-NeoX's and the other LayerNorm families'): the
    embedding, the layers make_layer(i), the final norm. The table: the config's over
    head_dim features, or the given rotary (a partial one). Layers are called
    layer(hidden_states, positions, cos, sin), or without positions where
    with_positions is false."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 make_layer: Callable[[int], nn.Module], norm: nn.Module,
                 head_dim: int | None = None, rotary: nn.Module | None = None,
                 with_positions: bool = True) -> None:
        from spindle.layers.rotary import RotaryEmbedding

        super().__init__()
        if (head_dim is None) == (rotary is None):
            raise ValueError("pass exactly one of head_dim and rotary")
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                                   tp_group=tp_group)
        self.layers = nn.ModuleList(make_layer(i) for i in range(hf_config.num_hidden_layers))
        self.norm = norm
        self.rotary_emb = rotary or RotaryEmbedding.from_config(hf_config, head_dim)
        self.with_positions = with_positions

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: Any = None) -> torch.Tensor:
        hidden_states = embedded(self.embed_tokens, input_ids, inputs_embeds)
        cos, sin = self.rotary_emb(positions, hidden_states.dtype)
        for layer in self.layers:
            if self.with_positions:
                hidden_states = layer(hidden_states, positions, cos, sin)
            else:
                hidden_states = layer(hidden_states, cos, sin)
        return self.norm(hidden_states)
