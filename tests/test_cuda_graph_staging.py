"""CudaGraphRunner's staging without a GPU: a step's inputs reach the buffers its graphs
read, with the padding the graphs rely on. The int32 and bool inputs are views of rows
of one int64 array (staged with one copy), so these check every value through those
views, over steps whose batches shrink: the pinned mirrors are used in turn, so a
step's padding lands where a step before it held requests."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from spindle.cache.spec import FULL_ATTENTION, MAMBA, SLIDING_WINDOW, CacheGroup
from spindle.runner import cuda_graph

MAX_BATCH, MAX_BLOCKS = 8, 6
# (sequence lengths, graph size) of consecutive steps: the first and third use the same
# pinned mirror, the third with fewer requests.
STEPS = (([9, 4, 40, 22, 17, 3], 8), ([7, 30, 12, 5, 6], 8), ([5, 8], 4), ([11], 1))


@pytest.fixture
def make_runner(monkeypatch):
    monkeypatch.setattr(cuda_graph, "_pinned_zeros",
                        lambda shape, dtype: torch.zeros(shape, dtype=dtype))

    def make(groups, **kwargs):
        return cuda_graph.CudaGraphRunner(None, MAX_BATCH, MAX_BLOCKS, torch.device("cpu"),
                                          groups, **kwargs)
    return make


def _batch(seq_lens, num_paged, with_state=False, lora=None, tables_version=-1, seed=None):
    num = len(seq_lens)
    rng = np.random.default_rng(num if seed is None else seed)
    cols = 3
    return types.SimpleNamespace(
        rows=np.arange(num), tables_version=tables_version,
        num_reqs=num, num_tokens=num, input_ids=rng.integers(0, 1000, num),
        model_positions=np.asarray(seq_lens) - 1, seq_lens=np.asarray(seq_lens, np.int32),
        state_slots=rng.integers(0, 50, num).astype(np.int32) if with_state else None,
        num_computed=np.asarray([0] + [5] * (num - 1)),
        slot_mappings=[rng.integers(0, 500, num) for _ in range(num_paged)],
        block_tables=[rng.integers(0, 90, (num, cols)).astype(np.int32)
                      for _ in range(num_paged)],
        token_lora_slots=lora)


def _check(runner, batch, size):
    num = batch.num_reqs
    assert runner.input_ids[:num].tolist() == batch.input_ids.tolist()
    assert runner.positions[:num].tolist() == batch.model_positions.tolist()
    assert runner.seq_lens.dtype == torch.int32
    assert runner.seq_lens[:size].tolist() == batch.seq_lens.tolist() + [0] * (size - num)
    for g, slots in enumerate(batch.slot_mappings):
        assert runner.slot_mappings[g][:size].tolist() == slots.tolist() + [-1] * (size - num)
        cols = batch.block_tables[g].shape[1]
        assert runner.block_tables[g][:num, :cols].tolist() == batch.block_tables[g].tolist()
    if batch.state_slots is not None:
        assert runner.state_slots.dtype == torch.int32
        assert runner.state_slots[:size].tolist() == (batch.state_slots.tolist()
                                                      + [-1] * (size - num))
        assert runner.has_initial_state.dtype == torch.bool
        assert runner.has_initial_state[:num].tolist() == (batch.num_computed > 0).tolist()
    if runner.longest_first:
        order = runner.decode_order[:size].tolist()
        lens = runner.seq_lens[:size].tolist()
        assert sorted(order) == list(range(size))
        assert [lens[i] for i in order] == sorted(lens, reverse=True)


def test_paged_groups_stage_every_input(make_runner):
    runner = make_runner([CacheGroup(FULL_ATTENTION, 2), CacheGroup(SLIDING_WINDOW, 2, 64)])
    assert runner.decode_order.tolist() == list(range(MAX_BATCH))  # (batch order to start)
    assert runner.slot_mappings[1].tolist() == [-1] * len(runner.slot_mappings[1])
    for seq_lens, size in STEPS:
        batch = _batch(seq_lens, 2)
        runner._stage_inputs(batch, size)
        _check(runner, batch, size)


def test_state_groups_stage_slots_and_initial_states(make_runner):
    runner = make_runner([CacheGroup(FULL_ATTENTION, 1), CacheGroup(MAMBA, 3)])
    assert runner.state_slots.tolist() == [-1] * MAX_BATCH
    assert runner.has_initial_state.tolist() == [True] * MAX_BATCH
    for seq_lens, size in STEPS:
        batch = _batch(seq_lens, 1, with_state=True)
        runner._stage_inputs(batch, size)
        _check(runner, batch, size)


def test_adapter_slots_are_staged_with_padding(make_runner):
    runner = make_runner([CacheGroup(FULL_ATTENTION, 1)], lora=object())
    for seq_lens, size in STEPS:
        slots = np.arange(len(seq_lens)) % 3 - 1
        batch = _batch(seq_lens, 1, lora=slots)
        runner._stage_inputs(batch, size, adapters=True)
        _check(runner, batch, size)
        assert runner.lora_slots[:size].tolist() == (slots.tolist()
                                                     + [-1] * (size - len(seq_lens)))


def test_unchanged_block_tables_are_not_copied_again(make_runner):
    """A step whose tables version, rows and columns are those of the tables the
    device holds copies no tables (here the device's copy was overwritten to show it);
    another version, other rows or more columns copy them; version -1 always does."""
    runner = make_runner([CacheGroup(FULL_ATTENTION, 1)])
    first = _batch([9, 4], 1, tables_version=5, seed=1)
    runner._stage_inputs(first, 2)
    _check(runner, first, 2)
    runner.block_tables[0].fill_(-9)
    same = _batch([10, 5], 1, tables_version=5, seed=2)  # (other values: not read)
    runner._stage_inputs(same, 2)
    assert runner.block_tables[0][:2, :3].tolist() == [[-9] * 3] * 2
    assert runner.positions[:2].tolist() == [9, 4]  # (the rest is staged as ever)
    newer = _batch([10, 5], 1, tables_version=6, seed=3)
    other_rows = _batch([11, 6], 1, tables_version=6, seed=4)
    other_rows.rows = np.asarray([1, 0])
    wider = _batch([12, 7], 1, tables_version=6, seed=5)
    wider.block_tables = [np.arange(8, dtype=np.int32).reshape(2, 4)]
    unknown = _batch([13, 8], 1, seed=6)
    for batch in (newer, other_rows, wider, unknown, unknown):
        runner.block_tables[0].fill_(-9)
        runner._stage_inputs(batch, 2)
        _check(runner, batch, 2)


def test_inputs_in_place_are_neither_staged_nor_fed(make_runner):
    """run(inputs_in_place=True): the input ids the last replay left stay as they are
    (no staging, no feed) while every other input is staged; otherwise the staged ids
    and then the feed's are what the graph reads."""
    runner = make_runner([CacheGroup(FULL_ATTENTION, 1)])
    replays = []
    for size in (1, 2):
        runner.graphs[(1, size, False)] = types.SimpleNamespace(
            replay=lambda size=size: replays.append(size))
        runner.outputs[(1, size, False)] = cuda_graph.GraphOutputs(torch.zeros(size, 4))
    fed = []

    def feed(input_ids):
        fed.append(input_ids.numel())
        input_ids.fill_(55)

    batch = _batch([9, 4], 1)
    runner.run(batch, feed)
    assert runner.input_ids[:2].tolist() == [55, 55] and fed == [2]
    runner.input_ids[:2] = torch.tensor([31, 32])  # (the argmax a replay left)
    step = _batch([10, 5], 1, seed=8)
    runner.run(step, feed, inputs_in_place=True)
    assert runner.input_ids[:2].tolist() == [31, 32] and fed == [2]
    assert runner.positions[:2].tolist() == [9, 4]
    assert runner.num_in_place == 1 and replays == [2, 2]
    lone = _batch([11], 1, seed=9)
    runner.run(lone)
    assert runner.input_ids[:1].tolist() == lone.input_ids.tolist() and replays[-1] == 1
