"""CUDA graphs for decode steps: capture once per batch size, replay every step.

All static buffers live here, sized for the largest captured batch: the step's
token ids, positions and sequence lengths, and per cache group what its layers
read (a paged group: block table and slots; a state group: the state slots). A
decode batch of B requests is padded to the next captured size P: padding rows get
slot -1 (the store-KV kernel skips them), sequence length 0 (attention writes
zeros) and state slot -1 (state layers skip them), so they touch no real cache
entry and produce garbage that nobody reads. Graphs are captured largest first
into one memory pool, which the smaller graphs then reuse.

With speculative decoding, steps where every request computes verify_len tokens
(its last token and its drafts) are captured too, for batches up to
verify_max_batch. Where LoRA adapters are served, each shape is captured twice: with the
adapters' work, and without it for steps none of whose requests has an adapter (which
then run as fast as the base model's). Graphs are keyed by (tokens per request, batch
size, adapters).

With logits=True the graphs end with the LM head (ModelState.compute_logits), so a
decode step launches no kernel of its own between the graph and its sampler: at batch 1
the head's launch was about a quarter of the step's host time. The logits of a padded
batch are computed for its padding rows too (nobody reads them). Each graph keeps its
own logits buffer (a graph's outputs stay allocated, so the shared pool cannot reuse
them): ModelRunner.graph_logits_bytes counts them all in the KV cache budget.

Decode graphs of at most GREEDY_MAX_BATCH requests then also take each row's argmax of
those logits (the greedy token), so a step whose sampler needs nothing but the argmax
launches nothing between its graph and the copy of its tokens to the host. A step that
samples otherwise ignores it: at a few rows the argmax costs about a microsecond of the
graph. SPINDLE_GRAPH_ARGMAX=0 leaves it to the sampler.

Those graphs also write the argmax into their own input ids (SPINDLE_GRAPH_FEED=0: not),
where the next decode step of the same requests in the same order reads its tokens: when
that step's tokens are that argmax (every request greedy), it neither copies them on the
device nor stages its input ids (run's inputs_in_place), one operation fewer between two
replays.

Their argmax kernel also advances the other inputs (positions, sequence lengths, slots)
for that next step, so a greedy step of the same requests, whose inputs the host finds
equal to its mirror of what the device holds, stages nothing at all
(runner/graph_advance.py; SPINDLE_GRAPH_ADVANCE=0: not). With
SPINDLE_GRAPH_TOKENS_TO_HOST=1 too (off), the kernel writes the tokens into a pinned ring
on the host (GraphOutputs.greedy_host), and such a step queues no copy of them either.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from typing import NamedTuple, Sequence

import numpy as np
import torch

from spindle.attention.metadata import AttentionMetadata, decode_order, longest_first_enabled
from spindle.cache.spec import FULL_ATTENTION, CacheGroup
from spindle.forward_context import forward_context
from spindle.layers.mamba.metadata import MambaMetadata
from spindle.runner.graph_advance import (RING_SLOTS, NextInputs, advance_mirror,
                                          graph_advance_enabled, tokens_to_host_enabled)
from spindle.runner.input_batch import StepBatch
from spindle.runner.model_states.base import ModelState
from spindle.runner.sample.sampler import greedy_kernel_enabled, raw_argmax
from spindle.switches import on_off

# Decode graphs of at most this many requests take the greedy tokens too (module docstring).
GREEDY_MAX_BATCH = 8
GRAPH_ARGMAX_ENV = "SPINDLE_GRAPH_ARGMAX"
GRAPH_FEED_ENV = "SPINDLE_GRAPH_FEED"

logger = logging.getLogger(__name__)


def graph_argmax_enabled() -> bool:
    """Whether decode graphs that compute the logits take their argmax too (module
    docstring): unless SPINDLE_GRAPH_ARGMAX=0."""
    return on_off(GRAPH_ARGMAX_ENV, True)


def graph_feed_enabled() -> bool:
    """Whether decode graphs that take the argmax write it into their input ids too
    (module docstring): unless SPINDLE_GRAPH_FEED=0."""
    return on_off(GRAPH_FEED_ENV, True)


def _takes_argmax(size: int, query_len: int) -> bool:
    """Whether a graph of this shape takes its rows' argmax, where the graphs take it at
    all (with_greedy): a decode graph of at most GREEDY_MAX_BATCH requests."""
    return query_len == 1 and size <= GREEDY_MAX_BATCH


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, then steps of 32 up to 256 and of 64 beyond,
    ending at max_batch: at most about a third of padding, and few enough graphs that
    capture stays a small part of startup."""
    sizes = [s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64) if s < max_batch]
    size = 96
    while size < max_batch:
        sizes.append(size)
        size += 32 if size < 256 else 64
    sizes.append(max_batch)
    return sizes


def sizes_by_len(max_batch: int, verify_len: int = 1,
                 verify_max_batch: int = 0) -> dict[int, list[int]]:
    """The batch sizes captured per number of tokens per request: decode steps (1), and
    verifying steps (verify_len) where speculation is on. Each shape is captured once
    per adapter variant where LoRA adapters are served."""
    sizes = {1: capture_sizes(max_batch)}
    if verify_len > 1 and verify_max_batch >= 1:
        sizes[verify_len] = capture_sizes(min(verify_max_batch, max_batch))
    return sizes


def graph_tokens(max_batch: int, verify_len: int = 1, verify_max_batch: int = 0) -> list[int]:
    """The tokens of each captured graph shape (one entry per shape of sizes_by_len)."""
    return [query_len * size for query_len, sizes
            in sizes_by_len(max_batch, verify_len, verify_max_batch).items() for size in sizes]


# Rows of the array staged each step (then one row per paged group's slots, then the
# tokens' LoRA slots); SEQ_LENS, STATE_SLOTS and DECODE_ORDER hold int32 values,
# HAS_STATE bools; RING_INDEX each row's slot of the host ring (graph_advance.py).
(_INPUT_IDS, _POSITIONS, _SEQ_LENS, _STATE_SLOTS, _HAS_STATE, _DECODE_ORDER, _RING_INDEX,
 _FIRST_SLOTS) = range(8)


def _int32_row(host: np.ndarray, row: int) -> np.ndarray:
    """Row `row` of the staged int64 array as the int32 values it holds."""
    return host[row].view(np.int32)


def _pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=True)


def _initial_inputs(rows: int, t: int, n: int) -> torch.Tensor:
    """A pinned mirror of the staged array with the values of rows no step has written:
    slots -1 (no cache write), state slots -1, every state initial, batch order."""
    host_t = _pinned_zeros((rows, t), torch.int64)
    host = host_t.numpy()
    host[_FIRST_SLOTS:] = -1
    _int32_row(host, _STATE_SLOTS)[:] = -1
    host[_HAS_STATE].view(np.bool_)[:n] = True
    _int32_row(host, _DECODE_ORDER)[:n] = np.arange(n, dtype=np.int32)
    return host_t


class GraphOutputs(NamedTuple):
    """What a graph leaves in its buffers: the hidden states, and where the graphs
    compute them the logits and, for a decode graph of few requests, each row's argmax
    of them (GREEDY_MAX_BATCH); greedy_host: the same argmax in pinned host memory,
    once the replay is done (a step's view of the ring: graph_advance.py), or None."""
    hidden: torch.Tensor
    logits: torch.Tensor | None = None
    greedy: torch.Tensor | None = None
    greedy_host: torch.Tensor | None = None

    def rows(self, num: int) -> "GraphOutputs":
        """The first num rows of each (views)."""
        return GraphOutputs(*(None if t is None else t[:num] for t in self))


class CudaGraphRunner:
    def __init__(self, state: ModelState, max_batch: int, max_blocks_per_req: int,
                 device: torch.device, groups: Sequence[CacheGroup] = (),
                 verify_len: int = 1, verify_max_batch: int = 0, lora=None,
                 logits: bool = False, block_size: int = 16) -> None:
        """lora: the runner's LoRAManager where adapters are served (each token's slot
        is staged like its position; the graphs compute the mask from it). logits: the
        graphs compute the LM head's logits too (see the module docstring). block_size:
        the paged cache's tokens per block (the graphs that advance their slots)."""
        self.state = state
        self.with_logits = logits
        self.with_greedy = logits and graph_argmax_enabled()
        # Whether the graphs that take the argmax leave it in the input ids too.
        self.feeds_inputs = self.with_greedy and graph_feed_enabled()
        # Whether they advance the other inputs too (graph_advance.py; the CUDA kernel's).
        self.advances = (self.feeds_inputs and graph_advance_enabled()
                         and greedy_kernel_enabled() and device.type == "cuda")
        self.tokens_to_host = tokens_to_host_enabled() and self.advances
        self.block_size = block_size
        self.lora = lora
        self.adapter_variants = (False, True) if lora is not None else (False,)
        self.device = device
        self.groups = list(groups) or [CacheGroup(FULL_ATTENTION, 1)]
        self.num_paged = sum(g.is_paged for g in self.groups)
        # Batch sizes captured per number of tokens per request.
        self.sizes_by_len = sizes_by_len(max_batch, verify_len, verify_max_batch)
        self.sizes = self.sizes_by_len[1]
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        t = max(size * q for q, sizes in self.sizes_by_len.items() for size in sizes)
        # Every per-step input but the block tables is a row of one int64 array (the
        # int32 and bool buffers are views of theirs), so a step stages them with one
        # host-to-device copy: each copy costs the host about 15 us.
        self._lora_row = _FIRST_SLOTS + self.num_paged  # (where adapters are served)
        rows = self._lora_row + 1
        self._staged = torch.zeros((rows, t), dtype=torch.int64, device=device)
        self.input_ids = self._staged[_INPUT_IDS]
        self.positions = self._staged[_POSITIONS]
        self.seq_lens = self._staged[_SEQ_LENS].view(torch.int32)[:n]
        # Decode graphs start their requests longest first (attention/metadata.py).
        self.longest_first = longest_first_enabled()
        self.decode_order = self._staged[_DECODE_ORDER].view(torch.int32)[:n]
        self.query_start_locs = {q: torch.arange(0, q * (n + 1), q, dtype=torch.int32,
                                                 device=device) for q in self.sizes_by_len}
        self.slot_mappings = [self._staged[_FIRST_SLOTS + g] for g in range(self.num_paged)]
        self._tables = torch.zeros((max(1, self.num_paged), n, max_blocks_per_req),
                                   dtype=torch.int32, device=device)
        self.block_tables = [self._tables[g] for g in range(self.num_paged)]
        self.lora_slots = self._staged[self._lora_row]
        self.state_slots = self._staged[_STATE_SLOTS].view(torch.int32)[:n]
        self.ring_index = self._staged[_RING_INDEX][:n]
        # The host ring the advancing graphs write their tokens to (tokens_to_host), the
        # number of advancing replays so far (the next one's slot: that modulo
        # RING_SLOTS), and per slot the reader of its last tokens (a weak reference).
        self._ring = _pinned_zeros((RING_SLOTS, n), torch.int64) if self.tokens_to_host \
            else None
        self._ring_steps = 0
        self._ring_slot = 0  # (the last advancing replay's)
        self.num_read_from_ring = 0  # steps whose tokens the host read from the ring
        self._ring_readers: list = [None] * RING_SLOTS
        self.has_initial_state = self._staged[_HAS_STATE].view(torch.bool)[:n]
        # Pinned host mirrors of the staged array, two used in turn: with async
        # scheduling a step is staged while the previous step's copy may still be
        # queued (see runner/staging.py). Rows a step does not write keep the values
        # set here. A step's block tables are packed [num, cols] in their pinned
        # buffer: a copy from a strided slice of pinned memory would go through a
        # pageable temporary, and a pageable copy makes the host wait for the device.
        self._host_sets = [(_initial_inputs(rows, t, n),
                            _pinned_zeros((max(1, self.num_paged), n * max_blocks_per_req),
                                          torch.int32))
                           for _ in range(2)]
        self._staged.copy_(self._host_sets[0][0])
        self._runs = 0
        # (tables version, columns, rows) of the block tables the device holds: a step
        # whose tables are those copies none (most decode steps of a small batch).
        self._tables_key: tuple | None = None
        # What the device's staged array holds, where the host knows it (after a replay
        # of a graph that advances its inputs: graph_advance.py), else None.
        self._held: np.ndarray | None = None
        self.num_advanced = 0  # replays that staged nothing: the last replay's advance
        self.num_replays: dict[tuple[int, int, bool], int] = {}  # by graph key, since capture
        self.num_in_place = 0  # replays whose input ids the replay before left (run)
        # (tokens per request, size, adapters) -> graph, its outputs
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, bool], GraphOutputs] = {}
        self.pool = None

    def can_run(self, batch: StepBatch) -> bool:
        """A batch of one token per request (or verify_len, for a captured verifying
        step) of at most the largest captured size. With state layers, none of its
        requests may be at its first token: the captured state update always starts
        from the stored state (a first token starts from zeros, eagerly)."""
        if batch.state_slots is not None and not batch.num_computed.all():
            return False
        if not self.state.graph_can_take(batch):
            return False
        num = batch.num_reqs
        query_len = batch.num_tokens // num if num else 0
        sizes = self.sizes_by_len.get(query_len)
        if not sizes or not self.graphs or num > sizes[-1] or batch.num_tokens != query_len * num:
            return False
        return query_len == 1 or bool((batch.num_scheduled == query_len).all())

    def _each_shape(self):
        """(query_len, size, adapters) of every graph, largest first, each after one
        eager forward of that graph's (outside any graph: kernels compile there);
        seq_lens zeroed after."""
        for query_len, sizes in self.sizes_by_len.items():
            for size in reversed(sizes):
                self.seq_lens[:size].fill_(query_len)
                for adapters in self.adapter_variants:
                    self._step(size, query_len, adapters)
                    yield query_len, size, adapters
        self.seq_lens.zero_()
        self._held = None  # (the eager steps advanced the inputs: graph_advance.py)

    @torch.inference_mode()
    def forward_each_size(self) -> None:
        """One eager forward per graph shape, nothing captured (compiling ahead)."""
        for _ in self._each_shape():
            pass

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller graphs reuse its pool)."""
        for key in self._each_shape():
            query_len, size, adapters = key
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[key] = self._step(size, query_len, adapters)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)

    def logits_bytes(self) -> int:
        """Device memory the graphs' logits hold."""
        return sum(out.logits.numel() * out.logits.element_size()
                   for out in self.outputs.values() if out.logits is not None)

    def run(self, batch: StepBatch, feed=None, inputs_in_place: bool = False) -> GraphOutputs:
        """Replay the graph of the smallest captured size >= batch size; returns its
        outputs' first T rows (T: the batch's tokens): views of the graph's buffers,
        valid until the next replay. feed(input_ids), when given, writes input ids
        still being sampled on the device. inputs_in_place: the last replay's argmax,
        already in the input ids (feeds_inputs), is every input id of this batch (a
        decode step of the same requests in the same order, all greedy): neither they
        are staged nor feed called; nor the other inputs, where the last replay
        advanced them to this batch's (graph_advance.py). With tokens_to_host, an
        advancing graph's outputs carry greedy_host: the caller hands its reader to
        read_ring_by."""
        num = batch.num_reqs
        query_len = batch.num_tokens // num
        sizes = self.sizes_by_len[query_len]
        size = sizes[bisect.bisect_left(sizes, num)]
        adapters = self.lora is not None and bool((batch.token_lora_slots >= 0).any())
        staged = self._stage_inputs(batch, size, query_len, adapters,
                                    with_ids=not inputs_in_place)
        if inputs_in_place:
            self.num_in_place += 1
            self.num_advanced += staged is None
        elif feed is not None:
            feed(self.input_ids[:batch.num_tokens])
        key = (query_len, size, adapters)
        ring_slot = self._free_ring_slot() if self.tokens_to_host and \
            self._advancing(size, query_len) else None
        self.graphs[key].replay()
        self.num_replays[key] = self.num_replays.get(key, 0) + 1
        self._follow_advance(batch, size, query_len, staged)
        outputs = self.outputs[key].rows(batch.num_tokens)
        if ring_slot is None:
            return outputs
        self._ring_slot = ring_slot
        return outputs._replace(greedy_host=self._ring[ring_slot, :batch.num_tokens])

    def _free_ring_slot(self) -> int:
        """The host ring's slot the next advancing replay writes, checked to hold no
        tokens a reader has yet to read."""
        slot = self._ring_steps % RING_SLOTS
        reader = self._ring_readers[slot]
        pending = reader() if reader is not None else None
        if pending is not None and not pending.done:
            raise RuntimeError(f"the decode graphs' host ring slot {slot} holds tokens nobody "
                               f"has read yet: more than {RING_SLOTS - 1} greedy decode steps "
                               "in flight")
        self._ring_readers[slot] = None
        return slot

    def read_ring_by(self, pending) -> None:
        """pending (a PendingOutput, with done) reads the last replay's greedy_host: its
        ring slot is not written again before pending is done (or dropped)."""
        self._ring_readers[self._ring_slot] = weakref.ref(pending)
        self.num_read_from_ring += 1

    def forget_device_inputs(self) -> None:
        """The device's staged inputs are no longer what the host's mirror says (graphs
        replayed outside run(), as benchmarks do: an advancing graph moves them on each
        replay): the next step stages them all."""
        self._held = None

    def _advancing(self, size: int, query_len: int) -> bool:
        """Whether the graph of this shape advances its inputs (graph_advance.py)."""
        return self.advances and _takes_argmax(size, query_len)

    def _follow_advance(self, batch: StepBatch, size: int, query_len: int,
                        staged: np.ndarray | None) -> None:
        """After a replay: the host's mirror of the staged array, advanced as the graph
        advanced the device's (None where the graph does not advance). staged: the
        array this step copied (None: it copied nothing, the mirror holds)."""
        if not self._advancing(size, query_len):
            self._held = None
            return
        if staged is not None:
            self._held = staged.copy()
        held = self._held
        advance_mirror(held[_POSITIONS, :size], _int32_row(held, _SEQ_LENS)[:size],
                       held[_FIRST_SLOTS:_FIRST_SLOTS + self.num_paged, :size],
                       batch.block_tables, self.block_size,
                       held[_RING_INDEX, :size] if self.tokens_to_host else None)
        self._ring_steps += 1

    def _stage_inputs(self, batch: StepBatch, size: int, query_len: int = 1,
                      adapters: bool = False, with_ids: bool = True) -> np.ndarray | None:
        """Write the step's inputs into a pinned mirror and copy it to the static
        buffers (without the input ids row unless with_ids), then the block tables.
        Returns the mirror, or None where nothing needed copying: the device holds
        these inputs already (the last replay advanced them: graph_advance.py)."""
        num, tokens, padded = batch.num_reqs, batch.num_tokens, size * query_len
        self._runs += 1
        host_t, tables_t = self._host_sets[self._runs % 2]
        host = host_t.numpy()
        cols = batch.block_tables[0].shape[1] if self.num_paged else 0
        tables_key = ((batch.tables_version, cols, batch.rows.tobytes())
                      if batch.tables_version >= 0 else None)
        tables_held = tables_key is not None and tables_key == self._tables_key
        held = self._held
        # Only a step whose tables the device holds may find every input there too; its
        # mirror then starts as the device's array, so that equal means nothing to copy.
        may_hold = (not with_ids and held is not None and self._advancing(size, query_len)
                    and (tables_held or not self.num_paged))
        if may_hold:
            host[1:] = held[1:]
        if with_ids:
            host[_INPUT_IDS, :tokens] = batch.input_ids
        host[_POSITIONS, :tokens] = batch.model_positions
        seq_lens = _int32_row(host, _SEQ_LENS)
        seq_lens[:num] = batch.seq_lens
        seq_lens[num:size] = 0
        state_slots = _int32_row(host, _STATE_SLOTS)
        if batch.state_slots is not None:
            state_slots[:num] = batch.state_slots
            host[_HAS_STATE].view(np.bool_)[:num] = batch.num_computed > 0
        state_slots[num:size] = -1
        if self._ordered(query_len):
            _int32_row(host, _DECODE_ORDER)[:size] = decode_order(seq_lens[:size])
        for g in range(self.num_paged):
            host[_FIRST_SLOTS + g, :tokens] = batch.slot_mappings[g]
            host[_FIRST_SLOTS + g, tokens:padded] = -1
        if adapters:
            host[self._lora_row, :tokens] = batch.token_lora_slots
            host[self._lora_row, tokens:padded] = -1
        if self.tokens_to_host and self._advancing(size, query_len):
            host[_RING_INDEX, :size] = self._ring_steps % RING_SLOTS
        if may_hold and np.array_equal(host[1:], held[1:]):
            return None
        first = 0 if with_ids else 1  # (the input ids are the first row)
        self._staged[first:].copy_(host_t[first:], non_blocking=True)
        if tables_held:
            return host  # (the device holds these tables already)
        for g in range(self.num_paged):
            tables_t.numpy()[g, :num * cols].reshape(num, cols)[:] = batch.block_tables[g]
            self.block_tables[g][:num, :cols].copy_(tables_t[g, :num * cols].view(num, cols),
                                                    non_blocking=True)
        self._tables_key = tables_key
        return host

    def _ordered(self, query_len: int) -> bool:
        """Whether graphs of query_len tokens per request hand decode attention the
        longest-first order (verifying graphs run the prefill kernel: no order)."""
        return self.longest_first and query_len == 1

    def _metadata(self, size: int, query_len: int = 1) -> AttentionMetadata | MambaMetadata | list:
        """Per cache group, metadata over the static buffers (padded to size)."""
        metadata, table = [], 0
        tokens = size * query_len
        for group in self.groups:
            if group.is_paged:
                metadata.append(AttentionMetadata(
                    num_reqs=size, num_tokens=tokens,
                    query_start_loc=self.query_start_locs[query_len][:size + 1],
                    seq_lens=self.seq_lens[:size], block_tables=self.block_tables[table][:size],
                    slot_mapping=self.slot_mappings[table][:tokens], max_query_len=query_len,
                    max_seq_len=self.block_tables[table].shape[1],
                    decode_order=self.decode_order[:size] if self._ordered(query_len)
                    else None))
                table += 1
            else:
                metadata.append(MambaMetadata(
                    num_reqs=size, num_tokens=size,
                    query_start_loc=self.query_start_locs[1][:size + 1],
                    state_indices=self.state_slots[:size],
                    has_initial_state=self.has_initial_state[:size], max_query_len=1))
        return metadata[0] if len(metadata) == 1 else metadata

    def _step(self, size: int, query_len: int = 1, adapters: bool = False) -> GraphOutputs:
        """What a graph computes: the hidden states and, with logits, the LM head's
        logits (outside the forward context, as an eager step computes them) and, for
        a decode graph of few requests, their argmax (see the module docstring)."""
        hidden = self._forward(size, query_len, adapters)
        if not self.with_logits:
            return GraphOutputs(hidden)
        logits = self.state.compute_logits(hidden)
        if not (self.with_greedy and _takes_argmax(size, query_len)):
            return GraphOutputs(hidden, logits)
        into = self.input_ids[:size] if self.feeds_inputs else None
        next_inputs = None
        if self._advancing(size, query_len):
            next_inputs = NextInputs(
                self.positions, self.seq_lens,
                self._staged[_FIRST_SLOTS:_FIRST_SLOTS + self.num_paged], self._tables,
                self.block_size, self._ring, self.ring_index if self.tokens_to_host else None)
        return GraphOutputs(hidden, logits, raw_argmax(logits, into, next_inputs))

    def _forward(self, size: int, query_len: int = 1, adapters: bool = False) -> torch.Tensor:
        tokens = size * query_len
        lora = self.lora.step(self.lora_slots[:tokens]) if adapters else None
        with forward_context(self._metadata(size, query_len), lora):
            return self.state.forward({"input_ids": self.input_ids[:tokens],
                                       "positions": self.positions[:tokens]})
