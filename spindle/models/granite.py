"""GraniteForCausalLM, GraniteMoeForCausalLM and GraniteMoeSharedForCausalLM: IBM's
Granite 3.x decoders (granite-3.3-2b/8b-instruct; granite-3.0-1b-a400m / 3b-a800m; the
shared-expert variant), served as GraniteMoeHybrid (models/granite_hybrid.py) with
every layer attending. GraniteSWAForCausalLM and GraniteMoeSWAForCausalLM are Granite
and GraniteMoeShared with a sliding window on the layers ``layer_types`` calls sliding,
attention sinks (a learned logit per head in each softmax, as gpt-oss's), and a rotary
base per layer (``layer_rope_theta``; 0: that layer has no rotary).

- Llama's layers with Granite's scalings: the embeddings times ``embedding_multiplier``,
  each sublayer's output times ``residual_multiplier`` before it joins the residual
  stream, attention scores scaled by ``attention_multiplier`` (not head_dim ** -0.5),
  logits divided by ``logits_scaling``; every head rotated (RoPE);
- the feed-forward: Llama's SwiGLU MLP (``mlp.gate_proj`` / ``up_proj`` /
  ``down_proj``, ``mlp_bias``) in Granite; in GraniteMoe a mixture of SwiGLU experts
  whose top-k router logits are softmaxed (``block_sparse_moe``, the experts stacked,
  under the hub's or transformers' names); GraniteMoeShared adds the SwiGLU
  ``shared_mlp`` to the experts' sum.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.models import granite_hybrid
from spindle.models.bamba import HybridLayout, bamba_feed_forward, check_silu
from spindle.models.granite_hybrid import (GraniteMoeFeedForward,
                                           GraniteMoeHybridForCausalLM, granite_experts)
from spindle.layers.rotary import rope_parameters_from_config
from spindle.models.llama import checked_window, head_dim_of, windows_by_layer_type


def check_granite_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    check_silu(hf_config)
    position = getattr(hf_config, "position_embedding_type", None)
    if position not in (None, "rope"):
        raise ValueError(f"position_embedding_type {position!r} is not supported (only "
                         "'rope')")


def granite_layout(hf_config: Any) -> HybridLayout:
    """GraniteMoeHybrid's layout (Granite's scalings) with every layer attending and
    rotating whole heads."""
    return replace(granite_hybrid.granite_layout(hf_config),
                   attention_layers=frozenset(range(hf_config.num_hidden_layers)),
                   rotary_dim=head_dim_of(hf_config))


class GraniteMoeExperts(nn.Module):
    """GraniteMoe's feed-forward: the routed experts alone (as ``moe``, the name the
    checkpoint translation of GraniteMoeHybrid gives them)."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.moe = granite_experts(hf_config, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


class GraniteForCausalLM(GraniteMoeHybridForCausalLM):
    check_config = staticmethod(check_granite_config)
    layout = staticmethod(granite_layout)
    feed_forward = staticmethod(bamba_feed_forward)  # (Llama's MLP, mlp_bias)

    def _in_bamba_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super()._in_bamba_names(weights):
            yield name.replace(".mlp.", ".feed_forward."), tensor


class GraniteMoeForCausalLM(GraniteMoeHybridForCausalLM):
    check_config = staticmethod(check_granite_config)
    layout = staticmethod(granite_layout)

    @staticmethod
    def feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                     ) -> nn.Module:
        return GraniteMoeExperts(hf_config, tp_group)


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    @staticmethod
    def feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                     ) -> nn.Module:
        return GraniteMoeFeedForward(hf_config, tp_group)


def granite_swa_layout(hf_config: Any) -> HybridLayout:
    """Granite's layout with each layer's window, sinks, and a rotary table per distinct
    rope_theta of layer_rope_theta (named "theta_<value>"; "none" for a theta of 0)."""
    num_layers = hf_config.num_hidden_layers
    window = checked_window(getattr(hf_config, "sliding_window", None))
    windows = windows_by_layer_type(list(hf_config.layer_types), window, num_layers)
    base = dict(rope_parameters_from_config(hf_config))
    thetas = getattr(hf_config, "layer_rope_theta", None) or [base["rope_theta"]] * num_layers
    if len(thetas) != num_layers:
        raise ValueError(f"layer_rope_theta has {len(thetas)} entries for {num_layers} layers")
    kinds = tuple(f"theta_{float(t):g}".replace(".", "_") if t else "none" for t in thetas)
    params = {kind: ({**base, "rope_theta": float(t)} if t else None)
              for kind, t in zip(kinds, thetas)}
    return replace(granite_layout(hf_config), sliding_windows=tuple(windows),
                   attention_sinks=True, rope_layer_types=kinds, rope_parameters_of=params)


class GraniteSWAForCausalLM(GraniteForCausalLM):
    layout = staticmethod(granite_swa_layout)


class GraniteMoeSWAForCausalLM(GraniteMoeSharedForCausalLM):
    layout = staticmethod(granite_swa_layout)
