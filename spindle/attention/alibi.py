"""ALiBi (attention with linear biases; Press et al., 2022): no position embedding, but
every score of query head h gets slope_h * (key position - query position) added, a
penalty growing with distance (BLOOM, MPT).

The slopes form a geometric sequence: with n heads a power of two, head i (from 1) has
2^(-max_bias * i / n). Otherwise the first 2^floor(log2 n) heads take that sequence and
the rest every other slope (the odd ones) of the sequence for twice as many heads. BLOOM
and MPT agree on that (MPT's ``alibi_bias_max`` is BLOOM's fixed 8 by default) but
round differently in float32 (a float32 base to integer powers, against 1 / 2^x): each
family's slopes are computed here as its code computes them, bit for bit.

Transformers adds slope_h * key position alone; the query's term is the same for the
whole row, so the softmax does not see it, and leaving it in keeps the added values
small (an exact float32 sum for the positions of any context)."""

from __future__ import annotations

import math

import torch


def bloom_slopes(num_heads: int) -> torch.Tensor:
    """BLOOM's slopes [num_heads] (float32, on the default device): powers of a float32
    base, and of a second base for the heads past the largest power of two."""
    _check_heads(num_heads)
    power = 2 ** math.floor(math.log2(num_heads))
    slopes = _powers(2 ** (-(2 ** -(math.log2(power) - 3))), range(1, power + 1))
    if power == num_heads:
        return slopes
    extra = num_heads - power  # (fewer than power)
    return torch.cat([slopes, _powers(2 ** (-(2 ** -(math.log2(2 * power) - 3))),
                                      range(1, 2 * extra, 2))])


def mpt_slopes(num_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """MPT's slopes [num_heads] (float32, on the default device) for ``alibi_bias_max``
    max_bias: 1 / 2^(max_bias * i / m) for the next power of two m of heads, its even
    entries first when m is more than num_heads."""
    _check_heads(num_heads)
    if not max_bias > 0:
        raise ValueError(f"alibi_bias_max must be > 0, got {max_bias}")
    padded = 2 ** math.ceil(math.log2(num_heads))
    exponents = torch.arange(1, padded + 1, dtype=torch.float32) * (max_bias / padded)
    slopes = 1.0 / torch.pow(2, exponents)
    if padded != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def _check_heads(num_heads: int) -> None:
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one head, got {num_heads}")


def _powers(base: float, exponents: range) -> torch.Tensor:
    return torch.pow(torch.tensor(base, dtype=torch.float32),
                     torch.tensor(list(exponents), dtype=torch.int32))


def check_alibi_slopes(slopes: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """slopes as an attention backend takes them: None, or one per query head."""
    if slopes is not None and tuple(slopes.shape) != (num_heads,):
        raise ValueError(f"alibi_slopes must be one slope per head ({num_heads}), got "
                         f"{tuple(slopes.shape)}")
    return slopes
