"""Gated DeltaNet (Qwen3-Next's ``linear_attn`` layers): in_proj -> causal conv1d over
q, k and v (SiLU) -> the gated delta rule (layers/mamba/gated_delta.py) -> an RMSNorm
of each value head gated by z -> out_proj, over per-sequence state slots.

Checkpoint layouts of the input projection (``projections``):
- INTERLEAVED (Qwen3-Next): ``in_proj_qkvz`` holds, key head after key head, that
  head's [q (Dk) | k (Dk) | v (r * Dv) | z (r * Dv)] for the r = Hv / Hk value heads it
  serves; ``in_proj_ba`` likewise [b (r) | a (r)].
- SPLIT (Qwen3.5): ``in_proj_qkv`` [q of every head | k | v], ``in_proj_z``,
  ``in_proj_b`` and ``in_proj_a``, loaded into the two projections here under the
  shard ids "qkv", "z", "b" and "a".
- SEPARATE (OLMo Hybrid): ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (z), ``b_proj``
  and ``a_proj``, under the shard ids "q", "k", "v", "z", "b" and "a".
Either way the rows are arranged at load time as [q | k | v | z] and [b | a] of this
rank's heads, the conv channels' order ([q of every head | k | v]), so that the conv
input is one slice of one matmul's output.

Tensor parallelism splits the key heads across ranks, and with each key head its value
heads: every piece of the layer (conv channels, A_log, dt_bias, the states) splits
with them; out_proj is row parallel. The output norm normalises each value head on
its own, so no rank needs another's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spindle.cache.spec import MambaCacheSpec
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.layers.linear import RowParallelLinear, copy_checked, divide, set_weight_loader
from spindle.layers.mamba import gated_delta
from spindle.layers.mamba.metadata import MambaMetadata
from spindle.layers.mamba.mixer import (DepthwiseConvWeights, GatedRMSNorm, RowPiece,
                                        RowPiecesLinear, _ops_for, _sharded_parameter,
                                        by_step_kind, step_metadata)


INTERLEAVED, SPLIT, SEPARATE = "interleaved", "split", "separate"
# The split and separate layouts' checkpoint tensors: (our projection, shard id).
SPLIT_PROJECTIONS = {"in_proj_qkv": ("in_proj_qkvz", "qkv"), "in_proj_z": ("in_proj_qkvz", "z"),
                     "in_proj_b": ("in_proj_ba", "b"), "in_proj_a": ("in_proj_ba", "a")}
SEPARATE_PROJECTIONS = {"q_proj": ("in_proj_qkvz", "q"), "k_proj": ("in_proj_qkvz", "k"),
                        "v_proj": ("in_proj_qkvz", "v"), "g_proj": ("in_proj_qkvz", "z"),
                        "b_proj": ("in_proj_ba", "b"), "a_proj": ("in_proj_ba", "a")}


class GatedDeltaNet(nn.Module):
    """forward(hidden_states [T, hidden]) -> [T, hidden] for the step's flat batch.

    ``kv_cache`` is None (the memory-profiling forward) or [conv_state [S, C, K-1],
    recurrent_state [S, Hv, Dk, Dv]] with this rank's channels and value heads, assigned
    by the runner. The recurrent state is float32 whatever the model's dtype, as
    transformers keeps it: the delta rule subtracts what the state already predicts,
    and a bf16 state would round that difference away."""

    def __init__(self, *, hidden_size: int, num_key_heads: int, num_value_heads: int,
                 key_head_dim: int, value_head_dim: int, conv_kernel: int, eps: float,
                 tp_group: TensorParallelGroup, projections: str = INTERLEAVED,
                 beta_scale: float = 1.0, chunk_size: int = 64) -> None:
        """eps: the output norm's; beta_scale: a factor on beta (OLMo's
        ``linear_allow_neg_eigval``: 2)."""
        super().__init__()
        if projections not in (INTERLEAVED, SPLIT, SEPARATE):
            raise ValueError(f"projections must be one of {INTERLEAVED!r}, {SPLIT!r}, "
                             f"{SEPARATE!r}, got {projections!r}")
        if num_value_heads % num_key_heads != 0:
            raise ValueError(f"linear_num_value_heads ({num_value_heads}) must be a multiple "
                             f"of linear_num_key_heads ({num_key_heads})")
        if conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {conv_kernel}")
        tp, rank = tp_group.size, tp_group.rank
        self.tp_group = tp_group
        self.num_key_heads = divide(num_key_heads, tp, "linear_num_key_heads")  # rank-local
        self.num_value_heads = num_value_heads // num_key_heads * self.num_key_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.beta_scale = float(beta_scale)
        self.key_width = self.num_key_heads * key_head_dim
        self.value_width = self.num_value_heads * value_head_dim
        self.conv_channels = 2 * self.key_width + self.value_width

        full_key = num_key_heads * key_head_dim
        conv_rows = [(rank * self.key_width, self.key_width),
                     (full_key + rank * self.key_width, self.key_width),
                     (2 * full_key + rank * self.value_width, self.value_width)]
        value_heads = [(rank * self.num_value_heads, self.num_value_heads)]
        if projections == INTERLEAVED:
            qkvz_rows, ba_rows = _interleaved_rows(
                range(rank * self.num_key_heads, (rank + 1) * self.num_key_heads),
                num_value_heads // num_key_heads, key_head_dim, value_head_dim)
        else:
            z_rows = [(rank * self.value_width, self.value_width)]
            qkvz_rows = ({"qkv": conv_rows, "z": z_rows} if projections == SPLIT else
                         {"q": conv_rows[:1], "k": [(rank * self.key_width, self.key_width)],
                          "v": [(rank * self.value_width, self.value_width)], "z": z_rows})
            ba_rows = {"b": value_heads, "a": value_heads}
        self.in_proj_qkvz = RowPiecesLinear(hidden_size, qkvz_rows, bias=False)
        self.in_proj_ba = RowPiecesLinear(hidden_size, ba_rows, bias=False)
        self.conv1d = DepthwiseConvWeights(conv_rows, conv_kernel, bias=False)
        self.A_log = _sharded_parameter(value_heads)
        self.dt_bias = _sharded_parameter(value_heads)
        # One weight [Dv] for every value head, stored tiled so the gated norm's kernel
        # reads it as a per-feature weight.
        self.norm = GatedRMSNorm(self.value_width, self.value_width, eps, tp_group, [],
                                 group_size=value_head_dim, norm_first=True)
        set_weight_loader(self.norm.weight, tiled_loader(self.num_value_heads))
        self.out_proj = RowParallelLinear(num_value_heads * value_head_dim, hidden_size,
                                          bias=False, tp_group=tp_group)
        self.kv_cache: list[torch.Tensor] | None = None
        self.cache_group = 0  # which cache group's metadata this layer reads (the runner sets it)

    def cache_spec(self, dtype: torch.dtype) -> MambaCacheSpec:
        """Per sequence: the conv state [C, K-1] in the model's dtype and the recurrent
        state [Hv, Dk, Dv] in float32."""
        return MambaCacheSpec(
            shapes=((self.conv_channels, self.conv_kernel - 1),
                    (self.num_value_heads, self.key_head_dim, self.value_head_dim)),
            dtypes=(dtype, torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, z = self.in_proj_qkvz(hidden_states).split(
            [self.conv_channels, self.value_width], dim=-1)
        b, a = self.in_proj_ba(hidden_states).chunk(2, dim=-1)
        y = delta_rule_step(self, qkv, a, b, self.dt_bias, self.chunk_size, self.beta_scale)
        y = self.norm(y.reshape(hidden_states.shape[0], self.value_width), z)
        return self.out_proj(y)

    def _split_qkv(self, qkv: torch.Tensor):
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.key_width, self.key_width, self.value_width], dim=-1)
        return (q.reshape(num_tokens, self.num_key_heads, self.key_head_dim),
                k.reshape(num_tokens, self.num_key_heads, self.key_head_dim),
                v.reshape(num_tokens, self.num_value_heads, self.value_head_dim))

    def extra_repr(self) -> str:
        return (f"key_heads={self.num_key_heads}, value_heads={self.num_value_heads}, "
                f"key_dim={self.key_head_dim}, value_dim={self.value_head_dim}, "
                f"conv={self.conv_kernel} (per rank), tp_size={self.tp_group.size}")


def delta_rule_step(layer: nn.Module, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    dt_bias: torch.Tensor, chunk_size: int = 64,
                    beta_scale: float = 1.0) -> torch.Tensor:
    """A gated delta layer's step (GatedDeltaNet's, KimiDeltaAttention's) from its
    projections: the causal conv (SiLU) over qkv [T, C] and the gated delta rule, decode
    rows by the decode ops and the rest by the prefill ops (by_step_kind), over the
    layer's conv1d, A_log, states (kv_cache) and _split_qkv -> [T, Hv, Dv]."""
    md = step_metadata(layer, qkv.shape[0], qkv.device)
    conv_ops, delta_ops = _ops_for(qkv), delta_ops_for(qkv)
    states = layer.kv_cache if layer.kv_cache is not None else (None, None)
    weight = layer.conv1d.weight

    def decode(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
        qkv = conv_ops.causal_conv1d_decode(qkv, weight, None, states[0], slots)
        return delta_ops.gated_delta_decode(*layer._split_qkv(qkv), a, b, layer.A_log, dt_bias,
                                            states[1], slots, beta_scale=beta_scale)

    def prefill(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                md: MambaMetadata) -> torch.Tensor:
        qkv = conv_ops.causal_conv1d_prefill(qkv, weight, None, states[0], md)
        return delta_ops.gated_delta_prefill(*layer._split_qkv(qkv), a, b, layer.A_log,
                                             dt_bias, states[1], md, chunk_size,
                                             beta_scale=beta_scale)

    return by_step_kind(md, layer.kv_cache is not None, (qkv, a, b), decode, prefill)


def projection_param(hf_name: str, projections: dict[str, tuple[str, Any]]
                     ) -> tuple[str, Any] | None:
    """A ``...linear_attn.<projection>.<tail>`` checkpoint name as (our parameter, its
    shard id) for the projections of a SPLIT or SEPARATE layout; None for any other."""
    stem, found, leaf = hf_name.rpartition(".linear_attn.")
    projection, _, tail = leaf.partition(".")
    if not found or projection not in projections:
        return None
    ours, shard_id = projections[projection]
    return f"{stem}.linear_attn.{ours}.{tail}", shard_id


def _interleaved_rows(heads: range, per_key: int, key_dim: int, value_dim: int
                      ) -> tuple[list[RowPiece], list[RowPiece]]:
    """The rows of Qwen3-Next's in_proj_qkvz and in_proj_ba that the key heads hold, as
    [q of each head | k | v | z] and [b | a]."""
    head_rows = 2 * key_dim + 2 * per_key * value_dim
    offsets = (0, key_dim, 2 * key_dim, 2 * key_dim + per_key * value_dim)
    widths = (key_dim, key_dim, per_key * value_dim, per_key * value_dim)
    qkvz = [(h * head_rows + offset, width) for offset, width in zip(offsets, widths)
            for h in heads]
    ba = [(h * 2 * per_key + offset, per_key) for offset in (0, per_key) for h in heads]
    return qkvz, ba


def delta_ops_for(x: torch.Tensor) -> Any:
    """The gated delta rule's ops: torch on the CPU; on CUDA the Triton decode step
    and the torch prefill, or the Triton one with SPINDLE_GDN_TRITON_PREFILL=1
    (gated_delta_triton.py)."""
    if x.is_cuda:
        from spindle.layers.mamba import gated_delta_triton

        return gated_delta_triton
    return gated_delta


def tiled_loader(copies: int):
    """A weight_loader storing the checkpoint's [D] weight as ``copies`` copies end to end."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter takes no shard id, got {shard_id!r}")
        copy_checked(param.data, loaded.repeat(copies))

    return load


def gated_delta_net(hf_config: Any, tp_group: TensorParallelGroup,
                    projections: str = INTERLEAVED, **options: Any) -> GatedDeltaNet:
    """The layer of a config's ``linear_*`` fields (Qwen3-Next, Qwen3.5, OLMo Hybrid);
    options: further GatedDeltaNet arguments, or its eps (default rms_norm_eps)."""
    fields = dict(
        hidden_size=hf_config.hidden_size, num_key_heads=hf_config.linear_num_key_heads,
        num_value_heads=hf_config.linear_num_value_heads,
        key_head_dim=hf_config.linear_key_head_dim,
        value_head_dim=hf_config.linear_value_head_dim,
        conv_kernel=hf_config.linear_conv_kernel_dim, eps=hf_config.rms_norm_eps)
    return GatedDeltaNet(**{**fields, **options}, projections=projections, tp_group=tp_group)
