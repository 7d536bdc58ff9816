"""Exaone4ForCausalLM (LG's EXAONE 4.0): OLMo 2's post-norm layers (each of attention and
the MLP followed by its own RMSNorm before it joins the residual stream, no input norm)
with Qwen3's per-head q/k norms. With a ``sliding_window`` the layers ``layer_types``
calls sliding attend within it and rotate; the others attend to everything and do not
rotate (no positions). Without one, every layer attends fully and rotates. Built on the
hybrid base as an attention-only decoder."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.norm import RMSNorm
from spindle.layers.rotary import rope_parameters_from_config
from spindle.models.bamba import (AttentionOnlyDecoder, BambaAttention, FeedForwardFactory,
                                  HybridLayout, attention_only_layout)
from spindle.models.llama import checked_window, head_dim_of, windows_by_layer_type
from spindle.models.olmo_hybrid import post_norm_attention_block

ROTATING, NOPE = "rotating", "nope"


def exaone4_layout(hf_config: Any) -> HybridLayout:
    layout = attention_only_layout(hf_config, head_dim_of(hf_config))
    window = checked_window(getattr(hf_config, "sliding_window", None))
    if window is None:
        return layout
    num_layers = hf_config.num_hidden_layers
    windows = windows_by_layer_type(list(hf_config.layer_types), window, num_layers)
    params = dict(rope_parameters_from_config(hf_config))
    params.pop("partial_rotary_factor", None)
    return replace(layout, sliding_windows=tuple(windows),
                   rope_layer_types=tuple(ROTATING if w is not None else NOPE for w in windows),
                   rope_parameters_of={ROTATING: params, NOPE: None})


class Exaone4DecoderLayer(nn.Module):
    """attention -> its norm -> residual; MLP -> its norm -> residual (the residual
    carried separately: the next layer, or the final norm, adds it)."""

    def __init__(self, hf_config: Any, layer_idx: int, layout: HybridLayout,
                 feed_forward: FeedForwardFactory, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.self_attn = BambaAttention(hf_config, layout, tp_group, qk_norm_eps=eps,
                                        sliding_window=layout.window_of(layer_idx))
        self.mlp = feed_forward(hf_config, layer_idx, tp_group)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(hf_config.hidden_size, eps=eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return post_norm_attention_block(self, hidden_states, residual, cos, sin)


class Exaone4ForCausalLM(AttentionOnlyDecoder):
    layout = staticmethod(exaone4_layout)
    decoder_layer = Exaone4DecoderLayer
