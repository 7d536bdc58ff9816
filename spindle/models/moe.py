"""Mixture-of-experts decoders: Qwen3MoeForCausalLM, Qwen2MoeForCausalLM and
MixtralForCausalLM.

Both are their dense family (Qwen3, Mistral) with some feed-forward blocks replaced by
a sparse MoE block (layers/moe.py):

* Qwen3-MoE: layer i is sparse unless it is in config.mlp_only_layers or
  (i + 1) % config.decoder_sparse_step != 0 (then a dense MLP of intermediate_size);
  experts of moe_intermediate_size; the top-k weights renormalised iff
  norm_topk_prob, then cast to the activation dtype. Checkpoint names:
  mlp.gate.weight, mlp.experts.E.{gate,up,down}_proj.weight.
* Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) and
  Qwen3-MoE's sparse layers with a shared expert beside the routed ones, weighted by
  sigmoid(shared_expert_gate(x)) (qwen3_next.SharedExpertMoeBlock, as Qwen3-Next's).
* Mixtral: every layer sparse, experts of intermediate_size, top-k weights always
  renormalised and kept in float32. Checkpoint names: block_sparse_moe.gate.weight,
  block_sparse_moe.experts.E.{w1,w3,w2}.weight (gate, up, down).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.moe import SparseMoeBlock
from spindle.models.llama import (Ernie4_5ForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                  Qwen3ForCausalLM, _to_param_name, dense_mlp)

_MIXTRAL_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}
_QWEN_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _expert_param(hf_name: str, parts: dict[str, str]) -> tuple[str, Any] | None:
    """...mlp.experts.E.PART.weight -> (...mlp.experts.w13 or .w2, (E, gate|up|down));
    None for any other name."""
    pieces = hf_name.split(".")
    if len(pieces) < 4 or pieces[-1] != "weight" or pieces[-4] != "experts" \
            or pieces[-2] not in parts or not pieces[-3].isdigit():
        return None
    part = parts[pieces[-2]]
    stem = ".".join(pieces[:-3])
    return f"{stem}.{'w2' if part == 'down' else 'w13'}", (int(pieces[-3]), part)


def one_per_expert(experts: str, part: str, stacked: torch.Tensor
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor [E, ...] (as transformers saves them) as the hub's one
    tensor per expert: (f"{experts}.{e}.{part}.weight", stacked[e]) for each e, which
    _expert_param maps."""
    for e, expert in enumerate(stacked):
        yield f"{experts}.{e}.{part}.weight", expert


def stacked_experts_one_by_one(weights: Iterable[tuple[str, torch.Tensor]], block: str,
                               parts: tuple[str, str, str]
                               ) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' stacked experts as the hub's per-expert tensors, the rest as is:
    f"...{block}gate_up_proj" [E, 2I, H] (each expert's [gate; up]) and
    f"...{block}down_proj" [E, H, I] become f"...{block}e.{part}.weight" for parts
    (gate, up, down) = parts. block: the experts' name with its dots (".mlp.experts.")."""
    gate, up, down = parts
    for name, tensor in weights:
        stem, found, leaf = name.rpartition(block)
        experts = stem + block.rstrip(".")
        if found and leaf == "gate_up_proj":
            gates, ups = tensor.chunk(2, dim=1)
            yield from one_per_expert(experts, gate, gates)
            yield from one_per_expert(experts, up, ups)
        elif found and leaf == "down_proj":
            yield from one_per_expert(experts, down, tensor)
        else:
            yield name, tensor


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        sparse = (layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
                  and hf_config.num_experts > 0 and (layer_idx + 1) % step == 0)
        if not sparse:
            return dense_mlp(hf_config, layer_idx, tp_group)
        return SparseMoeBlock(hf_config.hidden_size, hf_config.num_experts,
                              hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                              normalize_top_k=bool(hf_config.norm_topk_prob),
                              weights_in_activation_dtype=True, tp_group=tp_group)

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or _to_param_name(hf_name)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        from spindle.models.qwen3_next import qwen3_next_feed_forward

        return qwen3_next_feed_forward(hf_config, layer_idx, tp_group)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from spindle.models.qwen3_next import shared_expert_block_names

        return super().load_weights(shared_expert_block_names(weights))

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or _to_param_name(hf_name)


class Dots1ForCausalLM(Qwen3ForCausalLM):
    """rednote's dots.llm1: Qwen3's attention (per-head q/k norms) with DeepSeek-V3's
    feed-forward: dense layers first, then routed experts (sigmoid scores with a
    correction bias, groups) and shared experts (glm4_moe's block)."""

    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        from spindle.models.glm4_moe import glm4_moe_feed_forward
        from spindle.models.nemotron_h import check_routing

        check_routing(hf_config)
        return glm4_moe_feed_forward(hf_config, layer_idx, tp_group)

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or _to_param_name(hf_name)


class MixtralForCausalLM(MistralForCausalLM):
    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        return SparseMoeBlock(hf_config.hidden_size, hf_config.num_local_experts,
                              hf_config.num_experts_per_tok, hf_config.intermediate_size,
                              normalize_top_k=True, weights_in_activation_dtype=False,
                              tp_group=tp_group)

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        return _expert_param(hf_name, _MIXTRAL_EXPERT_PARTS) or _to_param_name(hf_name)


class ErnieMoeRouter(nn.Module):
    """ERNIE 4.5's router: a float32 [E, H] linear, softmax; the top k chosen by
    probability plus a correction bias (``moe_statics.e_score_correction_bias``), weighed
    by their probabilities renormalised (the sum clamped at moe_norm_min), then cast to
    the activation dtype. Replicated."""

    def __init__(self, hf_config: Any) -> None:
        from spindle.layers.linear import default_weight_loader, set_weight_loader

        super().__init__()
        experts = hf_config.num_experts
        self.top_k = hf_config.num_experts_per_tok
        self.norm_min = float(getattr(hf_config, "moe_norm_min", 1e-12))
        self.weight = nn.Parameter(torch.empty(experts, hf_config.hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        self.correction_bias = nn.Parameter(torch.empty(experts, dtype=torch.float32),
                                            requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)
        set_weight_loader(self.correction_bias,
                          lambda param, loaded, shard_id=None: default_weight_loader(
                              param, loaded.reshape(-1), shard_id))  # (stored [1, E])
        self.batch_invariant = False  # set by enable_batch_invariance

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from spindle.layers.linear import apply_linear

        probs = torch.softmax(apply_linear(x.float(), self.weight,
                                           invariant=self.batch_invariant), dim=1)
        ids = torch.topk(probs + self.correction_bias, self.top_k, dim=-1)[1]
        weights = probs.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return ids, weights.to(x.dtype)


class ErnieMoeBlock(nn.Module):
    """Routed experts plus moe_num_shared_experts shared ones as one SwiGLU MLP."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        from spindle.layers.moe import FusedExperts
        from spindle.models.llama import LlamaMLP

        super().__init__()
        self.tp_group = tp_group
        self.gate = ErnieMoeRouter(hf_config)
        self.experts = FusedExperts(hf_config.num_experts, hf_config.hidden_size,
                                    hf_config.moe_intermediate_size, tp_group)
        shared = getattr(hf_config, "moe_num_shared_experts", 0) or 0
        self.shared_experts = None if shared == 0 else LlamaMLP(
            hf_config.hidden_size, hf_config.moe_intermediate_size * shared,
            bool(getattr(hf_config, "use_bias", False)), tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self.tp_group.all_reduce(self.experts(x, ids, weights))
        return out if self.shared_experts is None else out + self.shared_experts(x)


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    """ERNIE 4.5's mixture of experts (21B-A3B, 300B-A47B): the dense model's layers
    with ErnieMoeBlock every moe_layer_interval-th layer between moe_layer_start_index and
    moe_layer_end_index. Its multi-token-prediction layers (``mtp_*``) are not loaded."""

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        if getattr(hf_config, "use_bias", False):
            raise ValueError("ERNIE 4.5 MoE with use_bias (transformers gives its LM head a "
                             "bias too) is not supported")

    @classmethod
    def mlp_for_layer(cls, hf_config: Any, layer_idx: int,
                      tp_group: TensorParallelGroup) -> nn.Module:
        end = getattr(hf_config, "moe_layer_end_index", -1)
        end = hf_config.num_hidden_layers - 1 if end in (None, -1) else end
        if ((layer_idx + 1) % (getattr(hf_config, "moe_layer_interval", 1) or 1) == 0
                and getattr(hf_config, "moe_layer_start_index", 1) <= layer_idx <= end):
            return ErnieMoeBlock(hf_config, tp_group)
        return super().mlp_for_layer(hf_config, layer_idx, tp_group)

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        for stored in (".mlp.moe_statics.", ".mlp.gate.moe_statics."):  # (hub, transformers)
            hf_name = hf_name.replace(stored + "e_score_correction_bias",
                                      ".mlp.gate.correction_bias")
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or super().param_name(hf_name)

    def _skip_checkpoint_tensor(self, hf_name: str) -> bool:
        return hf_name.startswith(("mtp_", "model.mtp_")) or super()._skip_checkpoint_tensor(
            hf_name)
