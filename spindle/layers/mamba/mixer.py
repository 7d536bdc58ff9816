"""The Mamba2 mixer (Bamba's ``mamba`` block): in_proj -> causal conv1d -> SSD scan ->
gated RMSNorm -> out_proj, tensor-parallel, over per-sequence state slots.

Tensor parallelism splits the SSM heads across ranks, and with them every per-head
piece: the gate, x and dt parts of in_proj, x's conv channels, A_log, D, dt_bias, the
norm weight and out_proj's input (row parallel). The B/C groups are split too when
there are at least as many as ranks; otherwise each group is replicated on
tp_size / n_groups consecutive ranks, whose heads all read it. The gated RMSNorm
normalises per group of ``norm_group_size`` features, which each rank holds whole, or
(one group) over the whole intermediate size, its sum of squares all-reduced.

The layer knows nothing of the runner: it reads its step's MambaMetadata from the
forward context (``for_group(self.cache_group)``) and its states from ``kv_cache``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from spindle.cache.spec import MambaCacheSpec
from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.forward_context import get_forward_context
from spindle.layers.linear import (RowParallelLinear, apply_linear, copy_checked, divide,
                                   new_split_counters, set_weight_loader)
from spindle.layers.mamba import ops as torch_ops
from spindle.layers.mamba.metadata import MambaMetadata

# (first row in the full checkpoint tensor, number of rows) of one piece this rank holds.
RowPiece = tuple[int, int]
# How the scan's output meets the gate z (MambaMixer's gate argument).
GATE_THEN_NORM, NORM_THEN_GATE, GATE_ONLY = "gate_then_norm", "norm_then_gate", "gate_only"
GATE_MODES = (GATE_THEN_NORM, NORM_THEN_GATE, GATE_ONLY)


class MambaMixer(nn.Module):
    """forward(hidden_states [T, hidden]) -> [T, hidden] for the step's flat batch.

    ``kv_cache`` is None (the memory-profiling forward: every request starts from zero
    states and nothing is stored) or [conv_state [S, C, K-1], ssm_state [S, H, P, N]]
    with this rank's C conv channels and H heads, assigned by the runner.
    """

    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, n_groups: int,
                 state_size: int, conv_kernel: int, chunk_size: int, eps: float,
                 time_step_limit: tuple[float, float], conv_bias: bool, proj_bias: bool,
                 tp_group: TensorParallelGroup, norm_group_size: int | None = None,
                 gate: str = GATE_THEN_NORM, out_proj_bias: bool | None = None,
                 in_proj_multipliers: Sequence[float] | None = None,
                 limit_decode_steps: bool = True) -> None:
        """gate: how the output meets the gate z: GATE_THEN_NORM (Mamba2's
        weight * rmsnorm(y * silu(z))), NORM_THEN_GATE (weight * rmsnorm(y) * silu(z)) or
        GATE_ONLY (y * silu(z), no norm and no weight). out_proj_bias: out_proj's own
        bias switch (default: proj_bias, as in_proj's). in_proj_multipliers: five
        factors for in_proj's z, x, B, C and dt outputs (FalconH1's maximal-update
        multipliers), applied in the model's dtype after the projection.
        limit_decode_steps: whether time_step_limit also holds in a decode step's update
        (False: in the chunked scan only, as transformers' Zamba2 and mamba_ssm do)."""
        super().__init__()
        if gate not in GATE_MODES:
            raise ValueError(f"gate must be one of {GATE_MODES}, got {gate!r}")
        if in_proj_multipliers is not None and len(in_proj_multipliers) != 5:
            raise ValueError("in_proj_multipliers must hold 5 factors (z, x, B, C, dt), got "
                             f"{list(in_proj_multipliers)}")
        if conv_kernel < 2:
            raise ValueError(f"mamba_d_conv must be >= 2, got {conv_kernel}")
        if num_heads % n_groups != 0:
            raise ValueError(f"mamba_n_heads ({num_heads}) must be a multiple of "
                             f"mamba_n_groups ({n_groups})")
        tp, rank = tp_group.size, tp_group.rank
        self.tp_group = tp_group
        self.num_heads = divide(num_heads, tp, "mamba_n_heads")  # rank-local from here
        self.n_groups, first_group = local_groups(n_groups, tp, rank)
        self.head_dim = head_dim
        self.state_size = state_size
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.decode_time_step_limit = (self.time_step_limit if limit_decode_steps
                                       else (0.0, math.inf))
        self.intermediate = self.num_heads * head_dim
        self.group_width = self.n_groups * state_size
        self.conv_channels = self.intermediate + 2 * self.group_width

        full_inter, full_groups = num_heads * head_dim, n_groups * state_size
        x_rows = (rank * self.intermediate, self.intermediate)
        b_rows = (first_group * state_size, self.group_width)
        c_rows = (full_groups + first_group * state_size, self.group_width)
        head_rows = [(rank * self.num_heads, self.num_heads)]
        # Checkpoint in_proj rows: [gate | x | B | C | dt]; conv channels: [x | B | C].
        conv_rows = [x_rows, _shift(b_rows, full_inter), _shift(c_rows, full_inter)]
        in_rows = ([x_rows] + [_shift(r, full_inter) for r in conv_rows]
                   + [_shift(head_rows[0], 2 * full_inter + 2 * full_groups)])
        self.in_proj = RowPiecesLinear(hidden_size, in_rows, bias=proj_bias)
        scale = None
        if in_proj_multipliers is not None and any(m != 1.0 for m in in_proj_multipliers):
            widths = (self.intermediate, self.intermediate, self.group_width,
                      self.group_width, self.num_heads)
            scale = torch.cat([torch.full((w,), float(m))
                               for w, m in zip(widths, in_proj_multipliers)])
        self.register_buffer("in_proj_scale", scale, persistent=False)
        self.conv1d = DepthwiseConvWeights(conv_rows, conv_kernel, bias=conv_bias)
        self.A_log = _sharded_parameter(head_rows)
        self.D = _sharded_parameter(head_rows)
        self.dt_bias = _sharded_parameter(head_rows)
        self.norm = (SiluGate() if gate == GATE_ONLY else
                     GatedRMSNorm(self.intermediate, full_inter, eps, tp_group, [x_rows],
                                  group_size=norm_group_size,
                                  norm_first=gate == NORM_THEN_GATE))
        self.out_proj = RowParallelLinear(
            full_inter, hidden_size, bias=proj_bias if out_proj_bias is None else out_proj_bias,
            tp_group=tp_group)
        self.kv_cache: list[torch.Tensor] | None = None
        self.cache_group = 0  # which cache group's metadata this layer reads (the runner sets it)

    def cache_spec(self, dtype: torch.dtype) -> MambaCacheSpec:
        """Per sequence: the conv state [C, K-1] and the SSM state [H, P, N], both in the
        model's dtype."""
        return MambaCacheSpec(
            shapes=((self.conv_channels, self.conv_kernel - 1),
                    (self.num_heads, self.head_dim, self.state_size)),
            dtypes=(dtype, dtype))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        md = step_metadata(self, num_tokens, hidden_states.device)
        ops = _ops_for(hidden_states)
        projected = self.in_proj(hidden_states)
        if self.in_proj_scale is not None:
            projected = projected * self.in_proj_scale.to(projected.dtype)
        gate, xbc, dt = projected.split(
            [self.intermediate, self.conv_channels, self.num_heads], dim=-1)
        y = by_step_kind(
            md, self.kv_cache is not None, (xbc, dt),
            prompts_as_prefill=self.decode_time_step_limit != self.time_step_limit,
            decode=lambda xbc, dt, slots: self._decode(ops, xbc, dt, slots),
            prefill=lambda xbc, dt, md: self._prefill(ops, xbc, dt, md))
        y = self.norm(y.reshape(num_tokens, self.intermediate), gate)
        return self.out_proj(y)

    def _decode(self, ops, xbc: torch.Tensor, dt: torch.Tensor,
                state_indices: torch.Tensor) -> torch.Tensor:
        """One token per request, each continuing its stored state."""
        conv_state, ssm_state = self.kv_cache
        xbc = ops.causal_conv1d_decode(xbc, self.conv1d.weight, self.conv1d.bias, conv_state,
                                       state_indices)
        x, B, C = self._split_xbc(xbc)
        return ops.ssd_decode(x, dt, self.A_log, B, C, self.D, self.dt_bias,
                              self.decode_time_step_limit, ssm_state, state_indices)

    def _prefill(self, ops, xbc: torch.Tensor, dt: torch.Tensor,
                 md: MambaMetadata) -> torch.Tensor:
        """Any number of tokens per request: causal conv1d and the chunked SSD scan."""
        conv_state, ssm_state = self.kv_cache if self.kv_cache is not None else (None, None)
        xbc = ops.causal_conv1d_prefill(xbc, self.conv1d.weight, self.conv1d.bias,
                                        conv_state, md)
        x, B, C = self._split_xbc(xbc)
        return ops.ssd_prefill(x, dt, self.A_log, B, C, self.D, self.dt_bias,
                               self.time_step_limit, self.chunk_size, ssm_state, md)

    def _split_xbc(self, xbc: torch.Tensor):
        num_tokens = xbc.shape[0]
        x, B, C = xbc.split([self.intermediate, self.group_width, self.group_width], dim=-1)
        return (x.reshape(num_tokens, self.num_heads, self.head_dim),
                B.reshape(num_tokens, self.n_groups, self.state_size),
                C.reshape(num_tokens, self.n_groups, self.state_size))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, groups={self.n_groups}, "
                f"state={self.state_size}, conv={self.conv_kernel}, chunk={self.chunk_size} "
                f"(per rank), tp_size={self.tp_group.size}")


class RowPiecesLinear(nn.Module):
    """A column-parallel linear layer whose rank-local rows are pieces of the full
    checkpoint weight (any rows, in order), so that replicated and sharded
    sub-projections can share one matmul. rows may also map shard ids to pieces: the
    weight is then the pieces of several checkpoint tensors, one after the other in
    the mapping's order, each loaded with its shard id."""

    def __init__(self, input_size: int,
                 rows: Sequence[RowPiece] | Mapping[Any, Sequence[RowPiece]], bias: bool
                 ) -> None:
        super().__init__()
        sources = dict(rows) if isinstance(rows, Mapping) else {None: rows}
        output_size = sum(n for pieces in sources.values() for _, n in pieces)
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        set_weight_loader(self.weight, sources_loader(sources), list(sources))
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_loader(self.bias, sources_loader(sources), list(sources))
        else:
            self.register_parameter("bias", None)
        self.register_buffer("split_counters", new_split_counters(output_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self.weight, self.bias, self.split_counters)


class DepthwiseConvWeights(nn.Module):
    """The conv1d's weight [C, K] and bias [C] (this rank's channels); checkpoints store
    the weight as nn.Conv1d's [C, 1, K]. rows may map shard ids to pieces, as
    RowPiecesLinear's: the channels of several checkpoint convs one after the other
    (KimiLinear's q_conv1d, k_conv1d and v_conv1d)."""

    def __init__(self, rows: Sequence[RowPiece] | Mapping[Any, Sequence[RowPiece]],
                 kernel: int, bias: bool) -> None:
        super().__init__()
        sources = dict(rows) if isinstance(rows, Mapping) else {None: rows}
        channels = sum(n for pieces in sources.values() for _, n in pieces)
        self.weight = nn.Parameter(torch.empty(channels, kernel), requires_grad=False)
        set_weight_loader(self.weight, sources_loader(sources, squeeze_dim=1), list(sources))
        if bias:
            self.bias = nn.Parameter(torch.empty(channels), requires_grad=False)
            set_weight_loader(self.bias, sources_loader(sources), list(sources))
        else:
            self.register_parameter("bias", None)


class SiluGate(nn.Module):
    """y * silu(gate), no norm (FalconH1 with mamba_rms_norm off)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x * F.silu(gate)


class GatedRMSNorm(nn.Module):
    """y = weight * rmsnorm(x * silu(gate)) (Mamba2's norm with the gate applied first),
    or with norm_first weight * rmsnorm(x) * silu(gate) (FalconH1's norm_before_gate),
    in float32; sigmoid_gate: sigmoid(gate) in place of silu(gate), with norm_first only
    (KimiLinear's output norm). The mean square is over groups of ``group_size``
    consecutive features (intermediate / n_groups: see norm_group_size), or with
    group_size None over the full width of all ranks. A group never straddles two ranks:
    each rank holds whole groups, so only the full-width norm all-reduces."""

    def __init__(self, local_size: int, full_size: int, eps: float,
                 tp_group: TensorParallelGroup, rows: Sequence[RowPiece],
                 group_size: int | None = None, norm_first: bool = False,
                 sigmoid_gate: bool = False) -> None:
        super().__init__()
        if sigmoid_gate and not norm_first:
            raise ValueError("a sigmoid gate is applied after the norm (norm_first)")
        self.sigmoid_gate = sigmoid_gate
        if group_size is not None and (group_size <= 0 or local_size % group_size != 0):
            raise ValueError(f"the gated norm's group size ({group_size}) must divide this "
                             f"rank's width ({local_size} of {full_size}): n_groups must be "
                             "a multiple of the tensor parallel size")
        self.full_size = full_size
        self.group_size = group_size
        self.norm_first = norm_first
        self.variance_epsilon = eps
        self.tp_group = tp_group
        self.weight = nn.Parameter(torch.ones(local_size), requires_grad=False)
        set_weight_loader(self.weight, rows_loader(rows))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (self.tp_group.size == 1 or self.group_size is not None):
            from spindle.layers.mamba import triton_ops

            return triton_ops.gated_rms_norm(x, gate, self.weight, self.variance_epsilon,
                                             self.group_size, self.norm_first,
                                             self.sigmoid_gate)
        h = x.float() if self.norm_first else x.float() * F.silu(gate.float())
        if self.group_size is not None:
            grouped = h.unflatten(-1, (-1, self.group_size))
            grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True)
                                            + self.variance_epsilon)
            h = grouped.flatten(-2)
        else:
            square_sum = self.tp_group.all_reduce(h.pow(2).sum(-1, keepdim=True))
            h = h * torch.rsqrt(square_sum / self.full_size + self.variance_epsilon)
        h = self.weight.float() * h
        if self.norm_first:
            activation = torch.sigmoid if self.sigmoid_gate else F.silu
            h = h * activation(gate.float())
        return h.to(x.dtype)


def time_step_limit(hf_config: Any) -> tuple[float, float]:
    """The config's (low, high) clamp of the discretized dt, (0, inf) without one; read
    from a config object or from raw config.json, where transformers writes infinity
    as {"__float__": "Infinity"}. A limit outside 0 <= low <= high is refused."""
    limit = getattr(hf_config, "time_step_limit", None)
    if limit is None:
        return 0.0, math.inf
    low, high = (float(v["__float__"] if isinstance(v, dict) else v) for v in limit)
    if not 0.0 <= low <= high:
        raise ValueError(f"time_step_limit must be (low, high) with 0 <= low <= high, "
                         f"got {(low, high)}")
    return low, high


def norm_group_size(num_heads: int, head_dim: int, n_groups: int) -> int | None:
    """The gated norm's group: Mamba2 normalises each B/C group's share of the
    intermediate features on its own (as the reference mamba_ssm does, and transformers
    since 5.23); one group is the whole width (None: all-reduced under TP)."""
    return None if n_groups == 1 else num_heads * head_dim // n_groups


def local_groups(n_groups: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(groups this rank holds, index of its first group): split when tp_size divides
    n_groups, else each group replicated on tp_size / n_groups consecutive ranks."""
    if n_groups % tp_size == 0:
        local = n_groups // tp_size
        return local, rank * local
    if tp_size % n_groups == 0:
        return 1, rank // (tp_size // n_groups)
    raise ValueError(f"mamba_n_groups ({n_groups}) and the tensor parallel size ({tp_size}) "
                     "must divide one another")


def step_metadata(layer: nn.Module, num_tokens: int, device: torch.device) -> MambaMetadata:
    """The step's MambaMetadata for a state layer (its ``cache_group``'s, from the
    forward context); without any, the tokens as one request with no state, which only
    a layer without states (the profiling forward) may take."""
    md = get_forward_context().for_group(layer.cache_group)
    if md is None:
        if layer.kv_cache is not None:
            raise ValueError("a state layer with states needs MambaMetadata in the forward "
                             "context")
        return single_sequence_metadata(num_tokens, device)
    if not isinstance(md, MambaMetadata):
        raise TypeError(f"state layer (cache group {layer.cache_group}) found "
                        f"{type(md).__name__} in the forward context, not MambaMetadata")
    return md


def by_step_kind(md: MambaMetadata, has_states: bool, rows: Sequence[torch.Tensor],
                 decode: Callable, prefill: Callable,
                 prompts_as_prefill: bool = False) -> torch.Tensor:
    """A state layer's step: decode(*rows, state_indices) when every request feeds one
    token and continues its stored state; prefill(*rows, md) otherwise (the profiling
    forward, without states, too). A step mixing both sends its decode rows through
    decode (a prefill op would give each of them a whole chunk of work and scratch) and
    the others through prefill, and merges the two.

    prompts_as_prefill: a layer whose decode step computes otherwise than its prefill
    (Zamba2's, as transformers' and mamba_ssm's: dt clamped in the chunked scan only)
    sends a prompt's one-token rows (a prompt cut at a block boundary or a chunked-
    prefill budget) through prefill too, as the reference computes every prompt token."""
    prompts = prompts_as_prefill and md.prompt_rows_cpu is not None
    if has_states and md.is_pure_decode and _all_continuing(md) and not (
            prompts and bool(md.prompt_rows_cpu.any())):
        return decode(*rows, md.state_indices)
    split = decode_prefill_split(md, prompts) if has_states else None
    if split is None:
        return prefill(*rows, md)
    decoded = decode(*(split.take_decode(r) for r in rows), split.decode_slots)
    prefilled = prefill(*(split.take_prefill(r) for r in rows), split.prefill_md)
    return split.merge(decoded, prefilled)


def single_sequence_metadata(num_tokens: int, device: torch.device) -> MambaMetadata:
    """All tokens as one request with no state (a forward run without metadata)."""
    starts = torch.tensor([0, num_tokens], dtype=torch.int32)
    slots = torch.tensor([-1], dtype=torch.int32)
    fresh = torch.tensor([False])
    return MambaMetadata(num_reqs=1, num_tokens=num_tokens, query_start_loc=starts.to(device),
                         state_indices=slots.to(device), has_initial_state=fresh.to(device),
                         max_query_len=num_tokens, query_start_loc_cpu=starts,
                         has_initial_state_cpu=fresh, state_indices_cpu=slots)


def rows_loader(rows: Sequence[RowPiece], squeeze_dim: int | None = None) -> Callable:
    """A weight_loader copying the given rows of the full checkpoint tensor."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter takes no shard id, got {shard_id!r}")
        if squeeze_dim is not None:
            if loaded.dim() != param.dim() + 1 or loaded.shape[squeeze_dim] != 1:
                raise ValueError(f"expected a conv weight [channels, 1, kernel], checkpoint "
                                 f"tensor gives {tuple(loaded.shape)}")
            loaded = loaded.squeeze(squeeze_dim)
        end = max(start + n for start, n in rows)
        if loaded.shape[0] < end:
            raise ValueError(f"checkpoint tensor has {loaded.shape[0]} rows, this rank's "
                             f"pieces need {end}")
        copy_checked(param.data, torch.cat([loaded.narrow(0, s, n) for s, n in rows]))

    return load


def sources_loader(sources: Mapping[Any, Sequence[RowPiece]],
                   squeeze_dim: int | None = None) -> Callable:
    """A weight_loader taking, for each shard id, the given rows of that checkpoint
    tensor into the parameter's rows after the earlier shard ids' (one source under
    shard id None: rows_loader); squeeze_dim as rows_loader's."""
    if list(sources) == [None]:
        return rows_loader(sources[None], squeeze_dim)
    starts, start = {}, 0
    for shard_id, pieces in sources.items():
        starts[shard_id] = (start, sum(n for _, n in pieces))
        start += starts[shard_id][1]

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id not in sources:
            raise ValueError(f"shard id {shard_id!r} is none of {list(sources)}")
        first, count = starts[shard_id]
        rows_loader(sources[shard_id], squeeze_dim)(param.data.narrow(0, first, count),
                                                    loaded)

    return load


def _sharded_parameter(rows: Sequence[RowPiece]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(sum(n for _, n in rows)), requires_grad=False)
    set_weight_loader(param, rows_loader(rows))
    return param


def _shift(piece: RowPiece, offset: int) -> RowPiece:
    return piece[0] + offset, piece[1]


class DecodePrefillSplit:
    """A mixed step's tokens cut into decode rows (one token, continuing its state) and
    the rest. When the decode rows come first (the scheduler serves running requests
    before admitting new ones) both parts are slices; otherwise index gathers."""

    def __init__(self, md: MambaMetadata, decode: torch.Tensor) -> None:
        qsl = md.query_start_loc_cpu.to(torch.int64)
        lens = qsl[1:] - qsl[:-1]
        decode_tokens = qsl[:-1][decode]
        prefill = ~decode
        prefill_lens = lens[prefill]
        prefill_tokens = torch.repeat_interleave(qsl[:-1][prefill], prefill_lens) + (
            torch.arange(int(prefill_lens.sum())) - torch.repeat_interleave(
                torch.cumsum(prefill_lens, 0) - prefill_lens, prefill_lens))
        self.num_tokens = md.num_tokens
        self.num_decode = int(decode.sum())
        self.contiguous = bool((decode_tokens == torch.arange(self.num_decode)).all())
        prefill_qsl = torch.zeros(len(prefill_lens) + 1, dtype=torch.int32)
        torch.cumsum(prefill_lens, 0, out=prefill_qsl[1:])
        slots = md.state_indices_cpu
        host = torch.cat([slots[decode].to(torch.int64), prefill_qsl.to(torch.int64),
                          slots[prefill].to(torch.int64), decode_tokens, prefill_tokens])
        device = md.query_start_loc.device
        if device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        parts = dev.split([self.num_decode, len(prefill_qsl), int(prefill.sum()),
                           self.num_decode, len(prefill_tokens)])
        self.decode_slots = parts[0].to(torch.int32)
        self._decode_index, self._prefill_index = parts[3], parts[4]
        has_initial = md.has_initial_state_cpu[prefill]
        self.prefill_md = MambaMetadata(
            num_reqs=int(prefill.sum()), num_tokens=len(prefill_tokens),
            query_start_loc=parts[1].to(torch.int32), state_indices=parts[2].to(torch.int32),
            has_initial_state=has_initial.to(device, non_blocking=True),
            max_query_len=int(prefill_lens.max()), query_start_loc_cpu=prefill_qsl,
            has_initial_state_cpu=has_initial, state_indices_cpu=slots[prefill],
            prompt_rows_cpu=None if md.prompt_rows_cpu is None else md.prompt_rows_cpu[prefill])

    def take_decode(self, t: torch.Tensor) -> torch.Tensor:
        return t[:self.num_decode] if self.contiguous else t.index_select(0, self._decode_index)

    def take_prefill(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.num_decode:] if self.contiguous else t.index_select(0, self._prefill_index)

    def merge(self, decoded: torch.Tensor, prefilled: torch.Tensor) -> torch.Tensor:
        if self.contiguous:
            return torch.cat([decoded, prefilled])
        out = decoded.new_empty((self.num_tokens, *decoded.shape[1:]))
        out.index_copy_(0, self._decode_index, decoded)
        out.index_copy_(0, self._prefill_index, prefilled)
        return out


def decode_prefill_split(md: MambaMetadata, prompts_as_prefill: bool = False
                         ) -> DecodePrefillSplit | None:
    """The split of a step mixing decode rows and prefills (kept in md.derived for the
    step's other layers); None when the step is not mixed or has no host copies.
    prompts_as_prefill: a prompt's one-token rows count as prefill (by_step_kind)."""
    key = ("decode_prefill_split", prompts_as_prefill)
    if key not in md.derived:
        md.derived[key] = _make_split(md, prompts_as_prefill)
    return md.derived[key]


def _make_split(md: MambaMetadata, prompts_as_prefill: bool) -> DecodePrefillSplit | None:
    if (md.query_start_loc_cpu is None or md.has_initial_state_cpu is None
            or md.state_indices_cpu is None):
        return None
    lens = md.query_start_loc_cpu[1:] - md.query_start_loc_cpu[:-1]
    decode = (lens == 1) & md.has_initial_state_cpu & (md.state_indices_cpu >= 0)
    if prompts_as_prefill and md.prompt_rows_cpu is not None:
        decode &= ~md.prompt_rows_cpu
    if not decode.any() or bool(decode.all()):
        return None
    return DecodePrefillSplit(md, decode)


def _all_continuing(md: MambaMetadata) -> bool:
    """Whether every request continues from its stored state. The decode ops always
    read the state; a request at its first token needs the prefill ops, which start it
    from zeros. (Without host copies, inside a CUDA graph, the runner vouches for it.)"""
    if md.has_initial_state_cpu is None:
        return True
    continuing = md.has_initial_state_cpu
    if md.state_indices_cpu is not None:
        continuing = continuing | (md.state_indices_cpu < 0)  # padding rows touch no state
    return bool(continuing.all())


def _ops_for(x: torch.Tensor):
    """The torch ops on CPU, the Triton kernels (same signatures) on CUDA."""
    if x.is_cuda:
        from spindle.layers.mamba import triton_ops

        return triton_ops
    return torch_ops
