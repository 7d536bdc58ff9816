"""GraniteMoeHybridForCausalLM: IBM's Granite 4.0 hybrids (granite-4.0-h-micro, -h-tiny,
-h-small), Bamba's pattern (models/bamba.py) with Granite's scalings.

What differs from Bamba, and how it is served here:

- which layers attend comes from ``layer_types`` (``mamba`` / ``attention``, or their
  newer names ``linear_attention`` / ``full_attention``);
- attention rotates whole heads when ``position_embedding_type`` is ``rope``, and not
  at all otherwise (Granite 4.0 has no positions); its scores are scaled by
  ``attention_multiplier`` instead of head_dim ** -0.5;
- the embeddings are multiplied by ``embedding_multiplier``, each sublayer's output by
  ``residual_multiplier`` before it joins the residual stream, and the logits are
  divided by ``logits_scaling``;
- the feed-forward is the SwiGLU ``shared_mlp`` (``input_linear`` holds [gate; up]),
  plus, with ``num_local_experts`` > 0, a mixture of SwiGLU experts whose top-k
  router logits are softmaxed (layers/moe.py's block: the GPU runs it through the
  fused grouped GEMMs). The block returns experts + shared, as transformers sums them.

Checkpoint names: the hub's (``block_sparse_moe.input_linear`` / ``output_linear``,
experts stacked, ``router.layer``) and transformers' own (``experts.gate_up_proj`` /
``down_proj``, ``router``) both load.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.moe import SparseMoeBlock
from spindle.layers.mamba.mixer import time_step_limit
from spindle.models.bamba import BambaForCausalLM, HybridLayout, mamba_head_dim
from spindle.models.llama import LlamaMLP, _to_param_name, head_dim_of
from spindle.models.moe import _QWEN_EXPERT_PARTS, _expert_param, one_per_expert

ATTENTION_KINDS = ("attention", "full_attention")
MAMBA_KINDS = ("mamba", "linear_attention")


def layer_kinds(hf_config: Any) -> list[str]:
    kinds = getattr(hf_config, "layer_types", None)
    return list(kinds) if kinds is not None else ["mamba"] * hf_config.num_hidden_layers


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    kinds = layer_kinds(hf_config)
    unknown = sorted(set(kinds) - set(ATTENTION_KINDS) - set(MAMBA_KINDS))
    if unknown:
        raise ValueError(f"layer_types holds unknown layer types {unknown}")
    if len(kinds) != hf_config.num_hidden_layers:
        raise ValueError(f"layer_types names {len(kinds)} layers, the model has "
                         f"{hf_config.num_hidden_layers}")
    inter = int(getattr(hf_config, "mamba_expand", 2) * hf_config.hidden_size)
    if hf_config.mamba_n_heads * mamba_head_dim(hf_config) != inter:
        raise ValueError(f"mamba_n_heads ({hf_config.mamba_n_heads}) * mamba_d_head "
                         f"({mamba_head_dim(hf_config)}) must equal mamba_expand * "
                         f"hidden_size ({inter})")
    position = getattr(hf_config, "position_embedding_type", None)
    if position not in (None, "rope", "nope"):
        raise ValueError(f"position_embedding_type {position!r} is not supported "
                         "('rope', or none)")
    time_step_limit(hf_config)  # (refuses a bad one)


def has_experts(hf_config: Any) -> bool:
    """Whether each layer's feed-forward has routed experts beside its shared MLP."""
    return (getattr(hf_config, "num_local_experts", 0) or 0) > 0


def granite_layout(hf_config: Any) -> HybridLayout:
    rope = getattr(hf_config, "position_embedding_type", None) == "rope"
    return HybridLayout(
        attention_layers=frozenset(i for i, kind in enumerate(layer_kinds(hf_config))
                                   if kind in ATTENTION_KINDS),
        rotary_dim=head_dim_of(hf_config) if rope else 0,
        attention_scale=float(hf_config.attention_multiplier),
        embedding_multiplier=float(hf_config.embedding_multiplier),
        residual_multiplier=float(hf_config.residual_multiplier))


def granite_experts(hf_config: Any, tp_group: TensorParallelGroup) -> SparseMoeBlock:
    """Granite's routed SwiGLU experts: top-k router logits softmaxed."""
    return SparseMoeBlock(
        hf_config.hidden_size, hf_config.num_local_experts, hf_config.num_experts_per_tok,
        hf_config.intermediate_size, normalize_top_k=True, weights_in_activation_dtype=True,
        tp_group=tp_group)


class GraniteMoeFeedForward(nn.Module):
    """The routed experts plus the shared SwiGLU MLP, summed."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.moe = granite_experts(hf_config, tp_group)
        self.shared = LlamaMLP(hf_config.hidden_size, hf_config.shared_intermediate_size,
                               False, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x) + self.shared(x)


def granite_feed_forward(hf_config: Any, layer_idx: int, tp_group: TensorParallelGroup
                         ) -> nn.Module:
    if has_experts(hf_config):
        return GraniteMoeFeedForward(hf_config, tp_group)
    return LlamaMLP(hf_config.hidden_size, hf_config.shared_intermediate_size, False, tp_group)


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    checkpoint_final_norm = "norm"
    check_config = staticmethod(check_supported_config)
    layout = staticmethod(granite_layout)
    feed_forward = staticmethod(granite_feed_forward)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        scaling = float(getattr(self.config, "logits_scaling", 1.0))
        return logits if scaling == 1.0 else logits / scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._in_bamba_names(weights))

    def checkpoint_renames(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The renaming load_weights applies before param_name (what LoRA adapters'
        module names go through, lora/layers.py)."""
        return self._in_bamba_names(weights)

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        return _expert_param(hf_name, _QWEN_EXPERT_PARTS) or _to_param_name(hf_name)

    def _in_bamba_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """Granite's tensors under the names of this model's modules: stacked [gate; up]
        and stacked experts split into the per-projection, per-expert tensors that the
        shared loaders take."""
        shared = ".feed_forward.shared." if has_experts(self.config) else ".feed_forward."
        for name, tensor in weights:
            name = name.replace(".post_attention_layernorm.", ".pre_ff_layernorm.")
            stem, _, leaf = name.rpartition(".block_sparse_moe.")
            if not stem:
                stem, _, leaf = name.rpartition(".shared_mlp.")
                if not stem:
                    yield name, tensor
                elif leaf == "input_linear.weight":
                    gate, up = tensor.chunk(2, dim=0)
                    yield f"{stem}{shared}gate_proj.weight", gate
                    yield f"{stem}{shared}up_proj.weight", up
                elif leaf == "output_linear.weight":
                    yield f"{stem}{shared}down_proj.weight", tensor
                else:
                    raise ValueError(f"checkpoint tensor {name!r}: unknown in a "
                                     "GraniteMoeHybrid shared MLP")
            elif leaf in ("router.layer.weight", "router.weight"):
                yield f"{stem}.feed_forward.moe.gate.weight", tensor
            elif leaf in ("input_linear.weight", "experts.gate_up_proj"):
                gate, up = tensor.chunk(2, dim=1)  # [E, 2I, H]: each expert's [gate; up]
                yield from one_per_expert(f"{stem}.feed_forward.moe.experts", "gate_proj", gate)
                yield from one_per_expert(f"{stem}.feed_forward.moe.experts", "up_proj", up)
            elif leaf in ("output_linear.weight", "experts.down_proj"):
                yield from one_per_expert(f"{stem}.feed_forward.moe.experts", "down_proj",
                                          tensor)
            else:
                raise ValueError(f"checkpoint tensor {name!r}: unknown in a GraniteMoeHybrid "
                                 "mixture-of-experts block")
