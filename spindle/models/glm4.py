"""Glm4ForCausalLM (GLM-4-0414: GLM-4-9B / 32B, GLM-Z1): Llama's attention with biases on
q, k and v (not o), a rotary on the first ``partial_rotary_factor`` of each head whose
pairs are interleaved (x0, x1), (x2, x3), ..., and "sandwich" norms: each of attention and
the MLP is followed by an RMSNorm of its own before joining the residual stream. The MLP's
gate and up projections come fused in the checkpoint (``gate_up_proj``, gate first).
GlmForCausalLM (GLM-4-9B of 2024) is the same without the sandwich norms.

The interleaved pairs are served by permuting the rotated rows of each q and k head at
load into the rotate-half layout (features 0, 2, 4, ... then 1, 3, 5, ...), which leaves
every q . k the same; the rest of each head is left in place."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.norm import RMSNorm
from spindle.layers.rotary import interleaved_rows_as_halves
from spindle.models.bamba import (AttentionOnlyDecoder, BambaAttention, FeedForwardFactory,
                                  HybridLayout, PreNormAttentionLayer, attention_only_layout,
                                  rotary_dim)
from spindle.models.cohere import QK_TENSORS
from spindle.models.llama import head_dim_of


def glm4_layout(hf_config: Any) -> HybridLayout:
    return attention_only_layout(hf_config, rotary_dim(hf_config))


class Glm4DecoderLayer(nn.Module):
    """input norm, attention, its own norm; residual; post-attention norm, MLP, its own
    norm; residual (carried separately: the next norm adds it)."""

    def __init__(self, hf_config: Any, layer_idx: int, layout: HybridLayout,
                 feed_forward: FeedForwardFactory, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = BambaAttention(hf_config, layout, tp_group, o_bias=False)
        self.mlp = feed_forward(hf_config, layer_idx, tp_group)
        for name in ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                     "post_mlp_layernorm"):
            setattr(self, name, RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps))

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor | None, sin: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.input_layernorm.pre_norm(hidden_states, residual)
        attended = self.post_self_attn_layernorm(self.self_attn(hidden_states, cos, sin))
        hidden_states, residual = self.post_attention_layernorm(attended, residual)
        return self.post_mlp_layernorm(self.mlp(hidden_states)), residual


class Glm4ForCausalLM(AttentionOnlyDecoder):
    layout = staticmethod(glm4_layout)
    decoder_layer = Glm4DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._our_layout(weights))

    def _our_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The fused gate_up_proj as gate_proj and up_proj; each q/k head's rotated rows
        from interleaved pairs to halves."""
        head_dim, rotated = head_dim_of(self.config), rotary_dim(self.config)
        for name, tensor in weights:
            if name.endswith(".mlp.gate_up_proj.weight"):
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            elif name.endswith(QK_TENSORS):
                yield name, interleaved_rows_as_halves(tensor, head_dim, rotated)
            else:
                yield name, tensor


class GlmDecoderLayer(PreNormAttentionLayer):
    """GLM-4-9B's (2024) layer: the plain pre-norm layer around GLM-4's attention."""

    @staticmethod
    def make_attention(hf_config: Any, layout: HybridLayout,
                       tp_group: TensorParallelGroup) -> nn.Module:
        return BambaAttention(hf_config, layout, tp_group, o_bias=False)


class GlmForCausalLM(Glm4ForCausalLM):
    """GlmForCausalLM (GLM-4-9B-chat-hf and GLM-4-9B, 2024): GLM-4-0414's attention,
    fused gate_up tensor and rotary, without its sandwich norms."""

    decoder_layer = GlmDecoderLayer
