"""A LoRA layer's share of a decode step in one Triton launch (CUDA).

The masked form of lora/layers.py is four launches a layer (x A^T, the mask, the B
GEMM, the add), each a few microseconds whatever the batch: measured in CUDA graphs
on an H100 it cost batch-1 decode 60% of its speed (docs/benchmarks.md). Here one
program per (token, share of the output columns) finds its token's slot, reduces x
against that slot's rows of A (every part's: q/k/v, gate/up), and adds B's columns
of that slot times them into the layer's output in place. Only the token's own slot
is read, a token without an adapter (slot -1: also the padding rows of a CUDA graph)
returns at once, and nothing is allocated.

Rounding is the masked form's: x A^T rounded to the activation dtype, the delta
rounded before it is added, the sum rounded. Steps of more tokens than MAX_TOKENS
(prefills) take the masked GEMMs, which use tensor cores.

Off by default (SPINDLE_LORA_KERNEL=1 turns it on): it equals the masked form under
Triton's interpreter and on an H100 (tests/test_lora_kernel.py, test_lora.py -m gpu),
but in CUDA graphs on an H100 it was slower than the two GEMMs (64 requests on one
adapter: 0.46 of the base model's speed against 0.66; one request: 0.30 against 0.42;
docs/benchmarks.md): each program reads its slot's A and B for its one token, where a
GEMM reads them once a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spindle.layers import pdl
MAX_TOKENS = 256  # the largest step (in tokens) the kernel takes: decode-sized ones
MAX_PARTS = 3  # q/k/v, the most projections a layer merges
_BLOCK_N = 128
_BLOCK_K = 128
_TARGET_PROGRAMS = 264  # about two waves of an H100/H200 (132 SMs)


def takes(x: torch.Tensor, y: torch.Tensor, parts: int) -> bool:
    """Whether lora_add_ applies: CUDA 2-D tensors of a decode-sized step (the switch,
    SPINDLE_LORA_KERNEL, is read once, by the layer's LoRASlots)."""
    return (x.is_cuda and x.dim() == 2 and y.dim() == 2 and x.shape[0] <= MAX_TOKENS
            and x.stride(1) == 1
            and parts <= MAX_PARTS and y.is_contiguous())


def lora_add_(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
              b: torch.Tensor, part_rows: list[int], max_loras: int, max_rank: int) -> None:
    """y [T, N] += each token's adapter share, in place: for token t of slot s and output
    column n of part p, sum_r b[n, c + r] * round(a[c + r] . x[t]) with
    c = (p * max_loras + s) * max_rank (lora/layers.py's layout); part_rows: the parts'
    output rows in y's column order (summing to N); slots [T], -1 for none."""
    num_tokens, k = x.shape
    n = y.shape[1]
    if num_tokens == 0:
        return
    if sum(part_rows) != n:
        raise ValueError(f"LoRA parts of {part_rows} rows for an output of {n} columns")
    ends = list(part_rows)
    for i in range(1, len(ends)):
        ends[i] += ends[i - 1]
    ends += [n] * (MAX_PARTS - len(ends))
    blocks = triton.cdiv(n, _BLOCK_N)
    splits = max(1, min(blocks, _TARGET_PROGRAMS // num_tokens))
    _lora_add_kernel[(num_tokens, splits)](
        y, x, slots, a, b, y.stride(0), x.stride(0), a.stride(0), b.stride(0),
        n, k, max_loras, ends[0], ends[1], splits * _BLOCK_N,
        RANK=max_rank, RANK_BLOCK=triton.next_power_of_2(max_rank), PARTS=len(part_rows),
        BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4,
        **pdl.kernel_args(y.device, num_tokens))


@triton.jit
def _shrink(x_ptr, a_ptr, a_stride, first_row, k, RANK: tl.constexpr,
            RANK_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """[RANK_BLOCK] rows first_row.. of A times x, rounded to x's dtype, as float32."""
    r = tl.arange(0, RANK_BLOCK)
    acc = tl.zeros([RANK_BLOCK], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        xs = tl.load(x_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)
        tile = tl.load(a_ptr + (first_row + r)[:, None] * a_stride + cols[None, :],
                       mask=(r[:, None] < RANK) & (cols[None, :] < k), other=0.0)
        acc += tl.sum(tile.to(tl.float32) * xs[None, :], 1)
    return acc.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _expand(b_ptr, b_stride, first_col, shrunk, cols, in_part, RANK: tl.constexpr,
            RANK_BLOCK: tl.constexpr):
    """[BLOCK_N] B's rows cols (those in_part) times shrunk over its columns first_col.."""
    r = tl.arange(0, RANK_BLOCK)
    tile = tl.load(b_ptr + cols[:, None].to(tl.int64) * b_stride + (first_col + r)[None, :],
                   mask=in_part[:, None] & (r[None, :] < RANK), other=0.0)
    return tl.sum(tile.to(tl.float32) * shrunk[None, :], 1)


@triton.jit
def _lora_add_kernel(y_ptr, x_ptr, slots_ptr, a_ptr, b_ptr, y_stride, x_stride, a_stride,
                     b_stride, n, k, num_slots, end0, end1, n_step, RANK: tl.constexpr,
                     RANK_BLOCK: tl.constexpr, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        x_row = x_ptr + token * x_stride
        s0 = _shrink(x_row, a_ptr, a_stride, slot * RANK, k, RANK, RANK_BLOCK, BLOCK_K)
        s1 = s0
        s2 = s0
        if PARTS > 1:
            s1 = _shrink(x_row, a_ptr, a_stride, (num_slots + slot) * RANK, k, RANK,
                         RANK_BLOCK, BLOCK_K)
        if PARTS > 2:
            s2 = _shrink(x_row, a_ptr, a_stride, (2 * num_slots + slot) * RANK, k, RANK,
                         RANK_BLOCK, BLOCK_K)
        for n0 in range(tl.program_id(1) * BLOCK_N, n, n_step):
            cols = n0 + tl.arange(0, BLOCK_N)
            inside = cols < n
            if PARTS == 1:
                delta = _expand(b_ptr, b_stride, slot * RANK, s0, cols, inside, RANK,
                                RANK_BLOCK)
            else:
                delta = _expand(b_ptr, b_stride, slot * RANK, s0, cols, cols < end0, RANK,
                                RANK_BLOCK)
                delta += _expand(b_ptr, b_stride, (num_slots + slot) * RANK, s1, cols,
                                 (cols >= end0) & (cols < end1) & inside, RANK, RANK_BLOCK)
                if PARTS > 2:
                    delta += _expand(b_ptr, b_stride, (2 * num_slots + slot) * RANK, s2,
                                     cols, (cols >= end1) & inside, RANK, RANK_BLOCK)
            out = y_ptr + token * y_stride + cols
            y = tl.load(out, mask=inside, other=0.0)
            delta = delta.to(y.dtype).to(tl.float32)
            tl.store(out, (y.to(tl.float32) + delta).to(y.dtype), mask=inside)
