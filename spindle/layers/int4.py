"""Quantized weights kept quantized on the CPU, through torch's int4 matmul.

torch's CPU kernel ``_weight_int4pack_mm_for_cpu(x, packed, 32, scale_zero)`` multiplies
bf16 activations by a weight of 4-bit codes q in groups of 32 along K, each group with
its own scale s and zero z: w = (q - 8) * s + z. That is the layout of GGUF's 4-bit
types exactly: Q4_0 (w = d * (q - 8)), Q4_1 (w = d * q + m) and, with each 32-value
sub-block's scale and minimum, Q4_K. Wider codes (Q8_0, Q5_*) are split into two 4-bit
planes, c = 16 * hi + lo, held side by side along K (hi groups first, then lo groups),
and the activations are repeated to match: one matmul reading one byte per weight, the
values exact. The scales and zeros are held in bf16 (the kernel's activation dtype);
they are the only rounding against the file's dequantized weights.

``GroupQuantized`` is what a checkpoint reader yields for such a tensor: integer codes
with a float32 scale and offset per group (w = scale * code + offset), which narrows
along rows and along whole groups of columns, so tensor parallelism and merged layers
shard it as they shard a dense tensor. A layer holding int4 weights (``Int4Weight``)
gathers the rows it is given (its shards, in any order) and packs them once the load is
over (``finish_loading``): torch's packed layout interleaves blocks of rows, so rows are
not packed one shard at a time. A later write of some rows only (a weight update) first
recovers the others from the packed weight. Dense tensors written into an int4 layer
(weight updates) are quantized to its codes: 4 bits as Q4_1 does (min and max of each
group), 8 bits as Q8_0 does (largest magnitude / 127).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32
# The kernel's constraint on the weight's output rows (its packing handles 16 at a time).
ROW_MULTIPLE = 16
# Rows packed at once (a multiple of the packed layout's 64-row blocks).
PACK_ROWS = 4096
# Columns of the identity multiplied at once when recovering codes from a packed weight.
UNPACK_CHUNK = 1024


@dataclass
class GroupQuantized:
    """A weight [R, K] as w[r, k] = scale[r, k // 32] * codes[r, k] + offset[r, k // 32]:
    codes int16 (small integers: 0..15 for Q4_1, -128..127 for Q8_0, ...), scale and
    offset float32 [R, K / 32]."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def __post_init__(self) -> None:
        rows, cols = self.codes.shape
        if cols % GROUP or self.scale.shape != (rows, cols // GROUP) \
                or self.offset.shape != self.scale.shape:
            raise ValueError(f"group-quantized weight of shape {tuple(self.codes.shape)} needs "
                             f"a scale and offset of shape ({rows}, {cols // GROUP}), got "
                             f"{tuple(self.scale.shape)} and {tuple(self.offset.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> "GroupQuantized":
        if dim == 0:
            return GroupQuantized(self.codes.narrow(0, start, length),
                                  self.scale.narrow(0, start, length),
                                  self.offset.narrow(0, start, length))
        if dim != 1:
            raise ValueError(f"a group-quantized weight has dims 0 and 1, got {dim}")
        if start % GROUP or length % GROUP:
            raise ValueError(f"columns {start}..{start + length} of a weight quantized in "
                             f"groups of {GROUP} do not fall on group boundaries")
        return GroupQuantized(self.codes.narrow(1, start, length),
                              self.scale.narrow(1, start // GROUP, length // GROUP),
                              self.offset.narrow(1, start // GROUP, length // GROUP))

    def split(self, sizes: list[int], dim: int = 0) -> list["GroupQuantized"]:
        parts, start = [], 0
        for size in sizes:
            parts.append(self.narrow(dim, start, size))
            start += size
        return parts

    def chunk(self, chunks: int, dim: int = 0) -> list["GroupQuantized"]:
        size = self.shape[dim] // chunks
        return self.split([size] * chunks, dim)

    def permute_rows(self, order: torch.Tensor) -> "GroupQuantized":
        return GroupQuantized(self.codes[order], self.scale[order], self.offset[order])

    def code_range(self) -> tuple[int, int]:
        return int(self.codes.min()), int(self.codes.max())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight (computed in float32: scale * code + offset, as the GGUF
        package dequantizes), cast to dtype."""
        rows, cols = self.codes.shape
        w = self.scale[..., None] * self.codes.reshape(rows, -1, GROUP).float()
        w += self.offset[..., None]
        return w.reshape(rows, cols).to(dtype)


def quantize_groups(w: torch.Tensor, bits: int) -> GroupQuantized:
    """A dense weight [R, K] in groups of 32: bits=4 as Q4_1 (codes 0..15 from each
    group's min and max), bits=8 as Q8_0 (codes -127..127, scale = max |w| / 127)."""
    if w.dim() != 2 or w.shape[1] % GROUP:
        raise ValueError(f"quantizing in groups of {GROUP} takes a 2-D weight whose columns "
                         f"are a multiple of {GROUP}, got shape {tuple(w.shape)}")
    groups = w.detach().float().reshape(w.shape[0], -1, GROUP)
    if bits == 4:
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        scale = (high - low) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = ((groups - low[..., None]) / safe[..., None]).round_().clamp_(0, 15)
        offset = low
    elif bits == 8:
        scale = groups.abs().amax(dim=2) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (groups / safe[..., None]).round_().clamp_(-127, 127)
        offset = torch.zeros_like(scale)
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return GroupQuantized(codes.reshape(w.shape).to(torch.int16), scale, offset)


def planes_for(codes_low: int, codes_high: int) -> int:
    """4-bit planes needed for codes in [codes_low, codes_high]: 1 within 16 levels
    (0..15 or -8..7), 2 within -128..127."""
    base = 0 if codes_low >= 0 else -8
    if codes_low >= base and codes_high - base <= 15:
        return 1
    if codes_low >= -128 and codes_high <= 127:
        return 2
    raise ValueError(f"codes {codes_low}..{codes_high} do not fit in 8 signed bits")


def to_nibbles(gq: GroupQuantized, planes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nibbles [R, K * planes] (int32, or uint8 for two planes), scale_zero float32
    [R, K * planes / 32, 2]): the kernel's form of gq's rows, w = (nibble - 8) * scale
    + zero summed over the planes.
    The codes are shifted to be >= 0 by a base that the zero adds back: one plane, 0
    for a group without negative codes, else -8; two planes, -128, which makes the high
    plane's zero the offset itself (exact in bf16, where 128 * scale + offset would
    round at the scale of the largest values)."""
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, got {planes}")
    rows, cols = gq.codes.shape
    if planes == 1:
        low, high = (int(v) for v in torch.aminmax(gq.codes))
        if 0 <= low and high <= 15:  # (the common case, Q4_1 / Q4_K: every base is 0)
            return gq.codes.to(torch.int32), torch.stack([gq.scale, gq.offset + 8 * gq.scale],
                                                         dim=-1)
        codes = gq.codes.reshape(rows, -1, GROUP)
        base = (codes.amin(dim=2) < 0).to(torch.int32) * -8  # [R, G]
        shifted = codes.to(torch.int32) - base[..., None]
        low, high = torch.aminmax(shifted)
        if int(low) < 0 or int(high) >= 16:
            raise ValueError(f"codes {int(gq.codes.min())}..{int(gq.codes.max())} need "
                             "more than 4 bits")
        zero = gq.offset + (base.float() + 8) * gq.scale
        return shifted.reshape(rows, cols), torch.stack([gq.scale, zero], dim=-1)
    # Two planes: one base (-128) for every group, so whole-tensor int16 ops.
    low, high = (int(v) for v in torch.aminmax(gq.codes))
    if low < -128 or high > 127:
        raise ValueError(f"codes {low}..{high} need more than 8 bits")
    shifted = gq.codes.to(torch.int16) + 128
    nibbles = torch.empty(rows, 2 * cols, dtype=torch.uint8)
    nibbles[:, :cols] = shifted >> 4
    nibbles[:, cols:] = shifted.bitwise_and_(15)
    groups = cols // GROUP
    scale_zero = torch.empty(rows, 2 * groups, 2)
    scale_zero[:, :groups, 0] = 16 * gq.scale
    scale_zero[:, :groups, 1] = gq.offset  # (the base's -128 * scale, added back)
    scale_zero[:, groups:, 0] = gq.scale
    scale_zero[:, groups:, 1] = 8 * gq.scale
    return nibbles, scale_zero


def from_nibbles(nibbles: torch.Tensor, scale_zero: torch.Tensor, planes: int) -> GroupQuantized:
    """The inverse of to_nibbles (codes 0..15, or -128..127 for two planes)."""
    scale_zero = scale_zero.float()
    if planes == 1:
        scale, zero = scale_zero.unbind(-1)
        return GroupQuantized(nibbles.to(torch.int16), scale, zero - 8 * scale)
    cols = nibbles.shape[1] // 2
    groups = cols // GROUP
    hi, lo = nibbles[:, :cols].to(torch.int16), nibbles[:, cols:].to(torch.int16)
    zero_hi, scale, zero_lo = scale_zero[:, :groups, 1], scale_zero[:, groups:, 0], \
        scale_zero[:, groups:, 1]
    return GroupQuantized(16 * hi + lo - 128, scale, zero_hi + zero_lo - 8 * scale)


def pack(nibbles: torch.Tensor) -> torch.Tensor:
    """torch's packed CPU layout of nibbles [N, K'] (uint8 [N, K' / 2]).

    The packing wants int32 input: a large weight is packed PACK_ROWS rows at a time
    through one reused int32 buffer, not as one int32 copy four times its size (whose
    fresh pages cost more than the packing). The layout holds blocks of at most 64 rows
    (AVX-512; 32 on AVX2, 1 otherwise) one after another, so packing chunks that start
    at multiples of 64 rows gives the same bytes (tests/test_gguf_int4.py)."""
    rows, cols = nibbles.shape
    if rows <= PACK_ROWS:
        return torch._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32).contiguous(), 1)
    out = torch.empty(rows, cols // 2, dtype=torch.uint8)
    buffer = torch.empty(PACK_ROWS, cols, dtype=torch.int32)
    for start in range(0, rows, PACK_ROWS):
        chunk = buffer[:min(PACK_ROWS, rows - start)]
        chunk.copy_(nibbles[start:start + chunk.shape[0]])
        out[start:start + chunk.shape[0]] = torch._convert_weight_to_int4pack_for_cpu(chunk, 1)
    return out


def unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The nibbles [N, cols] of a packed weight, recovered through the kernel itself
    (identity activations, unit scales, zero zeros: the products are nibble - 8, exact
    in bf16): no dependence on the packed layout, which varies with the CPU."""
    n = packed.shape[0]
    unit = torch.zeros(cols // GROUP, n, 2, dtype=torch.bfloat16)
    unit[..., 0] = 1
    out = torch.empty(n, cols, dtype=torch.uint8)
    for start in range(0, cols, UNPACK_CHUNK):
        stop = min(cols, start + UNPACK_CHUNK)
        eye = torch.zeros(stop - start, cols, dtype=torch.bfloat16)
        eye[:, start:stop] = torch.eye(stop - start, dtype=torch.bfloat16)
        values = torch._weight_int4pack_mm_for_cpu(eye, packed, GROUP, unit)  # [chunk, N]
        out[:, start:stop] = (values.t().float() + 8).round_().to(torch.uint8)
    return out


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """bf16 x [M, K'] @ a packed weight: the fused CPU kernels' int4_linear where they
    are built and switched on (at a decode step's 1-32 rows its own kernel, which reads
    torch's packed layout, 1.2-1.8x faster than torch's there; otherwise torch's
    kernel), torch's kernel elsewhere."""
    from spindle.layers import cpu_kernels

    if cpu_kernels.switched_on() and cpu_kernels.available():
        return cpu_kernels.int4_linear(x, packed, scale_zero)
    return torch._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, planes: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) in x's dtype; the kernel runs in bf16."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).to(torch.bfloat16)
    if planes == 2:
        x2 = torch.cat([x2, x2], dim=1)
    y = _packed_matmul(x2, packed, scale_zero)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, packed.shape[0]).to(x.dtype)


class Int4Weight:
    """The int4 form of one layer's weight [N, K] and the rows gathered for it.

    The module keeps the packed weight and its scale_zero as the parameters ``weight``
    and ``weight_scale_zero``: they replace the module's dense placeholder when the
    first load is packed, and are written in place afterwards (same tensors). Rows
    arrive through write_rows; finish() packs them."""

    def __init__(self, module: nn.Module, rows: int, cols: int) -> None:
        if rows % ROW_MULTIPLE or cols % GROUP:
            raise ValueError(f"an int4 weight needs rows in multiples of {ROW_MULTIPLE} and "
                             f"columns in multiples of {GROUP}, got [{rows}, {cols}]")
        self.module = module
        self.rows, self.cols = rows, cols
        self.planes: int | None = None  # decided by the first load's codes
        self._staged: GroupQuantized | None = None
        self._written: torch.Tensor | None = None  # bool [rows]

    @property
    def packed(self) -> bool:
        return self.planes is not None

    def write_rows(self, src: GroupQuantized | torch.Tensor, offset: int = 0) -> None:
        """Stage src as rows offset... of the weight (a dense src is quantized to this
        weight's bits: 4 until a load decided otherwise)."""
        if tuple(src.shape[1:]) != (self.cols,) or offset + src.shape[0] > self.rows:
            raise ValueError(f"shape mismatch: rows {offset}..{offset + src.shape[0]} of a "
                             f"[{self.rows}, {self.cols}] weight cannot take a tensor of "
                             f"shape {tuple(src.shape)}")
        if not isinstance(src, GroupQuantized):
            src = quantize_groups(src, 8 if self.planes == 2 else 4)
        if self.planes is not None:
            low, high = src.code_range()
            if planes_for(low, high) > self.planes:
                raise ValueError(f"codes {low}..{high} need more bits than this int4 "
                                 f"weight holds ({4 * self.planes})")
        if self._staged is None:
            self._staged = GroupQuantized(
                torch.zeros(self.rows, self.cols, dtype=torch.int16),
                torch.zeros(self.rows, self.cols // GROUP),
                torch.zeros(self.rows, self.cols // GROUP))
            self._written = torch.zeros(self.rows, dtype=torch.bool)
        rows = slice(offset, offset + src.shape[0])
        self._staged.codes[rows] = src.codes
        self._staged.scale[rows] = src.scale
        self._staged.offset[rows] = src.offset
        self._written[rows] = True

    def finish(self) -> bool:
        """Pack the staged rows (with the rows not written since the last pack, taken
        from the packed weight); False when nothing was staged. ValueError when rows of
        a first load are missing."""
        if self._staged is None:
            return False
        staged, written = self._staged, self._written
        self._staged = self._written = None
        module = self.module
        if not bool(written.all()):
            if not self.packed:
                missing = int((~written).sum())
                raise ValueError(f"{missing} of the {self.rows} rows of an int4 weight were "
                                 "never loaded")
            kept = from_nibbles(unpack(module.weight.data, self.cols * self.planes),
                                module.weight_scale_zero.data.transpose(0, 1), self.planes)
            keep = ~written
            staged.codes[keep] = kept.codes[keep]
            staged.scale[keep] = kept.scale[keep]
            staged.offset[keep] = kept.offset[keep]
        if self.planes is None:
            self.planes = planes_for(*staged.code_range())
        nibbles, scale_zero = to_nibbles(staged, self.planes)
        scale_zero = scale_zero.transpose(0, 1).to(torch.bfloat16).contiguous()  # [G', N, 2]
        self._install(pack(nibbles), scale_zero)
        return True

    def adopt(self, packed: torch.Tensor, scale_zero: torch.Tensor, planes: int) -> None:
        """Take a weight packed before, as finish() packs it (models/packed_cache.py);
        ValueError when its shapes are not this weight's."""
        shapes = ((self.rows, self.cols * planes // 2), (self.cols * planes // GROUP, self.rows, 2))
        if planes not in (1, 2) or (tuple(packed.shape), tuple(scale_zero.shape)) != shapes:
            raise ValueError(f"a packed [{self.rows}, {self.cols}] int4 weight of {planes} "
                             f"plane(s) has shapes {shapes}, got {tuple(packed.shape)} and "
                             f"{tuple(scale_zero.shape)}")
        if self.planes is not None and planes != self.planes:
            raise ValueError(f"this int4 weight holds {self.planes} plane(s), got {planes}")
        self._staged = self._written = None
        self.planes = planes
        self._install(packed.to(torch.uint8), scale_zero.to(torch.bfloat16))

    def _install(self, packed: torch.Tensor, scale_zero: torch.Tensor) -> None:
        """packed and scale_zero as the module's parameters: written into the ones of an
        earlier pack (same tensors), or replacing the dense placeholder the first time."""
        module = self.module
        if isinstance(getattr(module, "weight_scale_zero", None), nn.Parameter):
            with torch.no_grad():
                module.weight.data.copy_(packed)
                module.weight_scale_zero.data.copy_(scale_zero)
            return
        old = module.weight
        module.weight = nn.Parameter(packed, requires_grad=False)
        for attr in ("weight_loader", "shard_ids", "loaded_with"):
            if hasattr(old, attr):
                setattr(module.weight, attr, getattr(old, attr))
        module.weight_scale_zero = nn.Parameter(scale_zero, requires_grad=False)
        module.weight_scale_zero.loaded_with = "weight"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.packed:
            raise RuntimeError("an int4 weight was used before its load was finished")
        return int4_matmul(x, self.module.weight, self.module.weight_scale_zero, self.planes,
                           bias)


def finish_loading(model: nn.Module) -> int:
    """Pack every int4 weight that rows were written to since its last pack (after a
    load, a reload or a weight update). Returns how many were packed."""
    count = 0
    for module in model.modules():
        int4 = getattr(module, "int4", None)
        if isinstance(int4, Int4Weight) and int4.finish():
            count += 1
    return count
