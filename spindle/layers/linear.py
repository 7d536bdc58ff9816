"""Tensor-parallel linear layers.

Every layer holds only its rank's shard of the weight, and every parameter carries a
``weight_loader(param, loaded_weight, shard_id=None)`` attribute that copies that
shard out of the *full* checkpoint tensor, so tensor parallelism is decided at load
time and checkpoints are never pre-sharded. With a one-rank group every layer is a
plain ``nn.Linear`` (same math, no communication).

Layouts follow Megatron:

* column parallel: the output features are split; each rank computes a slice of the
  output and no communication is needed (the next row-parallel layer consumes the slice);
* row parallel: the input features are split; each rank computes a partial sum and the
  partial sums are all-reduced.

Merged layers (gate/up, q/k/v) are column parallel layers whose rank-local weight is
the concatenation of each sub-projection's rank-local slice; ``shard_id`` says which
sub-projection a checkpoint tensor is. ``param.shard_ids`` lists the shard ids that
must all be loaded before the parameter is complete (the model's ``load_weights``
uses it to report partially loaded parameters).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from spindle.distributed.parallel_state import TensorParallelGroup
from spindle.forward_context import current_lora
from spindle.layers import cpu_kernels
from spindle.layers.fp8 import FP8_DTYPE, fp8_linear, quantize_rows
from spindle.layers.int4 import GroupQuantized, Int4Weight
from spindle.switches import on_off


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor parallel size "
                         f"({denominator})")
    return numerator // denominator


def copy_checked(param: torch.Tensor, loaded: torch.Tensor | GroupQuantized) -> None:
    """Copy loaded into param (casting dtype/device; a group-quantized tensor is
    dequantized), refusing shape mismatches."""
    if isinstance(loaded, GroupQuantized):
        loaded = loaded.dequantize(param.dtype)
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter shard has shape {tuple(param.shape)}, "
                         f"checkpoint tensor gives {tuple(loaded.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                          shard_id: Any = None) -> None:
    """Loader of replicated (unsharded) parameters such as norm weights."""
    if shard_id is not None:
        raise ValueError(f"replicated parameter got a shard id {shard_id!r}")
    copy_checked(param.data, loaded_weight)


# "0": a SwiGLU MLP's down projection on a CUDA decode step runs the activation kernel
# and then the skinny GEMM, instead of the GEMM applying the activation as it loads.
SKINNY_SILU_ENV = "SPINDLE_SKINNY_SILU"

# "0": the skinny GEMMs of o_proj and down_proj merge their split-K partials
# themselves, instead of leaving them to the RMSNorm after them (skinny_gemm.SplitKPartials).
SKINNY_DEFER_ENV = "SPINDLE_SKINNY_DEFER_MERGE"

# The smallest N tile the skinny GEMM may use: it sizes the split-K counters.
SKINNY_MIN_BLOCK_N = 16


def new_split_counters(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Zeroed arrival counters for the skinny GEMM's split-K launches with an [n, K]
    weight, one per N tile. Owned by the caller (each linear layer keeps its own as a
    buffer): every launch leaves them at zero, and launches sharing them must run one
    after another, as one layer's do."""
    return torch.zeros(-(-n // SKINNY_MIN_BLOCK_N), dtype=torch.int32, device=device)


def apply_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 split_counters: torch.Tensor | None = None,
                 invariant: bool = False, defer_merge: bool = False):
    """F.linear, or at decode-sized batches a GEMM made for few rows: on CUDA (<= 16
    rows) the skinny GEMM, which streams the weight at close to memory bandwidth where
    cuBLAS does not (it splits K only when given split_counters); on the CPU in bf16
    (<= 32 rows) cpu_kernels.bf16_linear, faster than torch's GEMM there. invariant: the
    batch-invariant GEMM (batch_invariant.py) instead. defer_merge: the skinny GEMM may
    return its split-K partials unsummed (skinny_gemm.SplitKPartials) for an RMSNorm to
    add up."""
    if invariant:
        from spindle.layers.batch_invariant import invariant_linear

        return invariant_linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x.is_cuda:
        from spindle.layers.skinny_gemm import skinny_linear, use_skinny_gemm

        if not use_skinny_gemm(x2, weight):
            return F.linear(x, weight, bias)
        y = skinny_linear(x2, weight, bias, counters=split_counters,
                          defer_merge=defer_merge and x.dim() == 2)
        if not isinstance(y, torch.Tensor):
            return y
    elif cpu_kernels.applies(x):
        y = cpu_kernels.bf16_linear(x2, weight, bias)
    else:
        return F.linear(x, weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def set_weight_loader(param: nn.Parameter, loader: Any, shard_ids: Sequence[Any] = (None,)) -> None:
    param.weight_loader = loader
    param.shard_ids = tuple(shard_ids)


def drop_weight_loaders(model: nn.Module) -> None:
    """Take what set_weight_loader put on model's parameters off them. A loader that is
    a bound method of the parameter's own module makes a cycle (module -> parameter ->
    loader -> module), which only a full garbage collection frees; without the loaders
    the model's memory goes as soon as its last reference does."""
    for param in model.parameters():
        param.__dict__.pop("weight_loader", None)
        param.__dict__.pop("shard_ids", None)


class _ParallelLinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool,
                 tp_group: TensorParallelGroup) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.input_size = input_size  # rank-local sizes
        self.output_size = output_size
        # torch.empty: the values come from the checkpoint; no point initialising them.
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        # Scratch of the skinny GEMM (decode on CUDA); not part of any checkpoint.
        self.register_buffer("split_counters", new_split_counters(output_size), persistent=False)
        self.batch_invariant = False  # set by enable_batch_invariance (batch_invariant.py)
        self.weight_scale: nn.Parameter | None = None  # float8 weights only (use_fp8_weight)
        self.int4: Int4Weight | None = None  # int4 weights only (use_int4_weight)
        # LoRA adapters' slots (lora/layers.py), where the engine serves adapters.
        self.lora: nn.Module | None = None

    def use_fp8_weight(self) -> None:
        """Hold the weight as float8 e4m3 with a float32 scale per output row (fp8.py);
        called before loading, so the loaders quantize each shard as they copy it. The
        scale is filled by the weight's loader (``loaded_with``), not by a tensor of
        its own."""
        old = self.weight
        self.weight = nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device),
                                   requires_grad=False)
        set_weight_loader(self.weight, old.weight_loader, old.shard_ids)
        self.weight_scale = nn.Parameter(torch.ones(old.shape[0], dtype=torch.float32,
                                                    device=old.device), requires_grad=False)
        self.weight_scale.loaded_with = "weight"

    def use_int4_weight(self) -> None:
        """Hold the weight in torch's CPU int4 layout (int4.py); called before loading:
        the loaders stage each shard, and int4.finish_loading packs them."""
        self.int4 = Int4Weight(self, self.output_size, self.input_size)

    def _copy_rows(self, param: nn.Parameter, src: torch.Tensor | GroupQuantized,
                   offset: int | None = None, rows: int | None = None) -> None:
        """Copy src into param (offset None) or into its rows offset..offset+rows,
        quantizing them for a float8 weight, staging them for an int4 one."""
        if self.int4 is not None and param is self.weight:
            if offset is None and src.shape[0] != self.output_size:
                raise ValueError(f"shape mismatch: parameter shard has {self.output_size} rows, "
                                 f"checkpoint tensor gives shape {tuple(src.shape)}")
            self.int4.write_rows(src, offset or 0)
            return
        dst = param.data if offset is None else param.data.narrow(0, offset, rows)
        if param is not self.weight or self.weight_scale is None:
            copy_checked(dst, src)
            return
        if src.shape != dst.shape:
            copy_checked(dst, src)  # raises the shape mismatch
        q, scale = quantize_rows(src.to(dst.device))
        copy_checked(dst, q)
        copy_checked(self.weight_scale.data.narrow(0, offset or 0, dst.shape[0]), scale)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None, defer_merge: bool = False):
        """x may be a PendingNorm (fused_kernels): a TMA GEMV of this weight applies the
        norm as it loads x where it takes the call; any other path runs the norm first."""
        from spindle.layers.fused_kernels import PendingNorm

        if isinstance(x, PendingNorm):
            y = self._normed_matmul(x, bias)
            if y is not None:
                return y
            x = x.materialized()
        step = self._lora_step()
        if step is not None:
            flat = x.reshape(-1, x.shape[-1])
            y = self._base_matmul(x, bias)
            return self.lora.add(y.view(flat.shape[0], -1), flat, step).view(y.shape)
        return self._base_matmul(x, bias, defer_merge)

    def _normed_matmul(self, norm, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The product of a PendingNorm's rows by one TMA GEMV launch that normalizes as
        it loads them, or None where that does not apply: adapters in the step, a
        quantized or batch-invariant weight, or tma_gemv_applies says no."""
        from spindle.layers.tma_gemv import tma_gemv, tma_gemv_applies

        if (self._lora_step() is not None or self.int4 is not None
                or self.weight_scale is not None or self.batch_invariant
                or not tma_gemv_applies(norm, self.weight)):
            return None
        return tma_gemv(norm, self.weight, bias)

    def _lora_step(self):
        """The step's adapters where this layer has slots and the step uses any
        (lora/layers.py LoRAStep), else None: the layer is then its base layer."""
        return None if self.lora is None else current_lora()

    def _base_matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
                     defer_merge: bool = False):
        if self.int4 is not None:
            return self.int4.matmul(x, bias)
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, bias, self.split_counters)
        return apply_linear(x, self.weight, bias, self.split_counters, self.batch_invariant,
                            defer_merge)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size} (per rank), "
                f"bias={self.bias is not None}, tp_size={self.tp_group.size}")


class ColumnParallelLinear(_ParallelLinearBase):
    """y = x W^T + b with W's rows (output features) split across ranks.

    Returns the rank-local slice of the output unless gather_output is set.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False,
                 tp_group: TensorParallelGroup, gather_output: bool = False) -> None:
        local = divide(output_size, tp_group.size, "output_size")
        super().__init__(input_size, local, bias, tp_group)
        self.full_output_size = output_size
        self.gather_output = gather_output
        set_weight_loader(self.weight, self.weight_loader)
        if self.bias is not None:
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard id, got {shard_id!r}")
        size = param.shape[0]
        self._copy_rows(param, loaded_weight.narrow(0, self.tp_group.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias)
        if self.gather_output:
            y = self.tp_group.all_gather(y, dim=-1)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul
    (gate_proj and up_proj -> gate_up_proj). shard_id is the index into output_sizes.

    Each sub-projection is split across ranks on its own, so the rank-local output is
    [gate slice | up slice] and activation functions can split it in half locally.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], *, bias: bool = False,
                 tp_group: TensorParallelGroup) -> None:
        for i, size in enumerate(output_sizes):
            divide(size, tp_group.size, f"output_sizes[{i}]")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, tp_group=tp_group)
        shard_ids = list(range(len(output_sizes)))
        set_weight_loader(self.weight, self.weight_loader, shard_ids)
        if self.bias is not None:
            set_weight_loader(self.bias, self.weight_loader, shard_ids)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs a shard id in "
                             f"0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        tp = self.tp_group.size
        local = self.output_sizes[shard_id] // tp
        offset = sum(self.output_sizes[:shard_id]) // tp
        src = loaded_weight.narrow(0, self.tp_group.rank * local, local)
        self._copy_rows(param, src, offset, local)


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections merged; shard_id is "q", "k" or "v".

    Query heads are split across ranks. KV heads are split too when there are at least
    as many as ranks; otherwise each KV head is replicated on tp_size / num_kv_heads
    consecutive ranks, so every rank holds exactly one KV head, the one its query heads
    attend with.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, *,
                 bias: bool = False, tp_group: TensorParallelGroup) -> None:
        tp = tp_group.size
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            if tp % num_kv_heads != 0:
                raise ValueError(f"tensor parallel size ({tp}) must be a multiple of "
                                 f"num_key_value_heads ({num_kv_heads}) when it is larger")
            self.num_kv_heads = 1
            self.kv_replicas = tp // num_kv_heads
        self.q_size = self.num_heads * head_dim  # rank-local
        self.kv_size = self.num_kv_heads * head_dim
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, output_size, bias=bias, tp_group=tp_group)
        set_weight_loader(self.weight, self.weight_loader, ("q", "k", "v"))
        if self.bias is not None:
            set_weight_loader(self.bias, self.weight_loader, ("q", "k", "v"))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        rank = self.tp_group.rank
        if shard_id == "q":
            offset, size, src_index = 0, self.q_size, rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, src_index = self.kv_size, rank // self.kv_replicas
        else:
            raise ValueError(f"QKVParallelLinear needs shard id 'q', 'k' or 'v', got {shard_id!r}")
        self._copy_rows(param, loaded_weight.narrow(0, src_index * size, size), offset, size)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(_ParallelLinearBase):
    """y = x W^T + b with W's columns (input features) split across ranks.

    x is the rank-local slice of the input (what a column-parallel layer produced);
    the partial products are all-reduced, then the (replicated) bias is added once.
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False,
                 tp_group: TensorParallelGroup, reduce_results: bool = True) -> None:
        local = divide(input_size, tp_group.size, "input_size")
        super().__init__(local, output_size, bias, tp_group)
        self.full_input_size = input_size
        self.reduce_results = reduce_results
        set_weight_loader(self.weight, self.weight_loader)
        if self.bias is not None:
            set_weight_loader(self.bias, default_weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear takes no shard id, got {shard_id!r}")
        size = self.input_size  # (not param's: a packed int4 weight has other columns)
        self._copy_rows(param, loaded_weight.narrow(1, self.tp_group.rank * size, size))

    def forward(self, x: torch.Tensor, defer_merge: bool = False):
        """defer_merge: the caller's next step is an RMSNorm (norm.RMSNorm), which may
        take the product as a skinny GEMM's unsummed split-K partials (with one rank,
        a dense weight and no bias); see skinny_gemm.SplitKPartials."""
        defer = self._may_defer(defer_merge)
        return self._reduced(lambda bias: self._matmul(x, bias, defer))

    def silu_and_mul_forward(self, gate_up: torch.Tensor, defer_merge: bool = False):
        """forward(silu(gate) * up) for gate_up = [gate | up] [M, 2K] in one skinny GEMM
        launch that applies the activation as it loads (a SwiGLU MLP's down projection
        on a CUDA decode step), or None where that does not apply: not CUDA, more rows
        than the skinny GEMM takes (or than skinny_gemm.SILU_MAX_M), a quantized or
        batch-invariant weight, or SPINDLE_SKINNY_SILU=0. The rounding is that of the
        separate activation kernel.
        defer_merge: as forward's."""
        from spindle.layers.skinny_gemm import SILU_MAX_M, skinny_linear, use_skinny_gemm

        k = self.weight.shape[1]
        if (not gate_up.is_cuda or gate_up.dim() != 2 or gate_up.shape[1] != 2 * k
                or gate_up.shape[0] > SILU_MAX_M
                or self._lora_step() is not None or self.int4 is not None
                or self.weight_scale is not None
                or self.batch_invariant or not on_off(SKINNY_SILU_ENV, True)
                or not use_skinny_gemm(gate_up[:, :k], self.weight)):
            return None
        defer = self._may_defer(defer_merge)
        return self._reduced(lambda bias: skinny_linear(
            gate_up, self.weight, bias, counters=self.split_counters, silu_and_mul=True,
            defer_merge=defer))

    def _may_defer(self, defer_merge: bool) -> bool:
        """A caller's defer_merge, where the product needs no all-reduce (one rank) and
        SPINDLE_SKINNY_DEFER_MERGE is not "0". (With one rank the bias goes into the
        product, and the skinny GEMM does not defer a product with a bias.)"""
        return (defer_merge and self.tp_group.size == 1
                and on_off(SKINNY_DEFER_ENV, True))

    def _reduced(self, matmul) -> torch.Tensor:
        """matmul(bias) -> this rank's product; then the all-reduce across ranks and the
        bias added once (with one rank, the bias goes into the product)."""
        if self.tp_group.size == 1:
            return matmul(self.bias)
        y = matmul(None)
        if self.reduce_results:
            y = self._all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y

    def _all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The sum of the ranks' partial products. Batch-invariant with more than two
        ranks: gathered, then added in rank order (a ring all-reduce adds each element
        in an order set by where it falls in the tensor; two ranks' a + b is the same
        either way round)."""
        if not self.batch_invariant or self.tp_group.size <= 2:
            return self.tp_group.all_reduce(y)
        parts = self.tp_group.all_gather(y.unsqueeze(0), dim=0)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total
