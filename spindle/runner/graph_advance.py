"""Decode graphs that advance their own inputs for the next step.

A greedy decode step of the same requests as the step before (runner/cuda_graph.py: the
graph feed) has inputs that follow from the last ones: each request's position and
sequence length one more, its slot the next one in its blocks. The small decode graphs'
last kernel (the greedy argmax's, runner/sample/argmax_kernel.py) writes them into the
graphs' static buffers as it writes the tokens into the input ids, so such a step stages
nothing: no host-to-device copy between two replays (on an H100 a step was the replay
plus 12-17 us, much of it the copies and the transitions around them; on an H200 28-35
us), and none of the copy call's host time. On by default (batch-1 decode +1.2% on an
H100, docs/benchmarks.md); SPINDLE_GRAPH_ADVANCE=0 turns it off.

With SPINDLE_GRAPH_TOKENS_TO_HOST=1 as well (off: it gained nothing beyond the advance on
an H100) the same programs write each row's token into pinned host memory (a ring of
RING_SLOTS steps, its slot an input the graph advances like the others), so a greedy
step queues no copy of its tokens either: between two replays the device then runs
nothing at all.

The device's guess is checked, never trusted: the host keeps a mirror of what the
device holds (`advance_mirror` applies the kernel's rule to it) and stages a step
whenever the inputs it computed differ from that mirror in any value (a new block, a
request that finished, a changed order). A row whose sequence length is 0 (padding)
keeps everything; a slot of -1 (no cache write) stays -1; a next position whose block
is not among the block table's columns gets slot -1 on the device and UNKNOWN_SLOT in
the mirror, which no staged value equals, so that step is staged.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from spindle.switches import on_off

GRAPH_ADVANCE_ENV = "SPINDLE_GRAPH_ADVANCE"
TOKENS_TO_HOST_ENV = "SPINDLE_GRAPH_TOKENS_TO_HOST"
# Steps of tokens the host ring holds: a slot is written again RING_SLOTS advancing replays
# later, by when the host has long read it (at most two steps are in flight).
RING_SLOTS = 4
_RING_SLOTS = tl.constexpr(RING_SLOTS)  # (what a kernel may read of a module's globals)
# A slot the host cannot predict (staged slots are -1 or a cache slot: never this).
UNKNOWN_SLOT = -2


def graph_advance_enabled() -> bool:
    """Whether the graphs that feed their argmax advance their inputs too (module
    docstring): unless SPINDLE_GRAPH_ADVANCE=0."""
    return on_off(GRAPH_ADVANCE_ENV, True)


def tokens_to_host_enabled() -> bool:
    """Whether the graphs that advance their inputs write their tokens to the host ring
    too (module docstring): with SPINDLE_GRAPH_TOKENS_TO_HOST=1, which needs
    the advance (the ring's slot is an input the graphs advance)."""
    if not on_off(TOKENS_TO_HOST_ENV, False):
        return False
    if not graph_advance_enabled():
        raise ValueError(f"{TOKENS_TO_HOST_ENV}=1 needs the graph advance, which "
                         f"{GRAPH_ADVANCE_ENV}=0 turns off: the host ring's slot is an input "
                         "that only advancing graphs move on")
    return True


class NextInputs(NamedTuple):
    """The static buffers a graph's argmax kernel advances: positions (int64 [rows]),
    sequence lengths (int32 [rows]), each paged group's slots (int64 [groups, cols],
    a row per group) and block tables (int32 [groups, rows, blocks]); block_size: the
    cache's tokens per block. ring: where the tokens go on the host too, pinned int64
    [RING_SLOTS, rows], at each row's slot in ring_index (int64 [rows]); or None."""
    positions: torch.Tensor
    seq_lens: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    block_size: int
    ring: torch.Tensor | None = None
    ring_index: torch.Tensor | None = None

    def kernel_args(self) -> tuple:
        """Pointers and strides in the order advance_row takes them after the token."""
        ring = (self.ring, self.ring.stride(0), self.ring_index) if self.ring is not None \
            else (self.positions, 0, self.positions)
        return (self.positions, self.seq_lens, self.slots, self.slots.stride(0), self.tables,
                self.tables.stride(0), self.tables.stride(1), self.tables.shape[2], *ring)


def advance_launch(next_inputs: NextInputs | None, placeholder: torch.Tensor
                   ) -> tuple[tuple, dict]:
    """(advance_row's pointer and stride arguments, its constexprs ADVANCE, NUM_GROUPS,
    BLOCK_SIZE and TO_HOST) for a kernel that calls it: without next_inputs,
    placeholder's pointer and zeros, which a kernel compiled with ADVANCE off never
    reads."""
    if next_inputs is None:
        args = (placeholder,) * 3 + (0, placeholder, 0, 0, 0, placeholder, 0, placeholder)
        return args, dict(ADVANCE=False, NUM_GROUPS=0, BLOCK_SIZE=1, TO_HOST=False)
    return next_inputs.kernel_args(), dict(
        ADVANCE=True, NUM_GROUPS=next_inputs.slots.shape[0],
        BLOCK_SIZE=next_inputs.block_size, TO_HOST=next_inputs.ring is not None)


@triton.jit
def advance_row(row, token, positions_ptr, seq_lens_ptr, slots_ptr, slot_stride, tables_ptr,
                table_group_stride, table_row_stride, table_cols, ring_ptr, ring_stride,
                ring_index_ptr, NUM_GROUPS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                TO_HOST: tl.constexpr):
    """Row `row`'s inputs for the next decode step (module docstring), and with TO_HOST
    its token (int64) into the host ring: called by one program per row, after every
    kernel that reads them has finished."""
    if TO_HOST:
        index = tl.load(ring_index_ptr + row)
        tl.store(ring_ptr + index * ring_stride + row, token)
        tl.store(ring_index_ptr + row, (index + 1) % _RING_SLOTS)
    seq_len = tl.load(seq_lens_ptr + row)
    if seq_len > 0:
        position = tl.load(positions_ptr + row) + 1
        tl.store(positions_ptr + row, position)
        tl.store(seq_lens_ptr + row, seq_len + 1)
        col = position // BLOCK_SIZE
        inside = col < table_cols
        for g in tl.static_range(NUM_GROUPS):
            slot = tl.load(slots_ptr + g * slot_stride + row)
            if slot >= 0:
                block = tl.load(tables_ptr + g * table_group_stride + row * table_row_stride
                                + col, mask=inside, other=-1).to(tl.int64)
                tl.store(slots_ptr + g * slot_stride + row,
                         tl.where(inside, block * BLOCK_SIZE + position % BLOCK_SIZE, -1))


def advance_mirror(positions: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray,
                   tables: list[np.ndarray], block_size: int,
                   ring_index: np.ndarray | None = None) -> None:
    """advance_row's rule on the host's mirror of one graph's rows, in place: positions
    (int64 [size]), seq_lens (int32 [size]), slots (int64 [groups, size]); tables: per
    group the block tables the device holds, [requests, cols] (rows past them padding,
    columns past them unknown to the host); ring_index (int64 [size]) where the tokens
    go to the host."""
    if ring_index is not None:
        ring_index[:] = (ring_index + 1) % RING_SLOTS
    live = seq_lens > 0
    positions[live] += 1
    seq_lens[live] += 1
    rows = np.arange(len(positions))
    cols = positions // block_size
    for slot, table in zip(slots, tables):
        moves = live & (slot >= 0)
        known = moves & (rows < table.shape[0]) & (cols < table.shape[1])
        slot[known] = (table[rows[known], cols[known]].astype(np.int64) * block_size
                       + positions[known] % block_size)
        slot[moves & ~known] = UNKNOWN_SLOT
