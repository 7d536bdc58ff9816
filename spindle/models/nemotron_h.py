"""NemotronHForCausalLM: NVIDIA's Nemotron-H hybrids (Nemotron-H 8B/47B, Nemotron Nano 2,
Nemotron 3): Mamba2 layers, a few attention layers and squared-ReLU MLPs or experts,
each its own layer.

Every layer is ``x + mixer(norm(x))`` where the mixer is one of (``layers_block_type``,
or the older ``hybrid_override_pattern`` letters):

- ``linear_attention`` (M): a Mamba2 block (spindle/layers/mamba/mixer.py), whose gated
  norm normalises each B/C group's share of the features on its own;
- ``full_attention`` (*): grouped-query attention without positions (no rotary) and
  without biases, as transformers builds it whatever ``attention_bias`` says;
- ``mlp`` (-): up_proj, relu(x)^2, down_proj;
- ``moe`` (E: Nemotron 3): experts of that MLP's shape (layers/moe.py's FusedExperts,
  gated=False; the fused grouped GEMMs on a GPU), routed by sigmoid scores with a
  per-expert correction bias for the choice only, the best ``topk_group`` of
  ``n_group`` expert groups first (DeepSeek-V3's routing, all in float32), plus a
  shared expert, and optionally a latent projection around the routed experts.

The norms multiply by their weight in float32 before the one cast back (transformers'
NemotronHRMSNorm); the residual stream stays in the model's dtype, as transformers adds
it. Checkpoint names
are transformers' (``model.layers.N.mixer.*``, ``model.embeddings``, ``model.norm_f``);
the hub's ``backbone.`` prefix loads too, and multi-token-prediction tensors (``mtp.``)
are skipped: they serve speculative decoding, which this model does not use. The LM head
is never tied to the embedding, as in transformers (whose NemotronH ties nothing).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from spindle.attention import Attention
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.distributed.pipeline import PipelineStage
from spindle.layers.activation import relu_squared
from spindle.layers.embedding import VocabParallelEmbedding
from spindle.layers.linear import (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                   apply_linear, default_weight_loader, set_weight_loader)
from spindle.layers.mamba.mixer import MambaMixer, time_step_limit
from spindle.layers.moe import FusedExperts
from spindle.layers.norm import Float32WeightRMSNorm
from spindle.models.causal_lm import DecoderForCausalLM, embedded
from spindle.models.llama import _to_param_name, head_dim_of
from spindle.models.mamba2 import mamba2_mixer
from spindle.models.moe import _expert_param, one_per_expert
from spindle.models.weights import load_named_weights

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
# hybrid_override_pattern's letters (configs written before layers_block_type).
PATTERN_LETTERS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}


def layer_types(hf_config: Any) -> list[str]:
    """Each layer's kind, from layers_block_type or hybrid_override_pattern."""
    types = getattr(hf_config, "layers_block_type", None)
    if types is None:
        pattern = getattr(hf_config, "hybrid_override_pattern", None)
        if pattern is None:
            raise ValueError("a NemotronH config needs layers_block_type or "
                             "hybrid_override_pattern")
        unknown = sorted(set(pattern) - set(PATTERN_LETTERS))
        if unknown:
            raise ValueError(f"hybrid_override_pattern {pattern!r} holds {unknown}; "
                             f"known: {sorted(PATTERN_LETTERS)}")
        types = [PATTERN_LETTERS[letter] for letter in pattern]
    return list(types)


def check_supported_config(hf_config: Any) -> None:
    """Reject config features this implementation would silently get wrong."""
    types = layer_types(hf_config)
    unknown = sorted(set(types) - {MAMBA, ATTENTION, MLP, MOE})
    if unknown:
        raise ValueError(f"layers_block_type holds unknown layer types {unknown}")
    if MOE in types:
        check_routing(hf_config)
    for field, expected in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        value = getattr(hf_config, field, expected)
        if value != expected:
            raise ValueError(f"{field} {value!r} is not supported (only {expected!r})")
    if getattr(hf_config, "sliding_window", None) is not None:
        raise ValueError("NemotronH attention with a sliding_window is not supported")
    time_step_limit(hf_config)  # (refuses a bad one)


def check_routing(hf_config: Any) -> None:
    """The experts' grouping and top-k must leave the router a choice to make."""
    experts, groups = hf_config.n_routed_experts, getattr(hf_config, "n_group", 1) or 1
    top_k, top_groups = hf_config.num_experts_per_tok, getattr(hf_config, "topk_group", 1) or 1
    if experts % groups or experts // groups < 2:
        raise ValueError(f"n_routed_experts ({experts}) must split into n_group ({groups}) "
                         "groups of at least 2 (a group scores by its best two)")
    if not 1 <= top_groups <= groups:
        raise ValueError(f"topk_group ({top_groups}) must be in 1..n_group ({groups})")
    reachable = top_groups * (experts // groups)
    if not 1 <= top_k <= reachable:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..{reachable} (the "
                         "experts of the chosen groups)")


class NemotronHAttention(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.head_dim = head_dim_of(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size, self.head_dim, hf_config.num_attention_heads,
            hf_config.num_key_value_heads, bias=False, tp_group=tp_group)
        self.num_heads = self.qkv_proj.num_heads  # rank-local
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(hf_config.num_attention_heads * self.head_dim,
                                        hf_config.hidden_size, bias=False, tp_group=tp_group)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              self.num_kv_heads)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden_states))
        return self.o_proj(self.attn(q, k, v))


class NemotronHMLP(nn.Module):
    """down_proj(relu(up_proj(x))^2): no gate."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = bool(getattr(hf_config, "mlp_bias", False))
        inter = intermediate_size or hf_config.intermediate_size
        self.up_proj = ColumnParallelLinear(hf_config.hidden_size, inter, bias=bias,
                                            tp_group=tp_group)
        self.down_proj = RowParallelLinear(inter, hf_config.hidden_size, bias=bias,
                                           tp_group=tp_group)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_squared(self.up_proj(hidden_states)))


class NemotronHRouter(nn.Module):
    """Sigmoid scores of a float32 [E, H] linear; the choice adds e_score_correction_bias
    and keeps only the best topk_group of n_group groups (a group scores by the sum of
    its best two); the chosen experts weigh by their scores without the bias,
    renormalised when norm_topk_prob, times routed_scaling_factor. Replicated: every
    rank routes alike."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        experts = hf_config.n_routed_experts
        self.top_k = hf_config.num_experts_per_tok
        self.num_groups = getattr(hf_config, "n_group", 1) or 1
        self.top_groups = getattr(hf_config, "topk_group", 1) or 1
        self.normalize = bool(getattr(hf_config, "norm_topk_prob", True))
        self.scaling = float(getattr(hf_config, "routed_scaling_factor", 1.0))
        f32 = dict(dtype=torch.float32)  # (float32 whatever the model's dtype, as HF keeps them)
        self.weight = nn.Parameter(torch.empty(experts, hf_config.hidden_size, **f32),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts, **f32),
                                                    requires_grad=False)
        for param in (self.weight, self.e_score_correction_bias):
            set_weight_loader(param, default_weight_loader)
        self.batch_invariant = False  # set by enable_batch_invariance

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], their float32 weights [T, k])."""
        scores = torch.sigmoid(apply_linear(x.float(), self.weight,
                                            invariant=self.batch_invariant))
        choice = scores + self.e_score_correction_bias
        if self.top_groups < self.num_groups:
            grouped = choice.view(x.shape[0], self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            best = group_scores.topk(self.top_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class NemotronHMoE(nn.Module):
    """Routed squared-ReLU experts (behind a latent projection where the config has
    moe_latent_size) plus a shared expert of the same kind."""

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        hidden, latent = hf_config.hidden_size, getattr(hf_config, "moe_latent_size", None)
        self.tp_group = tp_group
        self.gate = NemotronHRouter(hf_config)
        self.experts = FusedExperts(hf_config.n_routed_experts, latent or hidden,
                                    hf_config.moe_intermediate_size, tp_group, gated=False)
        self.shared_experts = NemotronHMLP(
            hf_config, tp_group, hf_config.moe_shared_expert_intermediate_size)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent:  # (small, so replicated on every rank)
            bias, single = bool(getattr(hf_config, "mlp_bias", False)), TensorParallelGroup.single()
            self.fc1_latent_proj = ColumnParallelLinear(hidden, latent, bias=bias, tp_group=single)
            self.fc2_latent_proj = ColumnParallelLinear(latent, hidden, bias=bias, tp_group=single)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        routed = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        routed = self.tp_group.all_reduce(self.experts(routed, ids, weights))
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


def make_mixer(hf_config: Any, tp_group: TensorParallelGroup) -> MambaMixer:
    return mamba2_mixer(hf_config, tp_group, hf_config.mamba_num_heads,
                        hf_config.mamba_head_dim, hf_config.ssm_state_size)


MIXERS = {MAMBA: make_mixer, ATTENTION: NemotronHAttention, MLP: NemotronHMLP,
          MOE: NemotronHMoE}


class NemotronHBlock(nn.Module):
    def __init__(self, hf_config: Any, kind: str, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.norm = Float32WeightRMSNorm(hf_config.hidden_size, eps=hf_config.layer_norm_epsilon)
        self.mixer = MIXERS[kind](hf_config, tp_group)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.mixer(self.norm(hidden_states))


class NemotronHModel(nn.Module):
    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                                   tp_group=tp_group)
        self.layers = nn.ModuleList(NemotronHBlock(hf_config, kind, tp_group)
                                    for kind in layer_types(hf_config))
        self.norm_f = Float32WeightRMSNorm(hf_config.hidden_size, eps=hf_config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                intermediate_tensors: Any = None) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden] (positions are unused: attention
        has no rotary, and the Mamba states carry the order)."""
        hidden_states = embedded(self.embed_tokens, input_ids, inputs_embeds)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm_f(hidden_states)


class NemotronHForCausalLM(DecoderForCausalLM):
    model_kind = "hybrid"
    supports_pipeline_parallel = False

    def __init__(self, hf_config: Any, tp_group: TensorParallelGroup,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        check_supported_config(hf_config)
        # transformers' NemotronH ties nothing, whatever tie_word_embeddings says: its
        # checkpoints always hold lm_head.weight.
        self.build_single_stage(hf_config, tp_group, stage, NemotronHModel, tie=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into this rank's parameters (q/k/v_proj into
        the merged qkv_proj; the MLP's up_proj stays itself; experts one at a time,
        stacked as transformers saves them or not, as the hub has them)."""
        return load_named_weights(self, _experts_one_by_one(weights), self._param_name)

    def _param_name(self, hf_name: str) -> tuple[str, Any] | None:
        if hf_name.startswith("mtp."):
            return None
        if hf_name.startswith("backbone."):  # the hub checkpoints' prefix
            hf_name = "model." + hf_name[len("backbone."):]
        for old in ("model.embeddings.", "model.embedding."):
            if hf_name.startswith(old):
                hf_name = "model.embed_tokens." + hf_name[len(old):]
        expert = _expert_param(hf_name, _EXPERT_PARTS)
        if expert is not None:
            return expert
        if hf_name.endswith((".up_proj.weight", ".up_proj.bias")):
            return hf_name, None  # (not a gate_up shard: the MLP has no gate)
        return _to_param_name(hf_name)


_EXPERT_PARTS = {"up_proj": "up", "down_proj": "down"}


def _experts_one_by_one(weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' stacked expert tensors (mixer.experts.up_proj [E, I, H]) as the
    hub's one per expert (mixer.experts.N.up_proj.weight); other tensors as they are."""
    for name, tensor in weights:
        stem, sep, leaf = name.rpartition(".experts.")
        if sep and leaf in _EXPERT_PARTS:
            yield from one_per_expert(stem + ".experts", leaf, tensor)
        else:
            yield name, tensor
