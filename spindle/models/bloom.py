"""BloomForCausalLM (BigScience's BLOOM and BLOOMZ, 560M to 176B parameters): no
position embedding but ALiBi (attention/alibi.py), a LayerNorm right after the token
embedding, pre-norm layers with LayerNorms and biases, an MLP four times as wide with
BLOOM's tanh-approximated GELU, a final LayerNorm and an LM head tied to the embedding.
With ``apply_residual_connection_post_layernorm`` each residual branch starts from the
normed input rather than the input (no released checkpoint sets it).

The fused ``query_key_value`` interleaves each head's q, k and v rows ([heads, 3,
head_dim]): split at load. Checkpoint names come with or without ``transformer.``.
``pretraining_tp`` with ``slow_but_exact`` only splits transformers' output projection
into slices (another rounding of the same sum): read and ignored."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.attention.alibi import bloom_slopes
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.embedding import VocabParallelEmbedding
from spindle.models.causal_lm import DecoderForCausalLM, embedded, renamed
from spindle.models.gpt2 import GPT2Attention
from spindle.models.starcoder2 import Starcoder2MLP

# (after "transformer." is dropped; the embedding's norm before the embedding)
_RENAMES = (("word_embeddings_layernorm.", "model.embed_norm."),
            ("word_embeddings.", "model.embed_tokens."), ("ln_f.", "model.norm."),
            ("h.", "model.layers."))
_LAYER_RENAMES = ((".self_attention.dense.", ".self_attention.o_proj."),
                  (".mlp.dense_h_to_4h.", ".mlp.c_fc."), (".mlp.dense_4h_to_h.", ".mlp.c_proj."))


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """BLOOM's GELU: the tanh approximation with its own rounded constant."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BloomBlock(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attention = GPT2Attention(hf_config, layer_idx, tp_group, alibi=bloom_slopes)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = Starcoder2MLP(SimpleNamespace(hidden_size=hidden, intermediate_size=4 * hidden),
                                 tp_group, bias=True, act=bloom_gelu)
        self.residual_from_norm = bool(
            getattr(hf_config, "apply_residual_connection_post_layernorm", False))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        hidden_states = self.self_attention(normed) + (
            normed if self.residual_from_norm else hidden_states)
        normed = self.post_attention_layernorm(hidden_states)
        return self.mlp(normed) + (normed if self.residual_from_norm else hidden_states)


class BloomModel(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.layer_norm_epsilon
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hidden,
                                                   tp_group=tp_group)
        self.embed_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(BloomBlock(hf_config, i, tp_group)
                                    for i in range(hf_config.num_hidden_layers))
        self.norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: Any = None) -> torch.Tensor:
        """(positions unused: ALiBi reads them from the attention metadata.) Given
        embeddings go through the embedding's norm too, as in transformers."""
        hidden_states = self.embed_norm(embedded(self.embed_tokens, input_ids, inputs_embeds))
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


class BloomForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.build_single_stage(hf_config, tp_group, stage, BloomModel,
                                tie=bool(getattr(hf_config, "tie_word_embeddings", True)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._our_names(weights))

    def _our_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """BLOOM's names as this model's; query_key_value split into q, k and v."""
        heads = self.config.num_attention_heads
        for name, tensor in renamed(weights, _LAYER_RENAMES):
            name = name.removeprefix("transformer.")
            if not name.startswith("lm_head."):
                name = next(ours + name[len(theirs):] for theirs, ours in
                            (*_RENAMES, ("", "model.")) if name.startswith(theirs))
            if ".self_attention.query_key_value." in name:
                per_head = tensor.unflatten(0, (heads, 3, -1))
                for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                    yield (name.replace(".query_key_value.", f".{part}."),
                           per_head[:, i].flatten(0, 1))
                continue
            yield name, tensor
