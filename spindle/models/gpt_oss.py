"""GptOssForCausalLM: OpenAI's gpt-oss (20b, 120b).

Llama's layer with these differences, each as transformers computes it:

- attention with biases on q, k, v and o, a sliding window on the layers
  ``layer_types`` names "sliding_attention" (every other one), YaRN rotary, and
  attention sinks: a learned logit per head that takes its share of every softmax's
  denominator and attends to nothing (``Attention(sinks=...)``; the backends add
  exp(sink - max) to the denominator);
- a mixture of experts in every layer: a router with a bias keeps each token's top
  ``num_experts_per_tok`` logits and weighs them by their softmax; the experts have
  biases on both projections and a clamped SwiGLU: (clamp(up, -limit, limit) + 1) *
  g * sigmoid(alpha * g), g = min(gate, limit) (``moe.ClampedSwiGLU``; the fused MoE
  kernels on a GPU).

Checkpoints: transformers' own (``mlp.experts.gate_up_proj`` [E, H, 2I] with gate and up
interleaved column by column, ``down_proj`` [E, I, H], biases) or the released MXFP4
ones (``*_blocks`` of two 4-bit e2m1 values per byte and ``*_scales``, a power of two
per 32 values), dequantized at load to the model's dtype (so the weights take bf16
memory: about 4x the MXFP4 files).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import apply_linear, default_weight_loader, set_weight_loader
from spindle.layers.moe import ClampedSwiGLU, FusedExperts
from spindle.models.causal_lm import single_stage
from spindle.models.llama import (AttentionOptions, LlamaForCausalLM, checked_window,
                                  windows_by_layer_type)

# The e2m1 values of a 4-bit code (sign in the top bit), as the MXFP4 format defines them.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_SUFFIXES = ("_blocks", "_scales")


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    experts, top_k = hf_config.num_local_experts, hf_config.num_experts_per_tok
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_local_experts "
                         f"({experts})")
    if not getattr(hf_config, "attention_bias", True):
        raise ValueError("gpt-oss without attention biases (attention_bias false) is not "
                         "supported")


class GptOssRouter(nn.Module):
    """Replicated [E, H] weight and [E] bias; a token's top-k logits, softmaxed in their
    own dtype, weigh the chosen experts."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        for param in (self.weight, self.bias):
            set_weight_loader(param, default_weight_loader)
        self.batch_invariant = False  # set by enable_batch_invariance

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = apply_linear(x, self.weight, invariant=self.batch_invariant)
        logits = logits + self.bias.to(logits.dtype)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return ids, F.softmax(top, dim=1, dtype=top.dtype)


class GptOssMoE(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.router = GptOssRouter(hf_config.num_local_experts, hf_config.hidden_size,
                                   hf_config.num_experts_per_tok)
        self.experts = FusedExperts(
            hf_config.num_local_experts, hf_config.hidden_size, hf_config.intermediate_size,
            tp_group, bias=True,
            activation=ClampedSwiGLU(float(getattr(hf_config, "swiglu_alpha", 1.702)),
                                     float(getattr(hf_config, "swiglu_limit", 7.0))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        return self.tp_group.all_reduce(self.experts(x, ids, weights))


class GptOssForCausalLM(LlamaForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup, stage=None) -> None:
        super().__init__(hf_config, tp_group, single_stage(type(self).__name__, stage))

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        check_supported_config(hf_config)

    @classmethod
    def attention_options(cls, hf_config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=True, qk_norm=False, sinks=True)

    @classmethod
    def sliding_windows(cls, hf_config: Any) -> list[int | None]:
        window = checked_window(getattr(hf_config, "sliding_window", None))
        num_layers = hf_config.num_hidden_layers
        layer_types = getattr(hf_config, "layer_types", None) or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        return windows_by_layer_type(list(layer_types), window, num_layers)

    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        return GptOssMoE(hf_config, tp_group)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(experts_one_by_one(dequantized_mxfp4(weights)))

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        name, sep, shard = hf_name.partition(SHARD_MARK)
        if sep:
            expert, part = shard.split(SHARD_MARK)
            return name, (int(expert), part)
        return super().param_name(hf_name)


# Marks an expert's piece: <experts>.w13 + SHARD_MARK + expert + SHARD_MARK + part.
SHARD_MARK = "@"
_EXPERT_TENSORS = {"gate_up_proj": "w13", "gate_up_proj_bias": "w13_bias",
                   "down_proj": "w2", "down_proj_bias": "w2_bias"}


def experts_one_by_one(weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' stacked expert tensors as FusedExperts' shards, one expert and part
    at a time: gate_up_proj [E, H, 2I] (gate and up interleaved column by column) -> the
    gate and up rows [I, H], down_proj [E, I, H] -> [H, I], the biases likewise."""
    for name, tensor in weights:
        stem, sep, leaf = name.rpartition(".experts.")
        if not sep or leaf not in _EXPERT_TENSORS:
            yield name, tensor
            continue
        target = f"{stem}.experts.{_EXPERT_TENSORS[leaf]}"
        for expert, piece in enumerate(tensor):
            mark = f"{target}{SHARD_MARK}{expert}{SHARD_MARK}"
            if leaf == "gate_up_proj":
                yield mark + "gate", piece[:, 0::2].t()
                yield mark + "up", piece[:, 1::2].t()
            elif leaf == "gate_up_proj_bias":
                yield mark + "gate", piece[0::2]
                yield mark + "up", piece[1::2]
            elif leaf == "down_proj":
                yield mark + "down", piece.t()
            else:
                yield mark + "down", piece


def dequantized_mxfp4(weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint with each MXFP4 pair (X_blocks, X_scales) replaced by X, the
    dequantized tensor in transformers' layout (gate_up_proj [E, H, 2I], down_proj
    [E, I, H]), as soon as both halves have come; other tensors as they are."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in MXFP4_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[:-len(suffix)]
        halves = pending.setdefault(base, {})
        halves[suffix] = tensor
        if len(halves) == 2:
            del pending[base]
            yield base, mxfp4_dequantize(halves["_blocks"], halves["_scales"]).transpose(1, 2)
    if pending:
        raise ValueError(f"MXFP4 tensors without their other half: {sorted(pending)} (each "
                         "X_blocks needs its X_scales)")


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., G, 16] (two e2m1 codes a byte, the low nibble first) and scales
    uint8 [..., G] (the exponent of a power of two, biased by 127) -> [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} (blocks [..., G, 16], scales [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [..., G, 32]: low, high, low, high, ...
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents[..., None]).flatten(-2).to(dtype)
