"""Mamba2ForCausalLM: a pure state-space model, every layer a Mamba2 mixer (no attention,
no MLP, no positions).

Each block is ``x + mixer(norm(x))``; the model ends with ``norm_f`` and the LM head
(tied to the embedding when the config says so, as the state-spaces checkpoints do).
The mixer is spindle/layers/mamba/mixer.py's, so the model caches one conv state and
one SSM state per sequence and nothing paged.

Numerics follow transformers' Mamba2: the gated RMSNorm takes its mean square over the
whole intermediate width (transformers' MambaRMSNormGated, whatever n_groups), and with
``residual_in_fp32`` (the default) the residual stream is float32 while each block's
norm reads it rounded to the model's dtype. Checkpoint names are transformers'
(``backbone.embeddings`` / ``backbone.layers.N.mixer.*`` / ``backbone.norm_f``); the
original ``backbone.embedding`` spelling loads too.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spindle.layers.mamba.mixer import MambaMixer, norm_group_size, time_step_limit
from spindle.layers.norm import RMSNorm, rms_normalized
from spindle.models.causal_lm import embedded, single_stage
from spindle.models.weights import load_named_weights


# The longest sequence a model without positions accepts when its config names none.
NO_POSITIONS_LIMIT = 1 << 20


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    inter = intermediate_size(hf_config)
    if hf_config.num_heads * hf_config.head_dim != inter:
        raise ValueError(f"num_heads ({hf_config.num_heads}) * head_dim ({hf_config.head_dim}) "
                         f"must equal expand * hidden_size ({inter})")
    time_step_limit(hf_config)  # (refuses a bad one)


def intermediate_size(hf_config: Any) -> int:
    return int(getattr(hf_config, "expand", 2) * hf_config.hidden_size)


def mamba2_mixer(hf_config: Any, tp_group: TensorParallelGroup, num_heads: int,
                 head_dim: int, state_size: int) -> MambaMixer:
    """The mixer of a config in Mamba2's field names (``n_groups``, ``conv_kernel``,
    ``use_conv_bias``, ...; Mamba2's and NemotronH's), with the sizes each family
    names its own way."""
    n_groups = getattr(hf_config, "n_groups", 1)
    return MambaMixer(
        hidden_size=hf_config.hidden_size, num_heads=num_heads, head_dim=head_dim,
        n_groups=n_groups, norm_group_size=norm_group_size(num_heads, head_dim, n_groups),
        state_size=state_size,
        conv_kernel=getattr(hf_config, "conv_kernel", 4), chunk_size=hf_config.chunk_size,
        eps=hf_config.layer_norm_epsilon, time_step_limit=time_step_limit(hf_config),
        conv_bias=bool(getattr(hf_config, "use_conv_bias", True)),
        proj_bias=bool(getattr(hf_config, "use_bias", False)), tp_group=tp_group)


def norm_fp32_input(norm: RMSNorm, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm of a float32 residual stream as transformers' Mamba2RMSNorm computes it
    on float32 input (the weight multiplied in float32), cast to dtype."""
    return (norm.weight.float() * rms_normalized(x, norm.variance_epsilon)).to(dtype)


def block_mixer(hf_config: Any, tp_group: TensorParallelGroup) -> MambaMixer:
    """The Mamba2 mixer of a Mamba2 config's block."""
    return mamba2_mixer(hf_config, tp_group, hf_config.num_heads, hf_config.head_dim,
                        hf_config.state_size)


class Mamba2Block(nn.Module):
    """``x + mixer(norm(x))``, with the mixer a model class's block_mixer makes."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 mixer: Callable[[Any, TensorParallelGroup], nn.Module]) -> None:
        super().__init__()
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.layer_norm_epsilon)
        self.mixer = mixer(hf_config, tp_group)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                residual_in_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (mixer output, residual stream before it); the next block (or the final
        norm) adds them."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.norm(hidden_states)
        elif residual_in_fp32:
            residual = residual + hidden_states.float()
            hidden_states = self.norm(residual.to(hidden_states.dtype))
        else:
            hidden_states, residual = self.norm(hidden_states, residual)
        if residual_in_fp32:
            residual = residual.float()
        return self.mixer(hidden_states), residual


class Mamba2Backbone(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 mixer: Callable[[Any, TensorParallelGroup], nn.Module]) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(getattr(hf_config, "residual_in_fp32", True))
        self.embeddings = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                                 tp_group=tp_group)
        self.layers = nn.ModuleList(Mamba2Block(hf_config, tp_group, mixer)
                                    for _ in range(hf_config.num_hidden_layers))
        self.norm_f = RMSNorm(hf_config.hidden_size, eps=hf_config.layer_norm_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, self.residual_in_fp32)
        if not self.residual_in_fp32:
            return self.norm_f(hidden_states, residual)[0]
        return norm_fp32_input(self.norm_f, residual + hidden_states.float(),
                               hidden_states.dtype)


class Mamba2ForCausalLM(nn.Module):
    model_kind = "hybrid"
    supports_pipeline_parallel = False
    # What a subclass for another mixer (models/mamba.py) changes.
    check_config = staticmethod(check_supported_config)
    block_mixer = staticmethod(block_mixer)

    @classmethod
    def max_model_len(cls, hf_config: Any) -> int:
        """No positions, so no length limit of the model's own (the state carries the
        order): the config's max_position_embeddings where it names one (a training
        length), else 2 ** 20 tokens."""
        return getattr(hf_config, "max_position_embeddings", None) or NO_POSITIONS_LIMIT

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.check_config(hf_config)
        single_stage(type(self).__name__, stage)
        self.config = hf_config
        self.tp_group = tp_group
        self.backbone = Mamba2Backbone(hf_config, tp_group, self.block_mixer)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size,
                                      tp_group=tp_group)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.backbone.embeddings)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: Any = None) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden] (positions are unused: the state
        carries the order)."""
        hidden_states = embedded(self.embed_tokens, input_ids, inputs_embeds)
        return self.backbone(hidden_states)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab_size], the full vocabulary on every rank."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into this rank's parameters."""
        return load_named_weights(self, weights, self._param_name)

    def _param_name(self, hf_name: str) -> tuple[str, None] | None:
        if hf_name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        if hf_name.startswith("backbone.embedding."):  # the original mamba_ssm name
            hf_name = "backbone.embeddings." + hf_name[len("backbone.embedding."):]
        return hf_name, None
