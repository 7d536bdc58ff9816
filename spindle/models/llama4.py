"""Llama4ForCausalLM (Meta's Llama 4 Scout and Maverick, the text model): Llama's
layers with

- chunked local attention (``attention_chunk_size``) on the layers that rotate, and
  global attention without rotary (NoPE) on every ``no_rope_layer_interval``-th one
  (``no_rope_layers`` / ``layer_types``);
- on the rotating layers, q and k normed by a weightless RMSNorm after the rotation
  (``use_qk_norm``; a rotation keeps the norm, so it is applied before it, as the fused
  kernels do, to the same values up to rounding); on the NoPE layers, queries scaled
  by 1 + attn_scale * log(1 + floor((position + 1) / floor_scale))
  (``attn_temperature_tuning``);
- the rotary turning interleaved pairs (a complex product in transformers): q/k rows
  permuted at load (InterleavedRotaryRows);
- feed-forward blocks that are, on ``moe_layers``, a shared SwiGLU expert plus routed
  experts whose router picks the top expert by logit and scales the expert's *input*
  by sigmoid(logit), and elsewhere a dense SwiGLU MLP of ``intermediate_size_mlp``.

Only one routed expert per token (``num_experts_per_tok`` 1, every released model's):
the input scaling has no single input for several. The checkpoint's experts are stacked
[E, H, 2I] and [E, I, H] (input-major): transposed and split per expert at load."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import apply_linear
from spindle.layers.moe import FusedExperts, Router
from spindle.layers.norm import WeightlessRMSNorm
from spindle.models.llama import (AttentionOptions, InterleavedRotaryRows, LlamaForCausalLM,
                                  LlamaMLP, _to_param_name, check_supported_config)
from spindle.models.moe import _QWEN_EXPERT_PARTS, _expert_param, stacked_experts_one_by_one


class Llama4MoeBlock(nn.Module):
    """The shared expert plus the top routed expert, fed the input times its score."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, experts = hf_config.hidden_size, hf_config.num_local_experts
        self.tp_group = tp_group
        self.router = Router(experts, hidden)
        self.experts = FusedExperts(experts, hidden, hf_config.intermediate_size, tp_group)
        self.shared_expert = LlamaMLP(hidden, hf_config.intermediate_size, False, tp_group)
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = apply_linear(x, self.router.weight, invariant=self.batch_invariant)
        top_logit, top_id = torch.topk(logits, 1, dim=-1)
        score = torch.sigmoid(top_logit.float()).to(x.dtype)  # [T, 1]
        routed = self.experts(x * score, top_id, torch.ones_like(score))
        return self.shared_expert(x) + self.tp_group.all_reduce(routed)


def _feed_forward_as_mlp(weights: Iterable[tuple[str, torch.Tensor]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """feed_forward.* as mlp.*, the stacked experts as transformers' other MoE models
    stack them ([E, 2I, H], [E, H, I])."""
    for name, tensor in weights:
        name = name.replace(".feed_forward.", ".mlp.")
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            tensor = tensor.transpose(1, 2)
        yield name, tensor


class Llama4ForCausalLM(InterleavedRotaryRows, LlamaForCausalLM):
    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        check_supported_config(hf_config)
        top_k = getattr(hf_config, "num_experts_per_tok", 1)
        if top_k != 1:
            raise ValueError(f"Llama 4 with num_experts_per_tok={top_k} is not supported "
                             "(only 1: the router's score scales the expert's input)")

    @classmethod
    def rotary_layers(cls, hf_config: Any) -> list[bool]:
        return [bool(flag) for flag in hf_config.no_rope_layers]

    @classmethod
    def attention_chunks(cls, hf_config: Any) -> list[int | None]:
        chunk = getattr(hf_config, "attention_chunk_size", None)
        types = getattr(hf_config, "layer_types", None) or [
            "chunked_attention" if rotates else "full_attention"
            for rotates in cls.rotary_layers(hf_config)]
        return [chunk if kind == "chunked_attention" else None for kind in types]

    @classmethod
    def attention_options(cls, hf_config: Any):
        bias = bool(getattr(hf_config, "attention_bias", False))
        rotates = cls.rotary_layers(hf_config)
        temperature = None
        if getattr(hf_config, "attn_temperature_tuning", False):
            temperature = (float(hf_config.attn_scale), int(hf_config.floor_scale), 1)

        def options(layer_idx: int) -> AttentionOptions:
            if rotates[layer_idx]:
                return AttentionOptions(bias, bias, qk_norm=bool(hf_config.use_qk_norm),
                                        qk_norm_class=WeightlessRMSNorm)
            return AttentionOptions(bias, bias, qk_norm=False, query_scaling=temperature)
        return options

    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        if layer_idx in hf_config.moe_layers:
            return Llama4MoeBlock(hf_config, tp_group)
        return LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size_mlp, False,
                        tp_group)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(stacked_experts_one_by_one(
            _feed_forward_as_mlp(weights), ".mlp.experts.",
            ("gate_proj", "up_proj", "down_proj")))

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or _to_param_name(hf_name)
