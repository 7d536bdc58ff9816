"""CohereForCausalLM (Command R) and Cohere2ForCausalLM (Command R7B, Command A).

Each layer is parallel: one norm of the input feeds both the attention and the SwiGLU
MLP, and both outputs join the residual stream (x + attn(n) + mlp(n), n = norm(x)). The
norm is a LayerNorm without a bias (mean-centred, weight only, computed in float32).
The logits are multiplied by ``logit_scale``. Cohere rotates interleaved pairs of each
head (x0, x1), (x2, x3), ...: the q and k projections' rows are permuted per head at
load to the rotate-half layout spindle's rotary (and its fused kernels) apply, which
leaves every q . k the same. Cohere2 attends within ``sliding_window`` on the layers
``layer_types`` calls sliding, and only those rotate (its global layers have no
positions).

Not supported, refused by name: Command R+'s per-head q/k LayerNorms (use_qk_norm).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.linear import default_weight_loader, set_weight_loader
from spindle.layers.rotary import interleaved_rows_as_halves
from spindle.models.causal_lm import DecoderForCausalLM, RotaryDecoderModel
from spindle.models.llama import (AttentionOptions, LlamaAttention, LlamaMLP,
                                  checked_window, head_dim_of, require_activation,
                                  windows_by_layer_type)


# The checkpoint tensors of q and k projections (whose rows carry the rotary layout).
QK_TENSORS = (".self_attn.q_proj.weight", ".self_attn.k_proj.weight",
              ".self_attn.q_proj.bias", ".self_attn.k_proj.bias")


def check_supported_config(hf_config: Any) -> None:
    require_activation(hf_config, "silu")
    if getattr(hf_config, "use_qk_norm", False):
        raise ValueError("Cohere's per-head q/k LayerNorms (use_qk_norm, Command R+) are not "
                         "supported")


class CohereLayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight over the last dimension, in float32, cast
    back to x's dtype; no bias (transformers' CohereLayerNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class CohereDecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 sliding_window: int | None, rotate: bool) -> None:
        super().__init__()
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.input_layernorm = CohereLayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps)
        self.self_attn = LlamaAttention(hf_config, AttentionOptions(bias, bias, False),
                                        tp_group, sliding_window, rotate)
        self.mlp = LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, False, tp_group)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        attended = self.self_attn(normed, positions, cos, sin)
        return hidden_states + attended + self.mlp(normed)


def cohere_model(hf_config: Any, tp_group: TensorParallelGroup, windows: list[int | None],
                 rotates: list[bool]) -> RotaryDecoderModel:
    return RotaryDecoderModel(
        hf_config, tp_group,
        lambda i: CohereDecoderLayer(hf_config, tp_group, windows[i], rotates[i]),
        CohereLayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps),
        head_dim_of(hf_config))


class CohereForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        check_supported_config(hf_config)
        windows, rotates = self.layer_attention(hf_config)
        self.build_single_stage(hf_config, tp_group, stage,
                                lambda c, tp: cohere_model(c, tp, windows, rotates))
        self.logit_scale = float(getattr(hf_config, "logit_scale", 1.0))
        self.head_dim = head_dim_of(hf_config)

    @classmethod
    def layer_attention(cls, hf_config: Any) -> tuple[list[int | None], list[bool]]:
        """Each layer's window and whether it rotates: Command R, no window, all rotate."""
        count = hf_config.num_hidden_layers
        return [None] * count, [True] * count

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) * self.logit_scale

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._rotate_half_layout(weights))

    def _rotate_half_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                            ) -> Iterator[tuple[str, torch.Tensor]]:
        """q_proj / k_proj rows (and biases) of each head reordered from interleaved
        pairs to halves: features 0, 2, 4, ... then 1, 3, 5, ..."""
        for name, tensor in weights:
            if name.endswith(QK_TENSORS):
                tensor = interleaved_rows_as_halves(tensor, self.head_dim)
            yield name, tensor


class Cohere2ForCausalLM(CohereForCausalLM):
    @classmethod
    def layer_attention(cls, hf_config: Any) -> tuple[list[int | None], list[bool]]:
        """The layers layer_types calls sliding attend within sliding_window and rotate;
        the others attend to everything, without positions."""
        count = hf_config.num_hidden_layers
        window = checked_window(getattr(hf_config, "sliding_window", None))
        windows = windows_by_layer_type(list(hf_config.layer_types), window, count)
        return windows, [w is not None for w in windows]
