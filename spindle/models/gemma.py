"""Gemma (GemmaForCausalLM), Gemma 2 (Gemma2ForCausalLM) and Gemma 3 text
(Gemma3ForCausalLM), as transformers computes them with eager attention. Gemma 2:

* embeddings scaled by sqrt(hidden_size) (the factor rounded to the activation dtype);
* "sandwich" norms: every layer normalises the input and the output of its attention
  and of its MLP (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
  post_feedforward_layernorm), each a GemmaRMSNorm (weight offset from one, scaled
  in float32);
* a GeGLU MLP (gelu with the tanh approximation);
* attention scaled by query_pre_attn_scalar ** -0.5, its scores soft-capped
  (attn_logit_softcapping: cap * tanh(score / cap)) before the mask, on layers that
  alternate between a sliding window (config.layer_types "sliding_attention") and
  full attention;
* the logits soft-capped too (final_logit_softcapping).

Gemma (the first) is Gemma 2 without the sandwich (a norm before attention and one
before the MLP), soft caps or windows, scores scaled by head_dim ** -0.5.

Gemma 3 is the same layer plus a per-head GemmaRMSNorm on q and k (before the rotary
embedding), with rotary tables per layer type (rope_parameters["sliding_attention"]
and ["full_attention"]: the global layers' base, and often linear scaling, differ),
and soft caps only when its config sets them (by default none). Its q/k norm is
Gemma's, not the fused kernel's, so its layers rotate in torch on every device.

The soft cap lives in the attention backend: torch_sdpa and the triton kernels apply
it; the batch-invariant backend refuses it.
No pipeline parallelism.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.activation import GeluTanhAndMul
from spindle.layers.embedding import VocabParallelEmbedding
from spindle.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from spindle.layers.norm import GemmaRMSNorm
from spindle.layers.rotary import RotaryEmbedding
from spindle.models.causal_lm import DecoderForCausalLM, embedded, single_stage
from spindle.models.llama import (AttentionOptions, LlamaAttention, _to_param_name,
                                  checked_window, head_dim_of, windows_by_layer_type)
from spindle.models.weights import load_named_weights

SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma2_sliding_windows(hf_config: Any, windows: bool = True) -> list[int | None]:
    """Per layer: config.sliding_window where layer_types says "sliding_attention"
    (windows=False: Gemma, none)."""
    if not windows:
        return [None] * hf_config.num_hidden_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        raise ValueError("a Gemma 2 config needs layer_types (transformers sets them)")
    window = checked_window(getattr(hf_config, "sliding_window", None))
    return windows_by_layer_type(layer_types, window, hf_config.num_hidden_layers)


class Gemma2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], tp_group=tp_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp_group=tp_group)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 sliding_window: int | None, qk_norm: bool = False,
                 sandwich: bool = True) -> None:
        """sandwich: the norms after attention and after the MLP too (Gemma 2 and 3)."""
        super().__init__()
        eps = hf_config.rms_norm_eps
        bias = bool(getattr(hf_config, "attention_bias", False))
        scalar = getattr(hf_config, "query_pre_attn_scalar", None) or head_dim_of(hf_config)
        options = AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=qk_norm,
                                   scale=scalar ** -0.5,
                                   logits_soft_cap=getattr(hf_config, "attn_logit_softcapping",
                                                           None),
                                   qk_norm_class=GemmaRMSNorm)
        self.self_attn = LlamaAttention(hf_config, options, tp_group, sliding_window)
        self.mlp = Gemma2MLP(hf_config.hidden_size, hf_config.intermediate_size, tp_group)
        self.sandwich = sandwich
        norms = ("input_layernorm", "post_attention_layernorm")
        if sandwich:
            norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        for name in norms:
            setattr(self, name, GemmaRMSNorm(hf_config.hidden_size, eps=eps))

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden_states), positions, cos, sin)
        if not self.sandwich:  # (Gemma: post_attention_layernorm is the MLP's input norm)
            hidden_states = hidden_states + attended
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mixed)


class Gemma2Model(nn.Module):
    """rope_per_layer_type (Gemma 3): a rotary table per layer type, and q/k norms."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 rope_per_layer_type: bool = False, gemma2: bool = True) -> None:
        """gemma2=False: Gemma's layers (no sandwich norms, no windows)."""
        super().__init__()
        self.hidden_size = hf_config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                                   tp_group=tp_group)
        windows = gemma2_sliding_windows(hf_config, windows=gemma2)
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(hf_config, tp_group, windows[i], qk_norm=rope_per_layer_type,
                               sandwich=gemma2)
            for i in range(hf_config.num_hidden_layers))
        self.norm = GemmaRMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        head_dim = head_dim_of(hf_config)
        # Layer i rotates with rotary[self.rope_of_layer[i]].
        if rope_per_layer_type:
            self.rotary = nn.ModuleDict({kind: RotaryEmbedding.from_config(hf_config, head_dim,
                                                                           kind)
                                         for kind in sorted(set(hf_config.layer_types))})
            self.rope_of_layer = list(hf_config.layer_types)
        else:
            self.rotary = nn.ModuleDict({"all": RotaryEmbedding.from_config(hf_config, head_dim)})
            self.rope_of_layer = ["all"] * hf_config.num_hidden_layers
        # Gemma 3's q/k norm is not the fused kernel's: rotate in torch everywhere.
        self.fused_rope = not rope_per_layer_type
        for layer, kind in zip(self.layers, self.rope_of_layer):  # plain references
            table = self.rotary[kind]
            layer.self_attn.rope_tables = (table.cos_cache, table.sin_cache)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: Any = None) -> torch.Tensor:
        hidden_states = embedded(self.embed_tokens, input_ids, inputs_embeds)
        # sqrt(hidden) rounded to the activation dtype, as transformers scales; a 0-d
        # host tensor multiplies as a scalar (no copy to the device, graph-safe).
        normalizer = torch.tensor(self.hidden_size ** 0.5, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer
        tables: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for kind, rotary in self.rotary.items():
            if hidden_states.is_cuda and self.fused_rope:
                tables[kind] = (None, None)  # the fused kernels read the tables themselves
            else:
                tables[kind] = rotary(positions, hidden_states.dtype)
        for layer, kind in zip(self.layers, self.rope_of_layer):
            hidden_states = layer(hidden_states, positions, *tables[kind])
        return self.norm(hidden_states)


class Gemma2ForCausalLM(DecoderForCausalLM):
    rope_per_layer_type = False  # (Gemma 3: True, and q/k norms)
    gemma2 = True  # (Gemma: False)

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (Gemma as an encoder) is not "
                             "supported")
        act = getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"Gemma hidden_activation {act!r} is not supported (only "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)})")
        self.config = hf_config
        self.stage = single_stage(type(self).__name__, stage)
        self.model = Gemma2Model(hf_config, tp_group, self.rope_per_layer_type, self.gemma2)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)
        self.build_lm_head(hf_config, tp_group)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, self._param_name)

    def _param_name(self, hf_name: str) -> tuple[str, Any] | None:
        if "rotary_emb." in hf_name:
            return None
        if hf_name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return _to_param_name(hf_name)


class GemmaForCausalLM(Gemma2ForCausalLM):
    """The first Gemma: see the module docstring."""

    gemma2 = False


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model (config Gemma3TextConfig): see the module docstring."""

    rope_per_layer_type = True
