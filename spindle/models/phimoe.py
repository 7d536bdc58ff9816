"""PhimoeForCausalLM (Microsoft's Phi-3.5-MoE): LayerNorms with biases, grouped-query
attention with biases on q, k, v and o (and a window, config.sliding_window, on every
layer), two of the experts per token chosen by "sparsemixer" (below), an LM head with a
bias, and LongRoPE whose two tables each have a scale of their own (short_mscale and
long_mscale in the rope parameters, where Phi-3 has one attention factor).

The checkpoint keeps Mixtral's names (``block_sparse_moe.gate``, ``experts.E.w1/w3/w2``).

transformers' port (5.25) recomputes its rotary frequencies at each forward without the
sequence length, so it rotates by the short factors at every length and only switches
the scale past the original length. The model's own code (Microsoft's, which the hub
checkpoint was released with) and its long_factor say the long factors there, as the
engine does (see layers/rotary.py on LongRoPE past the original length)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.linear import apply_linear
from spindle.layers.moe import FusedExperts, Router
from spindle.layers.rotary import RotaryEmbedding, rope_parameters_from_config
from spindle.models.causal_lm import DecoderForCausalLM, RotaryDecoderModel, renamed
from spindle.models.gpt_neox import PartialRotaryAttention, PreNormRotaryLayer
from spindle.models.llama import _to_param_name, checked_window, head_dim_of, require_activation
from spindle.models.moe import _MIXTRAL_EXPERT_PARTS, _expert_param


def sparsemixer_top2(logits: torch.Tensor, jitter_eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's routing at inference: the best expert, weighed by its softmax
    probability among the experts whose logit is within 2 * jitter_eps (relative to
    max(|logit|, best)) of the best; then the best of the others, weighed the same way
    among the others within that margin of it. logits [T, E] -> (ids [T, 2], weights
    [T, 2] in logits' dtype), computed as transformers' sparsemixer."""
    ids, weights = [], []
    scores = logits
    for _ in range(2):
        best, best_id = scores.max(dim=-1, keepdim=True)
        scale = logits.abs().clamp(min=best)
        outside = ((best - logits) / scale) > (2 * jitter_eps)
        probs = torch.softmax(scores.masked_fill(outside, float("-inf")), dim=-1)
        ids.append(best_id)
        weights.append(probs.gather(-1, best_id))
        scores = scores.scatter(-1, best_id, float("-inf"))
    return torch.cat(ids, dim=-1), torch.cat(weights, dim=-1)


class SparsemixerMoeBlock(nn.Module):
    """The router (replicated) and the experts (sharded over tensor-parallel ranks)."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        if hf_config.num_experts_per_tok != 2:
            raise ValueError(f"PhiMoE's sparsemixer routes to 2 experts per token; "
                             f"num_experts_per_tok is {hf_config.num_experts_per_tok}")
        self.jitter_eps = float(hf_config.router_jitter_noise)
        self.tp_group = tp_group
        self.gate = Router(hf_config.num_local_experts, hf_config.hidden_size)
        self.experts = FusedExperts(hf_config.num_local_experts, hf_config.hidden_size,
                                    hf_config.intermediate_size, tp_group)
        self.batch_invariant = False  # set by enable_batch_invariance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = apply_linear(x, self.gate.weight, invariant=self.batch_invariant)
        ids, weights = sparsemixer_top2(logits, self.jitter_eps)
        return self.tp_group.all_reduce(self.experts(x, ids, weights))


class PhimoeLayer(PreNormRotaryLayer):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = PartialRotaryAttention(
            hf_config, tp_group, hf_config.num_key_value_heads,
            bias=bool(hf_config.attention_bias),
            sliding_window=checked_window(getattr(hf_config, "sliding_window", None)))
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = SparsemixerMoeBlock(hf_config, tp_group)


def phimoe_rotary(hf_config: Any) -> RotaryEmbedding:
    """The rotary table: a LongRoPE one's short rows times short_mscale and its long rows
    times long_mscale (transformers' scales), or the plain table."""
    params = rope_parameters_from_config(hf_config)
    head_dim = head_dim_of(hf_config)
    if params["rope_type"] != "longrope":
        return RotaryEmbedding(head_dim, hf_config.max_position_embeddings, params)
    for key in ("short_mscale", "long_mscale"):
        if not isinstance(params.get(key), (int, float)):
            raise ValueError(f"PhiMoE's LongRoPE needs {key} (a number) in its rope "
                             f"parameters, got {params.get(key)!r}")
    table = RotaryEmbedding(head_dim, hf_config.max_position_embeddings,
                            {**params, "attention_factor": 1.0})
    rows = table.long_rows
    scale = torch.tensor([float(params["short_mscale"])] * rows
                         + [float(params["long_mscale"])] * rows)[:, None]
    for name in ("cos_cache", "sin_cache", "signed_sin_cache"):
        getattr(table, name).mul_(scale)
    return table


_RENAMES = (("lm_head.bias", "lm_head_bias"),)


class PhimoeForCausalLM(DecoderForCausalLM):
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        require_activation(hf_config, "silu")
        self.build_single_stage(hf_config, tp_group, stage, lambda config, group: (
            RotaryDecoderModel(config, group, lambda i: PhimoeLayer(config, group),
                               nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps),
                               rotary=phimoe_rotary(config), with_positions=False)),
                                head_bias=bool(getattr(hf_config, "lm_head_bias", False)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(renamed(weights, _RENAMES))

    @classmethod
    def param_name(cls, hf_name: str) -> tuple[str, Any]:
        hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        return _expert_param(hf_name, _MIXTRAL_EXPERT_PARTS) or _to_param_name(hf_name)
