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


@pytest.fixture
def overlapping_runner(make_runner, monkeypatch):
    """A runner whose decode graphs of MAX_BATCH requests run as two halves (the
    threshold and the skinny GEMM's rows lowered to this test's sizes)."""
    monkeypatch.setenv("SPINDLE_DECODE_OVERLAP_FROM", str(MAX_BATCH))
    monkeypatch.setattr(cuda_graph, "skinny_max_rows", lambda: 1)
    return lambda groups: make_runner(groups, overlap=True)


def test_overlapped_graphs_start_each_half_longest_first(overlapping_runner):
    """A graph whose halves run at once stages each half's decode order within the half
    (the kernel of each half reads its own rows); smaller graphs, one order."""
    runner = overlapping_runner([CacheGroup(FULL_ATTENTION, 1)])
    if not runner.longest_first:
        pytest.skip("SPINDLE_DECODE_LONGEST_FIRST=0 in this environment")
    assert runner._row_ranges(MAX_BATCH) == [(0, 4), (4, 8)]
    assert runner._row_ranges(MAX_BATCH, adapters=True) == [(0, MAX_BATCH)]
    assert runner._row_ranges(4) == [(0, 4)]
    batch = _batch([9, 4, 40, 22, 17, 3, 30], 1)
    runner._stage_inputs(batch, MAX_BATCH)
    order = runner.decode_order.tolist()
    assert order[:4] == [2, 3, 0, 1]  # (9, 4, 40, 22)
    assert order[4:] == [2, 0, 1, 3]  # (17, 3, 30, padding 0)
    batch = _batch([9, 4, 40], 1)
    runner._stage_inputs(batch, 4)
    assert runner.decode_order[:4].tolist() == [2, 0, 1, 3]


def test_warm_up_forwards_order_each_half_within_it(overlapping_runner, monkeypatch):
    """The eager forward and capture of each shape (no step staged yet) see a decode
    order that indexes each half's own rows: a half's kernel reading order values of
    the whole batch read past its rows (an illegal address on an H100)."""
    runner = overlapping_runner([CacheGroup(FULL_ATTENTION, 1)])
    if not runner.longest_first:
        pytest.skip("SPINDLE_DECODE_LONGEST_FIRST=0 in this environment")
    seen = {}
    monkeypatch.setattr(runner, "_step", lambda size, query_len, adapters: seen.setdefault(
        size, runner.decode_order[:size].tolist()))
    runner.forward_each_size()
    assert seen[MAX_BATCH] == [0, 1, 2, 3, 0, 1, 2, 3]
    for size, order in seen.items():
        for start, end in runner._row_ranges(size):
            assert sorted(order[start:end]) == list(range(end - start))


def test_only_paged_caches_overlap(overlapping_runner):
    """State layers (Mamba, cross-attention) keep one forward per graph."""
    runner = overlapping_runner([CacheGroup(FULL_ATTENTION, 1), CacheGroup(MAMBA, 3)])
    assert runner._row_ranges(MAX_BATCH) == [(0, MAX_BATCH)]
    runner = overlapping_runner([CacheGroup(FULL_ATTENTION, 1),
                                 CacheGroup(SLIDING_WINDOW, 2, 64)])
    assert runner._row_ranges(MAX_BATCH) == [(0, 4), (4, 8)]


def test_a_halfs_metadata_reads_its_rows_of_the_static_buffers(overlapping_runner):
    """The second half's metadata is views of rows 4-8 of what the graph reads, in lane
    1 (its own split counters); the first half's rows 0-4, lane 0."""
    runner = overlapping_runner([CacheGroup(FULL_ATTENTION, 1),
                                 CacheGroup(SLIDING_WINDOW, 2, 64)])
    runner._stage_inputs(_batch([9, 4, 40, 22, 17, 3, 30], 2), MAX_BATCH)
    for start, lane in ((0, 0), (4, 1)):
        for g, meta in enumerate(runner._metadata(4, 1, start, lane)):
            rows = slice(start, start + 4)
            assert meta.lane == lane and meta.num_reqs == meta.num_tokens == 4
            for view, whole in ((meta.seq_lens, runner.seq_lens),
                                (meta.block_tables, runner.block_tables[g]),
                                (meta.slot_mapping, runner.slot_mappings[g]),
                                (meta.decode_order, runner.decode_order)):
                assert view.data_ptr() == whole[rows].data_ptr()
                assert view.shape[0] == 4
            assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]


class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def record_event(self):
        self.log.append(("record", self.name))
        return f"event on {self.name}"

    def wait_event(self, event):
        self.log.append(("wait", self.name, event))


@pytest.mark.parametrize("offset", [False, True])
def test_the_halves_fork_from_the_step_and_join_it(overlapping_runner, monkeypatch, offset):
    """The second half's forward runs on the side stream after that stream waited for
    the step's (the inputs are staged there), the step's stream waits for it before
    the halves' hidden states are joined in request order, and each half's forward
    reads its own rows of the inputs. With the offset, the side stream also waits for
    an event the first half records once its first attention layer has run (and only
    then: the hook is gone afterwards)."""
    from spindle.forward_context import get_forward_context

    monkeypatch.setenv("SPINDLE_DECODE_OVERLAP_OFFSET", "1" if offset else "0")
    runner = overlapping_runner([CacheGroup(FULL_ATTENTION, 1)])
    assert runner.overlap_offset is offset
    runner._stage_inputs(_batch([9, 4, 40, 22, 17, 3, 30], 1), MAX_BATCH)
    log, current = [], []
    main = _FakeStream("main", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream("side", log))

    class _On:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch.cuda, "stream", _On)
    current.append(main)

    layers = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])

    def forward(inputs):
        meta = get_forward_context().attn_metadata
        log.append(("forward", current[-1].name, meta.lane, inputs["input_ids"].tolist()))
        for layer in layers:
            layer(inputs)
        return inputs["positions"].float()[:, None]

    runner.state = types.SimpleNamespace(forward=forward, model=layers)
    monkeypatch.setattr(cuda_graph, "Attention", torch.nn.Identity)  # (the layers' type)
    hidden = runner._forward_halves(MAX_BATCH, 4)
    ids = runner.input_ids[:MAX_BATCH].tolist()
    after_first = [("record", "main"), ("wait", "side", "event on main")] if offset else []
    assert log == [("wait", "side", "main"), ("forward", "main", 0, ids[:4]), *after_first,
                   ("forward", "side", 1, ids[4:]), ("wait", "main", "side")]
    assert hidden[:, 0].tolist() == runner.positions[:MAX_BATCH].float().tolist()
    assert not layers[0]._forward_hooks


@pytest.mark.parametrize("raw, expected", [("", 128), ("96", 96), ("1", None), ("x", None)])
def test_overlap_threshold_is_read_or_refused_by_name(raw, expected):
    environ = {"SPINDLE_DECODE_OVERLAP_FROM": raw} if raw else {}
    if expected is None:
        with pytest.raises(ValueError, match="SPINDLE_DECODE_OVERLAP_FROM"):
            cuda_graph.overlap_min_batch(environ)
    else:
        assert cuda_graph.overlap_min_batch(environ) == expected
