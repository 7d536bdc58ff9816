"""A GGUF model's LM head on the CPU as int8 codes, multiplied in float32.

torch's int4 CPU kernel (layers/int4.py) takes bf16 activations and returns bf16: for
the LM head that rounds every logit to bf16 (a spacing of 0.125 around 20), enough to
flip greedy choices between near-ties. Its float32 and float16 variants are 25-45x
slower. So the head holds the codes as read instead (``Int8Weight``): int8 [N, K]
(every group-quantized GGUF type's codes fit: Q4_*, Q5_*, Q8_0, the K-quants) with the
file's float32 scale and offset per group of 32 columns (w = scale * code + offset,
``int4.GroupQuantized``), and the C++ kernel ``cpu_kernels.int8_group_matmul`` returns
float32 logits, exact up to float32 summation order. It reads the same bytes as the
two-nibble-plane int4 weight and is faster than torch's kernel from 1 row up
(SmolLM2's 49152 x 576 head on 2 cores, read from memory: 1.65 against 2.05 ms for 1
row, 4.4 against 6.75 ms for 8; from cache 1.1 against 1.8 and 3.9 against 6.3).
Teacher-forced top-1 agreement of SmolLM2's GGUF files with their float32
dequantization (benchmarks/gguf_agreement.py --questions 24) went from 0.969 / 0.983 /
0.976 / 0.977 / 0.974 to 0.980 / 0.988 / 0.990 / 0.978 / 0.989 for Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0 (the head is Q8_0 in every file).

A tied head shares its int8 weight with the embedding (the parameters are the
embedding's, as a tied dense head shares its dense one): a lookup dequantizes the rows
it reads, exactly as the dense copy was dequantized (float32, then the model dtype), so
no dense copy of the vocabulary is kept. A dense tensor written into the weight (a
weight update) is quantized as Q8_0 is.

This needs the fused CPU kernels (``cpu_kernels.available()`` and switched on):
without them, or with ``SPINDLE_CPU_INT8_HEAD=0``, the head stays on the int4 path
(bf16 logits) and the embedding dense, as before.
"""

from __future__ import annotations


import torch
from torch import nn

from spindle.layers import cpu_kernels
from spindle.layers.int4 import GROUP, GroupQuantized, quantize_groups
from spindle.switches import on_off

SWITCH_ENV = "SPINDLE_CPU_INT8_HEAD"
WEIGHT_PARAMS = ("weight", "weight_group_scale", "weight_group_offset")


def enabled() -> bool:
    """Whether a quantized LM head is held here: the fused CPU kernels switched on and
    built, and SPINDLE_CPU_INT8_HEAD not "0"."""
    return (on_off(SWITCH_ENV, True) and cpu_kernels.switched_on()
            and cpu_kernels.available())


class Int8Weight:
    """One module's weight [N, K] as int8 codes and a float32 scale and offset per group
    of 32 columns: the module's parameters ``weight`` (int8 [N, K]),
    ``weight_group_scale`` and ``weight_group_offset`` (float32 [N, K / 32]). They
    replace the dense placeholder when this is made (before loading) and are written
    in place afterwards (loads, reloads, weight updates: the same tensors); the scale
    and offset carry ``loaded_with = "weight"`` (filled by the weight's loader)."""

    def __init__(self, module: nn.Module, rows: int, cols: int) -> None:
        if cols % GROUP:
            raise ValueError(f"an int8 group-quantized weight needs columns in multiples of "
                             f"{GROUP}, got [{rows}, {cols}]")
        self.module = module
        self.rows, self.cols = rows, cols
        old = module.weight
        self.dtype = old.dtype  # the dense weight's: what a lookup returns
        weight = nn.Parameter(torch.zeros(rows, cols, dtype=torch.int8, device=old.device),
                              requires_grad=False)
        for attr in ("weight_loader", "shard_ids", "loaded_with"):
            if hasattr(old, attr):
                setattr(weight, attr, getattr(old, attr))
        module.weight = weight
        for name in WEIGHT_PARAMS[1:]:
            param = nn.Parameter(torch.zeros(rows, cols // GROUP, device=old.device),
                                 requires_grad=False)
            param.loaded_with = "weight"
            setattr(module, name, param)

    def write_rows(self, src: GroupQuantized | torch.Tensor, offset: int = 0) -> None:
        """src as rows offset... of the weight (a dense src quantized as Q8_0 is)."""
        if tuple(src.shape[1:]) != (self.cols,) or offset + src.shape[0] > self.rows:
            raise ValueError(f"shape mismatch: rows {offset}..{offset + src.shape[0]} of a "
                             f"[{self.rows}, {self.cols}] weight cannot take a tensor of "
                             f"shape {tuple(src.shape)}")
        if not isinstance(src, GroupQuantized):
            src = quantize_groups(src, 8)
        low, high = src.code_range() if src.shape[0] else (0, 0)
        if low < -128 or high > 127:
            raise ValueError(f"codes {low}..{high} do not fit an int8 weight")
        rows = slice(offset, offset + src.shape[0])
        module = self.module
        with torch.no_grad():
            module.weight.data[rows] = src.codes
            module.weight_group_scale.data[rows] = src.scale
            module.weight_group_offset.data[rows] = src.offset

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W^T -> float32 [..., N] (x float32 or bf16 as given, any other
        dtype as float32)."""
        module = self.module
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.cols)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        y = cpu_kernels.int8_group_matmul(x2, module.weight, module.weight_group_scale,
                                          module.weight_group_offset)
        return y.reshape(*lead, self.rows)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ids [...] of the weight -> [..., K] in the dense weight's dtype,
        computed as GroupQuantized.dequantize computes them (bit for bit the dense
        copy's values)."""
        module = self.module
        codes = module.weight[ids].reshape(*ids.shape, -1, GROUP)
        w = module.weight_group_scale[ids][..., None] * codes.float()
        w += module.weight_group_offset[ids][..., None]
        return w.reshape(*ids.shape, self.cols).to(self.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight as floats (tests, debugging)."""
        module = self.module
        return GroupQuantized(module.weight.data, module.weight_group_scale.data,
                              module.weight_group_offset.data).dequantize(dtype)
