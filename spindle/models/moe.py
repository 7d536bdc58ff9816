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
from spindle.models.llama import (MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                                  _to_param_name, dense_mlp)

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
