"""The greedy sampler's argmax on CUDA, in two small Triton kernels.

torch's argmax of one row of a 152k vocabulary took 9.4 us of a batch-1 decode step on
an H100 (docs/benchmarks.md): one reduction carrying (value, index) pairs over the whole
row. Here each row is cut into chunks of CHUNK ids; a program per (row, chunk) finds
its chunk's first maximum, then a program per row picks the first chunk holding the
row's maximum. Both launch with PDL (layers/pdl.py) where it is on: inside a decode
graph they follow the LM head without waiting for its tail.

The result is torch's, id for id: ties go to the smallest id, and a NaN counts as larger
than everything (the first NaN of a row wins, as torch's argmax has it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spindle.layers import pdl
from spindle.runner.graph_advance import NextInputs, advance_launch, advance_row

CHUNK = 2048  # ids a program of the first kernel reduces (152k ids: 75 programs a row)


def argmax_rows(logits: torch.Tensor, also_into: torch.Tensor | None = None,
                next_inputs: NextInputs | None = None) -> torch.Tensor:
    """The int64 index of each row's first maximum of logits [rows, vocab] (a CUDA
    tensor, or a CPU one under Triton's interpreter); rows must be unit-strided.
    also_into: a contiguous int64 tensor of [rows] on the same device that receives the
    indices too (a decode graph's input ids: its next step's inputs). next_inputs: a
    decode graph's other inputs, which the rows' programs advance for the next step
    (runner/graph_advance.py), for rows 0 .. rows - 1."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"argmax_rows takes [rows, vocab] logits with unit-strided rows, got "
                         f"shape {tuple(logits.shape)}, strides {logits.stride()}")
    rows, vocab = logits.shape
    if also_into is not None and not (also_into.shape == (rows,) and also_into.is_contiguous()
                                      and also_into.dtype == torch.int64
                                      and also_into.device == logits.device):
        raise ValueError(f"argmax_rows: also_into must be a contiguous int64 tensor of "
                         f"[{rows}] on {logits.device}, got {also_into.dtype} of shape "
                         f"{tuple(also_into.shape)} on {also_into.device}")
    # Zeros outside a CUDA graph's capture: a launch skipped while warm-up compiles ahead
    # (runner/compile_ahead.py) then leaves id 0, not garbage the host would record. The
    # chunks' ids too: the second kernel may be compiled (it does not see the logits'
    # dtype or alignment: an engine of another dtype ran before in the process) while
    # the first is skipped, and it would pick an id from unwritten memory.
    capturing = logits.is_cuda and torch.cuda.is_current_stream_capturing()
    new_ids = torch.empty if capturing else torch.zeros
    out = new_ids(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    where = new_ids((rows, chunks), dtype=torch.int32, device=logits.device)
    launch = pdl.kernel_args(logits.device, None)  # (whatever the rows: one variant)
    _chunk_argmax_kernel[(rows, chunks)](logits, best, where, logits.stride(0), vocab,
                                         CHUNKS=chunks, CHUNK=CHUNK, num_warps=4, **launch)
    advance, advance_constants = advance_launch(next_inputs, out)
    _row_argmax_kernel[(rows,)](best, where, out, also_into if also_into is not None else out,
                                *advance, CHUNKS=chunks, BLOCK=triton.next_power_of_2(chunks),
                                ALSO=also_into is not None, num_warps=1, **advance_constants,
                                **launch)
    return out


@triton.jit
def _first_max(values, ids, BIG: tl.constexpr):
    """(value, id) of the first maximum of values at ids (ids below BIG), a NaN counting
    as the largest value."""
    nan = values != values
    first_nan = tl.min(tl.where(nan, ids, BIG), 0)
    best = tl.max(tl.where(nan, float("-inf"), values), 0)
    best_id = tl.min(tl.where(values == best, ids, BIG), 0)
    has_nan = first_nan < BIG
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, best_id)


@triton.jit
def _chunk_argmax_kernel(logits_ptr, best_ptr, where_ptr, row_stride, vocab,
                         CHUNKS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    values = tl.load(logits_ptr + row * row_stride + ids, mask=ids < vocab,
                     other=float("-inf")).to(tl.float32)
    # (The masked tail is -inf and comes after every id of the row: it never wins.)
    best, best_id = _first_max(values, ids, 2147483647)
    tl.store(best_ptr + row * CHUNKS + chunk, best)
    tl.store(where_ptr + row * CHUNKS + chunk, best_id)


@triton.jit
def _row_argmax_kernel(best_ptr, where_ptr, out_ptr, also_ptr, positions_ptr, seq_lens_ptr,
                       slots_ptr, slot_stride, tables_ptr, table_group_stride,
                       table_row_stride, table_cols, ring_ptr, ring_stride, ring_index_ptr,
                       CHUNKS: tl.constexpr, BLOCK: tl.constexpr, ALSO: tl.constexpr,
                       ADVANCE: tl.constexpr, NUM_GROUPS: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, TO_HOST: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK)
    valid = chunks < CHUNKS
    best = tl.load(best_ptr + row * CHUNKS + chunks, mask=valid, other=float("-inf"))
    ids = tl.load(where_ptr + row * CHUNKS + chunks, mask=valid, other=2147483647)
    # Chunks hold ascending ids: the first chunk with the maximum holds the first id.
    _, best_id = _first_max(best, ids, 2147483647)
    tl.store(out_ptr + row, best_id.to(tl.int64))
    if ALSO:
        tl.store(also_ptr + row, best_id.to(tl.int64))
    if ADVANCE:
        advance_row(row, best_id.to(tl.int64), positions_ptr, seq_lens_ptr, slots_ptr,
                    slot_stride, tables_ptr, table_group_stride, table_row_stride, table_cols,
                    ring_ptr, ring_stride, ring_index_ptr, NUM_GROUPS, BLOCK_SIZE, TO_HOST)
