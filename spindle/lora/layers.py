"""LoRA adapters in the model's linear layers: max_loras slots of max_lora_rank each,
filled and emptied as requests come and go, every slot applied in each step.

Each adapted linear layer holds its slots stacked: A [parts * L * R, in] and
B [out, parts * L * R] (L slots of rank R; parts: the projections the layer merges,
q/k/v or gate/up, each with its own A and B; an adapter of a smaller rank fills the
first r of its R). A step adds

    ((x A^T) * mask) B^T

to the layer's output, where the mask [T, L * R] keeps, for each token, the columns of
its request's slot (none for a request without an adapter). That is two GEMMs of static
shapes whatever the mix of adapters: the same code on every device, inside CUDA graphs.
On CUDA a decode-sized step can do the same sum in one Triton launch a layer that reads
only each token's own slot (lora/kernels.py; SPINDLE_LORA_KERNEL=1, off by default).
Under tensor parallelism A and B are split as the layer's weight is: a column-parallel
layer's B by its output rows, a row-parallel layer's A by its input columns (whose
partial products then go into the layer's own all-reduce, the sum being linear)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spindle.lora.adapter import PeftAdapter
from spindle.switches import on_off

KERNEL_SWITCH_ENV = "SPINDLE_LORA_KERNEL"  # the one-launch kernel (lora/kernels.py), off


def lora_columns(max_loras: int, max_rank: int, device: torch.device) -> torch.Tensor:
    """[L * R] the slot each LoRA column belongs to (what a token's slot id is compared
    with to make its mask)."""
    return torch.arange(max_loras * max_rank, device=device) // max_rank


def lora_mask(token_slots: torch.Tensor, columns: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
    """token_slots [T] (-1: no adapter) -> [T, L * R] ones in each token's slot's
    columns."""
    return (token_slots[:, None] == columns[None, :]).to(dtype)


@dataclass(frozen=True)
class LoRAStep:
    """What a step's layers need of its adapters: each token's slot [T] (-1: none) and
    the mask made from them (lora_mask)."""
    slots: torch.Tensor
    mask: torch.Tensor


class LoRASlots(nn.Module):
    """One linear layer's adapter slots (see the module docstring)."""

    def __init__(self, layer: nn.Module, part_rows: list[int], max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """part_rows: this rank's output rows of each projection the layer merges."""
        super().__init__()
        self.part_rows = part_rows
        self.use_kernel = on_off(KERNEL_SWITCH_ENV, False)
        self.parts, self.max_loras, self.max_rank = len(part_rows), max_loras, max_rank
        if sum(part_rows) != layer.output_size:
            raise ValueError(f"LoRA parts of {part_rows} rows for a layer of "
                             f"{layer.output_size} output rows")
        width = self.parts * max_loras * max_rank
        # Not persistent: no checkpoint holds them; filled by write().
        self.register_buffer("a", torch.zeros(width, layer.input_size, dtype=dtype,
                                              device=device), persistent=False)
        self.register_buffer("b", torch.zeros(layer.output_size, width, dtype=dtype,
                                              device=device), persistent=False)

    def add(self, y: torch.Tensor, x: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """y [T, out] plus the step's adapters' share for x [T, in] (in place, and y
        returned, where the one-launch kernel applies)."""
        if self.use_kernel and y.is_cuda:
            from spindle.lora import kernels  # (Triton: only where CUDA is)

            if kernels.takes(x, y, self.parts):
                kernels.lora_add_(y, x, step.slots, self.a, self.b, self.part_rows,
                                  self.max_loras, self.max_rank)
                return y
        return y + self.delta(x, step.mask)

    def delta(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        shrunk = (x @ self.a.t()).view(x.shape[0], self.parts, -1) * mask[:, None, :]
        return shrunk.view(x.shape[0], -1) @ self.b.t()

    def _columns(self, slot: int, part: int) -> slice:
        start = (part * self.max_loras + slot) * self.max_rank
        return slice(start, start + self.max_rank)

    def clear(self, slot: int) -> None:
        for part in range(self.parts):
            cols = self._columns(slot, part)
            self.a[cols] = 0
            self.b[:, cols] = 0

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a [r, in] and b [out, r], this rank's shares (r <= max_rank)."""
        cols = self._columns(slot, part)
        rank = a.shape[0]
        self.a[cols.start:cols.start + rank].copy_(a)
        self.b[:, cols.start:cols.start + rank].copy_(b)

    def extra_repr(self) -> str:
        return f"parts={self.parts}, slots={self.max_loras}, rank={self.max_rank}"


def _parts(layer: nn.Module) -> list[tuple[Any, int]]:
    """The projections a linear layer merges, in its output's order: (the shard id its
    weight loader takes, the part's whole output rows); one part, shard id None, for a
    layer that merges none."""
    from spindle.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(layer, QKVParallelLinear):
        kv = layer.total_num_kv_heads * layer.head_dim
        return [("q", layer.total_num_heads * layer.head_dim), ("k", kv), ("v", kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(enumerate(layer.output_sizes))
    return [(None, getattr(layer, "full_output_size", layer.output_size))]


def _local_part_rows(layer: nn.Module) -> list[int]:
    """This rank's output rows of each of the layer's parts (_parts), in its order."""
    from spindle.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return [size // layer.tp_group.size for size in layer.output_sizes]
    return [layer.output_size]


def attach_lora_slots(model: nn.Module, max_loras: int, max_rank: int,
                      dtype: torch.dtype, device: torch.device) -> int:
    """Give every linear layer of the decoder's layers (the projections PEFT adapters
    target: attention's and the MLP's; not the embedding, the LM head or experts) its
    slots. Returns how many layers took slots."""
    from spindle.layers.linear import _ParallelLinearBase

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, _ParallelLinearBase) and ".layers." in f".{name}":
            module.lora = LoRASlots(module, _local_part_rows(module), max_loras, max_rank,
                                    dtype, device)
            count += 1
    if count == 0:
        raise ValueError(f"{type(model).__name__} has no linear layers LoRA adapters "
                         "could adapt")
    return count


class LoRASlotWriter:
    """Puts an adapter's weights into a model's slots, each module where the model's
    checkpoint mapping (param_name) sends that module's weight."""

    def __init__(self, model: nn.Module, param_name) -> None:
        self.model = model
        self.param_name = param_name  # the model class's checkpoint-name mapping
        self.slotted = [m.lora for m in model.modules() if getattr(m, "lora", None) is not None]

    def clear(self, slot: int) -> None:
        for slots in self.slotted:
            slots.clear(slot)

    def write(self, slot: int, adapter: PeftAdapter, name: str) -> None:
        """Fill slot with adapter (ValueError, the slot left empty, if a module it adapts
        is not one this model can adapt)."""
        self.clear(slot)
        try:
            for module, (a, b) in adapter.weights.items():
                self._write_module(slot, module, a, b, name)
        except Exception:
            self.clear(slot)
            raise

    def _write_module(self, slot: int, module: str, a: torch.Tensor, b: torch.Tensor,
                      name: str) -> None:
        for own_name, b_rows in self._own_names(f"{module}.weight", b, a.shape[0], name):
            self._write_projection(slot, module, own_name, a, b_rows, name)

    def _write_projection(self, slot: int, module: str, own_name: str, a: torch.Tensor,
                          b: torch.Tensor, name: str) -> None:
        param, shard_id = self.param_name(own_name)
        layer = self._layer(param.removesuffix(".weight"))
        if layer is None:
            return  # (a layer of another pipeline stage)
        slots = getattr(layer, "lora", None)
        if slots is None:
            raise ValueError(f"LoRA adapter {name!r} adapts {module}, which is not a "
                             f"linear layer of the decoder's layers (not supported)")
        parts = _parts(layer)
        shard_ids = [shard for shard, _ in parts]
        if len(parts) > 1 and shard_id is None:
            # A fused projection adapted whole (Phi-3's qkv_proj, gate_up_proj): B's rows
            # split as the layer's parts, each part with the same A, give B A x.
            sizes = [rows for _, rows in parts]
            if b.shape[0] != sum(sizes):
                raise ValueError(f"LoRA adapter {name!r}: {module}'s B has {b.shape[0]} "
                                 f"rows, the projection {sum(sizes)}")
            for part, (shard, rows) in enumerate(zip(shard_ids, b.split(sizes))):
                self._write_part(slot, layer, slots, part, shard, a, rows)
            return
        if shard_id not in shard_ids:
            raise ValueError(f"LoRA adapter {name!r} adapts {module}, a part of a projection "
                             "this model does not merge (not supported)")
        self._write_part(slot, layer, slots, shard_ids.index(shard_id), shard_id, a, b)

    @staticmethod
    def _write_part(slot: int, layer: nn.Module, slots: LoRASlots, part: int, shard_id: Any,
                    a: torch.Tensor, b: torch.Tensor) -> None:
        """One projection's A and B (whole, as the adapter has them) into its columns,
        this rank's share cut by the layer's own weight loader."""
        from spindle.layers.linear import RowParallelLinear

        dtype = slots.a.dtype
        if isinstance(layer, RowParallelLinear):
            a_local = torch.zeros(a.shape[0], layer.input_size, dtype=dtype)
            layer.weight_loader(a_local, a.to(dtype))
            b_local = b.to(dtype)
        else:
            a_local = a.to(dtype)
            b_local = torch.zeros(layer.output_size, b.shape[1], dtype=dtype)
            layer.weight_loader(b_local, b.to(dtype), shard_id)
        slots.write(slot, part, a_local.to(slots.a.device), b_local.to(slots.b.device))

    def _own_names(self, checkpoint_name: str, b: torch.Tensor, rank: int, adapter: str
                   ) -> list[tuple[str, torch.Tensor]]:
        """A checkpoint weight's names, each with its rows of b, as the model's loader
        renames and splits the weight before param_name (checkpoint_renames, where the
        model has one: Granite's feed_forward, GPT-NeoX's query_key_value, whose heads'
        q, k and v rows alternate). B's rows are the weight's output rows, so they go as
        the weight's do; A, which reads the input, is every part's."""
        rename = getattr(self.model, "checkpoint_renames", None)
        if rename is None:
            return [(checkpoint_name, b)]
        renamed = list(rename([(checkpoint_name, b)]))
        if any(part.dim() != 2 or part.shape[1] != rank for _, part in renamed):
            raise ValueError(f"LoRA adapter {adapter!r} adapts {checkpoint_name}, which this "
                             "model's loader cuts other than by output rows (not supported)")
        return renamed

    def _layer(self, path: str) -> nn.Module | None:
        from spindle.models.causal_lm import MissingLayer

        module = self.model
        for piece in path.split("."):
            if isinstance(module, MissingLayer):
                return None
            if not hasattr(module, piece):
                raise ValueError(f"{type(self.model).__name__} has no module {path!r} for "
                                 "an adapted module of that checkpoint name (its checkpoint "
                                 "names are not its modules': adapters not supported)")
            module = getattr(module, piece)
        return None if isinstance(module, MissingLayer) else module
