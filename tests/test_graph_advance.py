"""Decode graphs that advance their own inputs (runner/graph_advance.py): the argmax
kernel's advance against the host's mirror of it, on fresh random buffers (on a GPU, or
under Triton's interpreter), and CudaGraphRunner's choice to stage nothing, without a GPU:
a step stages nothing only when the device holds exactly what staging would write."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from kernel_utils import DEVICE

from spindle.cache.spec import FULL_ATTENTION, SLIDING_WINDOW, CacheGroup
from spindle.runner import cuda_graph
from spindle.runner.graph_advance import RING_SLOTS, UNKNOWN_SLOT, NextInputs, advance_mirror

BLOCK = 4


def test_mirror_rule_by_hand():
    """Row 0 moves inside its block, row 1 into the next block (column 2, known), row 2
    past the host's columns (unknown), row 3 has no cache write (slot -1: only its
    position and length move), row 4 is padding (length 0: nothing moves)."""
    positions = np.array([5, 7, 11, 2, 9], dtype=np.int64)
    seq_lens = np.array([6, 8, 12, 3, 0], dtype=np.int32)
    slots = np.array([[4 * 10 + 1, 4 * 11 + 3, 4 * 12 + 3, -1, -1]], dtype=np.int64)
    table = np.array([[3, 10, 0], [2, 11, 20], [1, 5, 12], [9, 9, 9]], dtype=np.int32)
    advance_mirror(positions, seq_lens, slots, [table], BLOCK)
    assert positions.tolist() == [6, 8, 12, 3, 9]
    assert seq_lens.tolist() == [7, 9, 13, 4, 0]
    assert slots.tolist() == [[42, 80, UNKNOWN_SLOT, -1, -1]]


@pytest.mark.gpu
@pytest.mark.kernel
@pytest.mark.parametrize("groups,to_host", [(1, False), (2, False), (1, True)])
def test_kernel_advances_as_the_mirror_says(groups, to_host):
    """argmax_rows with next_inputs: the tokens as without, and positions, lengths and
    slots as advance_mirror has them (a slot it cannot know is -1 on the device: the
    block is past the table's columns); rows past the launch's are not touched. With a
    host ring: each row's token in its slot of the (pinned) ring, the slot moved on."""
    from spindle.runner.sample.argmax_kernel import argmax_rows

    rng = np.random.default_rng(groups)
    rows, launched, cols, t = 8, 6, 5, 12
    seq_lens = rng.integers(1, cols * BLOCK, rows).astype(np.int32)
    seq_lens[4] = 0  # (a padding row)
    seq_lens[5] = cols * BLOCK  # (its next block is past the columns)
    positions = (seq_lens.astype(np.int64) - 1).clip(0)
    tables = rng.integers(0, 1000, (groups, rows, cols)).astype(np.int32)
    slots = np.full((groups, t), -1, dtype=np.int64)
    for g in range(groups):
        live = np.flatnonzero(seq_lens > 0)
        slots[g, live] = (tables[g, live, positions[live] // BLOCK].astype(np.int64) * BLOCK
                          + positions[live] % BLOCK)
    slots[groups - 1, 1] = -1  # (a row that writes no cache in that group)
    logits = torch.randn(launched, 3000, generator=torch.Generator().manual_seed(groups))
    ring_index = np.array([3, 0, 1, 2, 3, 0, 2, 2], dtype=np.int64)
    device = {name: torch.from_numpy(array.copy()).to(DEVICE) for name, array in
              dict(positions=positions, seq_lens=seq_lens, slots=slots, tables=tables,
                   ring_index=ring_index).items()}
    ring = torch.full((RING_SLOTS, rows), -5, dtype=torch.int64,
                      pin_memory=DEVICE == "cuda") if to_host else None
    got = argmax_rows(logits.to(DEVICE), next_inputs=NextInputs(
        device["positions"], device["seq_lens"], device["slots"], device["tables"], BLOCK,
        ring, device["ring_index"] if to_host else None))
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    if to_host:
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        want_ring = np.full((RING_SLOTS, rows), -5)
        want_ring[ring_index[:launched], np.arange(launched)] = got.tolist()
        assert ring.tolist() == want_ring.tolist()
        moved = ring_index.copy()
        moved[:launched] = (moved[:launched] + 1) % RING_SLOTS
        assert device["ring_index"].tolist() == moved.tolist()
    else:
        assert device["ring_index"].tolist() == ring_index.tolist()

    want_slots = slots.copy()
    head = slice(0, launched)
    advance_mirror(positions[head], seq_lens[head], want_slots[:, head],
                   list(tables[:, :launched]), BLOCK)
    assert device["positions"].tolist() == positions.tolist()
    assert device["seq_lens"].tolist() == seq_lens.tolist()
    unknown = want_slots == UNKNOWN_SLOT
    assert unknown[:, 5].all() and not unknown[:, :5].any()
    assert (device["slots"].cpu().numpy()[unknown] == -1).all()
    assert device["slots"].cpu().numpy()[~unknown].tolist() == want_slots[~unknown].tolist()


# ---- the runner's side: when a step stages nothing -------------------------------------

MAX_BATCH, MAX_BLOCKS = 16, 6


@pytest.fixture
def runner(monkeypatch):
    """A CPU CudaGraphRunner whose graphs of <= 8 requests advance their inputs as the
    kernel does (advance_mirror on the buffers; the 16-request graph does not), and
    count their replays and keep the inputs each read."""
    monkeypatch.setattr(cuda_graph, "_pinned_zeros",
                        lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    runner = cuda_graph.CudaGraphRunner(
        None, MAX_BATCH, MAX_BLOCKS, torch.device("cpu"),
        [CacheGroup(FULL_ATTENTION, 1), CacheGroup(SLIDING_WINDOW, 1, 64)], block_size=BLOCK)
    runner.advances = True
    runner.replays, runner.seen = [], []

    def replay(size):
        runner.replays.append(size)
        runner.seen.append(dict(positions=runner.positions.tolist(),
                                seq_lens=runner.seq_lens.tolist(),
                                slots=[s.tolist() for s in runner.slot_mappings]))
        if size > cuda_graph.GREEDY_MAX_BATCH:
            return
        staged = runner._staged.numpy()
        ring_index = staged[cuda_graph._RING_INDEX, :size]
        if runner.tokens_to_host:  # (each row's token: its position + 1000)
            runner._ring.numpy()[ring_index, np.arange(size)] = \
                staged[cuda_graph._POSITIONS, :size] + 1000
        device_tables = [t.numpy() for t in runner.block_tables]
        cuda_graph.advance_mirror(staged[cuda_graph._POSITIONS, :size],
                                  staged[cuda_graph._SEQ_LENS].view(np.int32)[:size],
                                  staged[cuda_graph._FIRST_SLOTS:cuda_graph._FIRST_SLOTS + 2,
                                         :size], device_tables, BLOCK,
                                  ring_index if runner.tokens_to_host else None)
        # (the kernel writes -1 where the mirror cannot know)
        slots = staged[cuda_graph._FIRST_SLOTS:cuda_graph._FIRST_SLOTS + 2]
        slots[slots == UNKNOWN_SLOT] = -1

    for size in (1, 2, 4, 8, 16):
        runner.graphs[(1, size, False)] = types.SimpleNamespace(
            replay=lambda size=size: replay(size))
        runner.outputs[(1, size, False)] = cuda_graph.GraphOutputs(torch.zeros(size, 4))
    return runner


def _decode_batch(seq_lens, tables, version, rows=None):
    """A decode step of requests with these lengths over these block tables (one per
    group, [requests, blocks])."""
    seq_lens = np.asarray(seq_lens, dtype=np.int32)
    positions = seq_lens.astype(np.int64) - 1
    cols = int(-(-seq_lens.max() // BLOCK))
    num = len(seq_lens)
    return types.SimpleNamespace(
        rows=np.arange(num) if rows is None else np.asarray(rows), tables_version=version,
        num_reqs=num, num_tokens=num, input_ids=np.arange(num) + 100, model_positions=positions,
        seq_lens=seq_lens, state_slots=None, num_computed=positions,
        slot_mappings=[table[np.arange(num), positions // BLOCK].astype(np.int64) * BLOCK
                       + positions % BLOCK for table in tables],
        block_tables=[table[:, :cols] for table in tables], token_lora_slots=None)


def _assert_staged_as(runner, batch, size):
    """The last replay read what staging this batch writes."""
    num, seen = batch.num_reqs, runner.seen[-1]
    assert seen["positions"][:num] == batch.model_positions.tolist()
    assert seen["seq_lens"][:size] == batch.seq_lens.tolist() + [0] * (size - num)
    for g, slots in enumerate(batch.slot_mappings):
        assert seen["slots"][g][:size] == slots.tolist() + [-1] * (size - num)


def test_steps_the_device_holds_stage_nothing(runner):
    """Three requests decode: the steps inside their blocks stage nothing (the device's
    advance made their inputs); the step that needs a new block (a new tables version)
    stages, and so does a step whose tokens are not in place, or of other requests, or
    whose inputs differ from the advance in one value. (A step of four requests first:
    the two pinned mirrors then differ past the three requests' rows.)"""
    tables = [np.array([[3, 7, 15, 0], [5, 1, 0, 0], [2, 6, 16, 0]], dtype=np.int32),
              np.array([[8, 9, 17, 0], [4, 10, 0, 0], [11, 12, 18, 0]], dtype=np.int32)]
    four = [np.vstack([t, np.full((1, 4), 30, dtype=np.int32)]) for t in tables]
    runner.run(_decode_batch([5, 6, 5, 7], four, version=0))
    lens = np.array([5, 6, 5])
    runner.run(_decode_batch(lens, tables, version=1))
    assert runner.num_advanced == 0
    for step in range(1, 3):  # (lengths 6-7, 7-8: inside the second block)
        batch = _decode_batch(lens + step, tables, version=1)
        runner.run(batch, inputs_in_place=True)
        assert runner.num_advanced == step
        _assert_staged_as(runner, batch, 4)
    # Request 1 reaches 9 tokens: its third block comes with a new tables version.
    for table, block in zip(tables, (13, 14)):
        table[1, 2] = block
    batch = _decode_batch(lens + 3, tables, version=2)
    runner.run(batch, inputs_in_place=True)
    assert runner.num_advanced == 2
    _assert_staged_as(runner, batch, 4)
    batch = _decode_batch(lens + 4, tables, version=2)
    runner.run(batch, inputs_in_place=True)
    assert runner.num_advanced == 3
    _assert_staged_as(runner, batch, 4)
    # Input ids not in place (a sampled step before): staged.
    batch = _decode_batch(lens + 5, tables, version=2)
    runner.run(batch)
    assert runner.num_advanced == 3
    _assert_staged_as(runner, batch, 4)
    # One request's slot moved elsewhere (say, recomputed into another block).
    batch = _decode_batch(lens + 6, tables, version=2)
    batch.slot_mappings[0] = batch.slot_mappings[0].copy()
    batch.slot_mappings[0][2] = 77
    runner.run(batch, inputs_in_place=True)
    assert runner.num_advanced == 3
    _assert_staged_as(runner, batch, 4)
    # The same requests in another order (rows): other tables, staged.
    batch = _decode_batch(lens + 7, tables, version=2, rows=[2, 1, 0])
    runner.run(batch, inputs_in_place=True)
    assert runner.num_advanced == 3 and runner.replays == [4] * 9
    _assert_staged_as(runner, batch, 4)


def test_a_new_table_is_copied_before_the_step_that_reads_it(runner):
    """A block given ahead (a new tables version while the positions stay in their
    block): that step stages, tables included, though its slots are the advance's; the
    next step, in the new block, then finds its slot on the device."""
    tables = [np.array([[3, 7, 0], [5, 1, 0]], dtype=np.int32) for _ in range(2)]
    runner.run(_decode_batch([6, 5], tables, version=1))
    tables = [np.array([[3, 7, 21], [5, 1, 0]], dtype=np.int32) for _ in range(2)]
    ahead = _decode_batch([7, 6], tables, version=2)
    ahead.block_tables = [t.copy() for t in tables]  # (three columns: the block ahead)
    runner.run(ahead, inputs_in_place=True)
    assert runner.num_advanced == 0
    for step, lens in enumerate(([8, 7], [9, 8]), start=1):
        batch = _decode_batch(lens, tables, version=2)
        batch.block_tables = [t.copy() for t in tables]
        runner.run(batch, inputs_in_place=True)
        assert runner.num_advanced == step
        _assert_staged_as(runner, batch, 2)


def test_larger_graphs_and_advance_off_always_stage(runner):
    """The graph of more than GREEDY_MAX_BATCH requests does not advance (and the host
    keeps no mirror for it); with advances off a step in place stages all the same."""
    tables = [np.arange(40, dtype=np.int32).reshape(10, 4) + 1 for _ in range(2)]
    for step in range(3):
        batch = _decode_batch(np.full(10, 5) + step, tables, version=1)
        runner.run(batch, inputs_in_place=step > 0)
        _assert_staged_as(runner, batch, 16)
        assert runner._held is None
    runner.advances = False
    for step in range(3):
        batch = _decode_batch(np.full(2, 5) + step, [t[:2] for t in tables], version=1)
        runner.run(batch, inputs_in_place=step > 0)
        _assert_staged_as(runner, batch, 2)
    assert runner.num_advanced == 0 and runner._held is None
    assert runner.replays == [16] * 3 + [2] * 3


def test_tokens_to_the_host_ring(runner):
    """With tokens_to_host each advancing replay's tokens are in its slot of the ring
    (greedy_host), the slots taken in turn whether the step staged or not; a slot whose
    reader has not read it yet is not written again (an error: too many steps in
    flight), one whose reader is done or gone is."""
    import gc

    runner.tokens_to_host = True
    runner._ring = torch.zeros((RING_SLOTS, MAX_BATCH), dtype=torch.int64)
    tables = [np.array([[3, 7, 15, 0], [5, 1, 16, 0]], dtype=np.int32) for _ in range(2)]

    class Reader:
        done = False

    readers = []
    for step in range(6):
        batch = _decode_batch(np.array([5, 6]) + step, tables, version=1)
        outputs = runner.run(batch, inputs_in_place=step > 0)
        assert outputs.greedy_host.tolist() == (batch.model_positions + 1000).tolist()
        assert outputs.greedy_host.data_ptr() == runner._ring[step % RING_SLOTS].data_ptr()
        readers.append(Reader())
        runner.read_ring_by(readers[-1])
        readers[-1 - min(step, 1)].done = True  # (the step before, as the engine reads)
    assert runner.num_advanced == 4  # (at 9 tokens the second request's table widens)
    readers[-1].done = False
    readers[-RING_SLOTS].done = False  # (the slot the next step writes)
    with pytest.raises(RuntimeError, match="host ring slot 2 holds tokens nobody has read"):
        runner.run(_decode_batch(np.array([11, 12]), tables, version=1), inputs_in_place=True)
    readers[-RING_SLOTS] = None
    gc.collect()
    outputs = runner.run(_decode_batch(np.array([11, 12]), tables, version=1),
                         inputs_in_place=True)
    assert outputs.greedy_host.tolist() == [1010, 1011]


def test_replays_outside_run_make_the_next_step_stage(runner):
    """A graph replayed outside run() (a benchmark's timing loop) moves the device's
    inputs on without the mirror: after forget_device_inputs the next step in place
    stages everything, and its graph reads that step's inputs."""
    tables = [np.array([[3, 7, 15, 0], [5, 1, 16, 0]], dtype=np.int32) for _ in range(2)]
    runner.run(_decode_batch([5, 6], tables, version=1))
    runner.graphs[(1, 2, False)].replay()  # (the device is now a step further)
    runner.forget_device_inputs()
    batch = _decode_batch([6, 7], tables, version=1)
    runner.run(batch, inputs_in_place=True)
    assert runner.num_advanced == 0
    _assert_staged_as(runner, batch, 2)


def test_tokens_to_host_needs_the_advance(monkeypatch):
    """SPINDLE_GRAPH_TOKENS_TO_HOST=1 with the advance turned off is refused by name,
    not ignored; with the advance on (the default) it holds."""
    from spindle.runner.graph_advance import graph_advance_enabled, tokens_to_host_enabled

    monkeypatch.setenv("SPINDLE_GRAPH_TOKENS_TO_HOST", "1")
    monkeypatch.setenv("SPINDLE_GRAPH_ADVANCE", "0")
    with pytest.raises(ValueError, match="SPINDLE_GRAPH_TOKENS_TO_HOST=1 needs the graph "
                                         "advance, which SPINDLE_GRAPH_ADVANCE=0 turns off"):
        tokens_to_host_enabled()
    monkeypatch.delenv("SPINDLE_GRAPH_ADVANCE")
    assert graph_advance_enabled()
    assert tokens_to_host_enabled()
    monkeypatch.setenv("SPINDLE_GRAPH_ADVANCE", "1")
    assert tokens_to_host_enabled()
    monkeypatch.setenv("SPINDLE_GRAPH_TOKENS_TO_HOST", "0")
    assert not tokens_to_host_enabled()
