"""The runner's persistent view of its requests, and the per-step batch built from it.

Each request the runner holds owns one row of a few host arrays (token ids, block
table, sampling values) for as long as it lives, so preparing a step is a handful
of vectorised numpy gathers rather than a Python loop per token. Nothing here knows
the model architecture.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from spindle.runner.sample.metadata import SamplingMetadata
from spindle.runner.staging import HostToDevice
from spindle.sampling_params import SamplingParams
from spindle.step_messages import NewRequestData
from spindle.structured.matcher import GrammarMatcher, TokenAutomaton


# Token automata an InputBatch keeps (structured outputs' distinct schemas and regexes).
MAX_AUTOMATA = 32


@dataclass
class CachedRequestState:
    """What the runner remembers about one request between steps."""

    req_id: str
    row: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[list[int]]  # per cache group (a state group: [slot])
    num_computed_tokens: int
    num_tokens: int  # known tokens: prompt + outputs so far
    # Tokens being sampled by launched steps whose results have not been read back:
    # their ids are fed to the next step on the device (runner/async_output.py).
    num_inflight: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # owned by the model state
    pooling_params: Any = None  # set for a pooling (embedding) request
    grammar: GrammarMatcher | None = None  # a structured-outputs request's place
    lora_int_id: int | None = None  # its LoRA adapter's id (None: the base model)


@dataclass
class StepBatch:
    """One step's flattened inputs. Host (numpy) arrays plus their device copies."""

    req_ids: list[str]
    rows: np.ndarray  # [B] persistent row of each scheduled request
    num_scheduled: np.ndarray  # [B]
    num_computed: np.ndarray  # [B] before this step
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B] context length after this step
    positions: np.ndarray  # [T]
    input_ids: np.ndarray  # [T]
    slot_mappings: list[np.ndarray]  # per paged cache group: [T]
    block_tables: list[np.ndarray]  # per paged cache group: [B, max_blocks]
    state_slots: np.ndarray | None  # [B] state slot of each request (models with state groups)
    token_req_index: np.ndarray  # [T] which request each token belongs to
    sampling_mask: np.ndarray  # [B] bool: request reaches its last known token and samples
    # [S] token index whose hidden state is sampled: one per sampling request, and for
    # a request verifying d drafts d + 1 (its last known token and each draft).
    logits_indices: np.ndarray
    inflight_dst: np.ndarray = None  # token indices whose input id is still being sampled
    requests: list[CachedRequestState] = field(default_factory=list)  # [B] in req_ids order
    # Speculative decoding: drafts each request verifies ([B]; None when none does),
    # and the draft token ids by request id.
    num_drafts: np.ndarray | None = None
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # [T] the rotary table rows the model reads, where they are not the positions: a
    # request encoded with LongRoPE's long factors reads the long rows (its position
    # plus RotaryEmbedding.long_rows). None: the positions themselves.
    rope_positions: np.ndarray | None = None
    # [T] each token's LoRA adapter slot (-1: none), where the engine serves adapters.
    token_lora_slots: np.ndarray | None = None
    # InputBatch.tables_version when the batch was prepared (-1: not known): two batches
    # of the same version, rows and columns have the same block tables.
    tables_version: int = -1

    @property
    def model_positions(self) -> np.ndarray:
        """[T] what the model's `positions` input is: each token's rotary table row."""
        return self.positions if self.rope_positions is None else self.rope_positions

    @property
    def sample_rows(self) -> np.ndarray:
        """[B] rows of the sampler's output each request has: 0, 1, or 1 + its drafts."""
        rows = self.sampling_mask.astype(np.int64)
        return rows if self.num_drafts is None else rows + self.num_drafts

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def sampling_req_ids(self) -> list[str]:
        if self.sampling_mask.all():  # (a decode step: every request samples)
            return self.req_ids
        return [r for r, s in zip(self.req_ids, self.sampling_mask.tolist()) if s]


def prompt_logprobs_of(state: CachedRequestState) -> int | None:
    """The prompt logprobs a request asked for (None: none, or a pooling request)."""
    if state.pooling_params is not None:
        return None
    return getattr(state.sampling_params, "prompt_logprobs", None)


class InputBatch:
    """Rows of per-request host state, and step preparation over them."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 vocab_size: int, device: torch.device,
                 group_is_paged: Sequence[bool] = (True,),
                 token_vocab: Callable[[], Any] | None = None) -> None:
        """token_vocab: loads the TokenVocab structured outputs walk (on their first
        request; None: a runner that does not sample, which follows no automaton)."""
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        # Counts writes to the block tables (a step's graph skips copying unchanged ones).
        self.tables_version = 0
        self.set_cache_groups(group_is_paged)
        self.requests: dict[str, CachedRequestState] = {}
        self._metadata_key: tuple | None = None
        self._metadata: SamplingMetadata | None = None
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Held requests that asked for prompt logprobs, and those whose sampling reads
        # their outputs (penalties, min_tokens): most steps have none to look for.
        self.num_prompt_logprobs = 0
        self.num_output_readers = 0
        self._token_vocab = token_vocab
        # Structured outputs' token automata, by what was asked (the last few kept).
        self._automata: OrderedDict[str, TokenAutomaton] = OrderedDict()
        # LongRoPE served past its original length: where the long rows of the model's
        # rotary tables start (set by the runner), and per row the offset its tokens'
        # positions take (0, or long_rope_rows for a request encoded long).
        self.long_rope_rows: int | None = None
        self.rope_row_offset = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_rope_long = 0
        # LoRA adapters served (set by the runner): each row's adapter slot (-1: none).
        self.serves_lora = False
        self.lora_slot = np.full(max_num_reqs, -1, dtype=np.int64)

    def set_cache_groups(self, group_is_paged: Sequence[bool]) -> None:
        """One block table per paged cache group; one state slot per row for models
        with state groups (every state group shares the slot id)."""
        self.group_is_paged = list(group_is_paged)
        self.block_tables = [np.zeros((self.max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
                             for paged in self.group_is_paged if paged]
        self.tables_version += 1
        self.has_state = not all(self.group_is_paged)
        self.state_slot = np.full(self.max_num_reqs, -1, dtype=np.int32)

    # ---- request bookkeeping -------------------------------------------------
    def add_request(self, new: NewRequestData, lora_slot: int = -1) -> CachedRequestState:
        """Give a new request a row (its LoRA adapter in lora_slot, -1: none). Everything
        that can fail for this request alone (its length, its generator) happens before
        the row is taken, so a failure leaves the batch as it was."""
        if new.req_id in self.requests:
            raise RuntimeError(f"request {new.req_id!r} is already in the runner's batch")
        if not self._free_rows:
            raise RuntimeError(f"the runner holds {self.max_num_reqs} requests already (max_num_seqs)")
        if len(new.token_ids) > self.max_model_len:
            raise ValueError(f"request {new.req_id!r} has {len(new.token_ids)} tokens, "
                             f"more than max_model_len ({self.max_model_len})")
        if new.rope_long and self.long_rope_rows is None:
            raise RuntimeError(f"request {new.req_id!r} is encoded with LongRoPE's long "
                               "factors, which the model was not served with")
        generator = self._generator_for(new.sampling_params)
        row = self._free_rows.pop()
        state = CachedRequestState(
            req_id=new.req_id, row=row, num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=new.sampling_params, generator=generator,
            block_ids=[[] for _ in self.group_is_paged],
            num_computed_tokens=new.num_computed_tokens,
            num_tokens=len(new.token_ids),
            output_token_ids=list(new.token_ids[new.num_prompt_tokens:]),
            pooling_params=new.pooling_params,
            grammar=self._grammar_for(new.req_id, new.sampling_params),
            lora_int_id=None if new.lora_request is None else new.lora_request.lora_int_id)
        self.lora_slot[row] = lora_slot
        if state.grammar is not None:  # (a preempted request resumes where it was)
            for token in state.output_token_ids:
                state.grammar.advance(token)
        if new.rope_long:
            self.rope_row_offset[row] = self.long_rope_rows
            self.num_rope_long += 1
        self.requests[new.req_id] = state
        self.num_prompt_logprobs += prompt_logprobs_of(state) is not None
        self.num_output_readers += _reads_outputs(state)
        try:
            self.token_ids[row, :len(new.token_ids)] = new.token_ids
            self.append_blocks(new.req_id, new.block_ids)
        except Exception:
            self.remove_request(new.req_id)
            raise
        return state

    def _grammar_for(self, req_id: str, params: SamplingParams | None
                     ) -> GrammarMatcher | None:
        """A matcher for a structured-outputs request (its automaton compiled by the
        engine, lifted to tokens here once per distinct request)."""
        dfa = getattr(params, "_grammar", None)
        if dfa is None or self._token_vocab is None:
            return None
        key = params.structured_outputs.key
        automaton = self._automata.get(key)
        if automaton is None:
            automaton = self._automata[key] = TokenAutomaton(dfa, self._token_vocab())
            if len(self._automata) > MAX_AUTOMATA:
                self._automata.popitem(last=False)
        self._automata.move_to_end(key)
        return GrammarMatcher(automaton, params.all_stop_token_ids, req_id)

    def _generator_for(self, params: SamplingParams) -> torch.Generator | None:
        """The request's own random stream when it has a seed (greedy ones draw nothing)."""
        if params.seed is None or params.is_greedy:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed)
        return generator

    def remove_request(self, req_id: str) -> CachedRequestState | None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
            if self.rope_row_offset[state.row]:
                self.rope_row_offset[state.row] = 0
                self.num_rope_long -= 1
            self.num_prompt_logprobs -= prompt_logprobs_of(state) is not None
            self.num_output_readers -= _reads_outputs(state)
        return state

    def append_blocks(self, req_id: str, new_block_ids: Sequence[Sequence[int]]) -> None:
        """Append new block ids per cache group (a state group's list is its slot)."""
        if not any(new_block_ids):
            return  # most decode steps (and a model without a cache, which gets no lists)
        if len(new_block_ids) != len(self.group_is_paged):
            raise RuntimeError(f"request {req_id!r}: block ids for {len(new_block_ids)} cache "
                               f"groups, the model has {len(self.group_is_paged)}")
        state = self.requests[req_id]
        table = 0
        for group, (ids, paged) in enumerate(zip(new_block_ids, self.group_is_paged)):
            if paged:
                self._write_block_ids(state, self.block_tables[table],
                                      len(state.block_ids[group]), ids)
                table += 1
            elif ids:
                self.state_slot[state.row] = ids[0]
            state.block_ids[group].extend(ids)

    def append_token(self, state: CachedRequestState, token_id: int) -> None:
        state.num_inflight = max(0, state.num_inflight - 1)
        if state.num_tokens >= self.max_model_len:
            return  # the scheduler finishes the request at max_model_len; nothing to store
        self.token_ids[state.row, state.num_tokens] = token_id
        state.num_tokens += 1
        state.output_token_ids.append(token_id)
        if state.grammar is not None:
            state.grammar.advance(token_id)

    def _write_block_ids(self, state: CachedRequestState, table: np.ndarray, start: int,
                         block_ids: Sequence[int]) -> None:
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise RuntimeError(f"request {state.req_id!r} needs {end} KV blocks, more than "
                               f"max_model_len allows ({self.max_blocks_per_req})")
        table[state.row, start:end] = block_ids
        self.tables_version += 1

    # ---- step preparation ----------------------------------------------------
    def prepare(self, num_scheduled_tokens: dict[str, int],
                draft_token_ids: dict[str, list[int]] | None = None) -> StepBatch:
        """The step's batch: the scheduled requests (in this order) and their token
        counts, which include the drafts a request verifies (draft_token_ids)."""
        req_ids = list(num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        num_drafts = self._place_drafts(req_ids, draft_token_ids) if draft_token_ids else None
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        num_scheduled = np.fromiter(num_scheduled_tokens.values(), dtype=np.int64,
                                    count=len(states))
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64,
                                   count=len(states))
        num_host = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        num_known = num_host + np.fromiter((s.num_inflight for s in states), dtype=np.int64,
                                           count=len(states))
        if num_drafts is not None:
            num_known = num_known + num_drafts

        num = len(states)
        # A decode step (one token per request, no drafts; most steps) maps tokens to
        # requests one to one: the general gathers below reduce to the identity.
        one_each = num_drafts is None and sum(num_scheduled_tokens.values()) == num
        if one_each:
            query_start_loc = np.arange(num + 1, dtype=np.int64)
            token_req_index = query_start_loc[:-1]
            positions = num_computed
            token_rows = rows
            token_num_host = num_host
        else:
            query_start_loc = np.zeros(num + 1, dtype=np.int64)
            np.cumsum(num_scheduled, out=query_start_loc[1:])
            token_req_index = np.repeat(np.arange(num), num_scheduled)
            offsets = np.arange(int(query_start_loc[-1])) - query_start_loc[token_req_index]
            positions = num_computed[token_req_index] + offsets
            token_rows = rows[token_req_index]
            token_num_host = num_host[token_req_index]
            if num_drafts is not None:
                # (A request verifying drafts has none in flight: they follow its
                # known tokens.)
                token_num_host = token_num_host + num_drafts[token_req_index]
        seq_lens = num_computed + num_scheduled
        if np.any(seq_lens > num_known):
            bad = req_ids[int(np.argmax(seq_lens > num_known))]
            raise RuntimeError(f"request {bad!r} was scheduled past its known tokens")
        block_index = positions // self.block_size
        offsets_in_block = positions % self.block_size
        slot_mappings = [table[token_rows, block_index].astype(np.int64) * self.block_size
                         + offsets_in_block for table in self.block_tables]
        # Input positions at or past the host-known tokens hold tokens still in flight.
        inflight_dst = np.flatnonzero(positions >= token_num_host)
        num_block_cols = max(1, int(-(-seq_lens.max() // self.block_size))) if num else 1
        sampling_mask = seq_lens == num_known
        logits_indices = query_start_loc[1:][sampling_mask] - 1
        if num_drafts is not None:
            logits_indices = _draft_logits_indices(query_start_loc[1:][sampling_mask],
                                                   num_drafts[sampling_mask])
        return StepBatch(
            req_ids=req_ids, rows=rows, num_scheduled=num_scheduled, num_computed=num_computed,
            query_start_loc=query_start_loc, seq_lens=seq_lens, positions=positions,
            input_ids=self.token_ids[token_rows, positions], slot_mappings=slot_mappings,
            block_tables=[table[rows, :num_block_cols] for table in self.block_tables],
            tables_version=self.tables_version,
            state_slots=self.state_slot[rows] if self.has_state else None,
            token_req_index=token_req_index,
            sampling_mask=sampling_mask, logits_indices=logits_indices,
            inflight_dst=inflight_dst, requests=states, num_drafts=num_drafts,
            draft_token_ids=draft_token_ids or {},
            rope_positions=(positions + self.rope_row_offset[token_rows]
                            if self.num_rope_long else None),
            token_lora_slots=self.lora_slot[token_rows] if self.serves_lora else None)

    def _place_drafts(self, req_ids: list[str], draft_token_ids: dict[str, list[int]]
                      ) -> np.ndarray:
        """Write each request's drafts after its known tokens (inputs of this step;
        the accepted ones are overwritten by themselves, the rest by later tokens).
        Returns the drafts per request, in req_ids order."""
        counts = np.zeros(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            drafts = draft_token_ids.get(req_id)
            if not drafts:
                continue
            state = self.requests[req_id]
            if state.num_inflight:
                raise RuntimeError(f"request {req_id!r} verifies drafts while its last token "
                                   "is still being sampled")
            end = state.num_tokens + len(drafts)
            if end > self.max_model_len:
                raise RuntimeError(f"request {req_id!r}: {len(drafts)} drafts run past "
                                   f"max_model_len ({self.max_model_len})")
            self.token_ids[state.row, state.num_tokens:end] = drafts
            counts[i] = len(drafts)
        return counts

    def decode_batch(self, states: list[CachedRequestState], positions: np.ndarray) -> StepBatch:
        """A batch of one token per request at the given positions, over the requests'
        blocks (a draft model's proposing steps; input ids are the caller's)."""
        num = len(states)
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num)
        ones = np.ones(num, dtype=np.int64)
        seq_lens = positions + 1
        cols = max(1, int(-(-seq_lens.max() // self.block_size))) if num else 1
        slot_mappings = [table[rows, positions // self.block_size].astype(np.int64)
                         * self.block_size + positions % self.block_size
                         for table in self.block_tables]
        return StepBatch(
            req_ids=[s.req_id for s in states], rows=rows, num_scheduled=ones,
            num_computed=positions, query_start_loc=np.arange(num + 1, dtype=np.int64),
            seq_lens=seq_lens, positions=positions, input_ids=np.zeros(num, dtype=np.int32),
            slot_mappings=slot_mappings,
            block_tables=[table[rows, :cols] for table in self.block_tables], state_slots=None,
            token_req_index=np.arange(num), sampling_mask=ones.astype(bool),
            logits_indices=np.arange(num), inflight_dst=np.zeros(0, dtype=np.int64),
            requests=list(states))

    def advance(self, batch: StepBatch) -> None:
        """After launching a step: its tokens are computed, and the tokens it samples
        are in flight until append_token() records them."""
        # (Python ints: iterating the arrays would make a numpy scalar per request.)
        for state, n, samples in zip(batch.requests, batch.num_scheduled.tolist(),
                                     batch.sampling_mask.tolist()):
            state.num_computed_tokens += n
            state.num_inflight += samples

    def needs_outputs(self, req_ids: list[str]) -> bool:
        """Whether sampling these requests reads their outputs so far (penalties,
        min_tokens still blocking stop tokens, structured outputs)."""
        if not self.num_output_readers:
            return False
        for r in req_ids:
            s = self.requests[r]
            p = s.sampling_params
            if _has_penalties(p) or (p.min_tokens and len(s.output_token_ids) < p.min_tokens) \
                    or s.grammar is not None:
                return True
        return False

    def verify_metadata(self, batch: StepBatch, h2d: HostToDevice) -> SamplingMetadata:
        """Sampling parameters for a step verifying drafts: one row per sampled
        position. The row of a request's j-th draft position sees its drafts before j
        as outputs (penalties and min_tokens), as decoding them one by one would."""
        states, drafts_before = [], []
        for state, samples, num_drafts in zip(batch.requests, batch.sampling_mask.tolist(),
                                              batch.num_drafts.tolist()):
            if not samples:
                continue
            drafts = batch.draft_token_ids.get(state.req_id, [])
            for j in range(num_drafts + 1):
                states.append(state)
                drafts_before.append(drafts[:j])
        return self._build_sampling_metadata(states, h2d, drafts_before)

    def sampling_metadata(self, req_ids: list[str], h2d: HostToDevice) -> SamplingMetadata:
        """Batched sampling parameters for the requests that sample, in this order.

        Decode steps usually sample the same requests as the step before: then the
        metadata is reused unless a row's values change from step to step
        (penalties read the outputs so far; min_tokens blocking ends).
        """
        key = tuple(req_ids)
        if key == self._metadata_key and self._metadata is not None:
            return self._metadata
        states = [self.requests[r] for r in req_ids]
        meta = self._build_sampling_metadata(states, h2d)
        dynamic = (meta.prompt_token_ids is not None or bool(meta.min_tokens_blocked)
                   or any(s.grammar is not None for s in states))
        self._metadata_key, self._metadata = (None, None) if dynamic else (key, meta)
        return meta

    def _build_sampling_metadata(self, states: list[CachedRequestState], h2d: HostToDevice,
                                 drafts_before: list[list[int]] | None = None
                                 ) -> SamplingMetadata:
        """One row per entry of states (a request may have several rows, its row i
        then following drafts_before[i], tokens not yet in its outputs)."""
        outputs = [s.output_token_ids for s in states]
        if drafts_before is not None:
            outputs = [out + drafts for out, drafts in zip(outputs, drafts_before)]
        params = [s.sampling_params for s in states]
        greedy = [p.is_greedy for p in params]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        meta = SamplingMetadata(
            temperature=h2d.put([0.0 if p.is_greedy else p.temperature for p in params],
                                torch.float32),
            all_greedy=all(greedy), all_random=not any(greedy),
            top_k=_optional_tensor([p.top_k for p in params], 0, torch.int64, h2d),
            top_p=_optional_tensor([p.top_p for p in params], 1.0, torch.float32, h2d),
            min_p=_optional_tensor([p.min_p for p in params], 0.0, torch.float32, h2d),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            max_num_logprobs=max(logprobs) if logprobs else None,
            min_tokens_blocked={
                i: s.sampling_params.all_stop_token_ids for i, (s, out) in
                enumerate(zip(states, outputs))
                if len(out) < s.sampling_params.min_tokens
                and s.sampling_params.all_stop_token_ids},
            allowed_token_ids=_allowed_token_ids(states, drafts_before),
            logit_bias=_logit_bias([p.logit_bias for p in params], h2d))
        if any(_has_penalties(p) for p in params):
            self._add_penalties(meta, states, outputs, h2d)
        return meta

    def _add_penalties(self, meta: SamplingMetadata, states: list[CachedRequestState],
                       outputs: list[list[int]], h2d: HostToDevice) -> None:
        longest = max(s.num_prompt_tokens for s in states)
        prompts = np.full((len(states), longest), self.vocab_size, dtype=np.int64)
        for i, s in enumerate(states):
            prompts[i, :s.num_prompt_tokens] = self.token_ids[s.row, :s.num_prompt_tokens]
        meta.prompt_token_ids = h2d.put(prompts, torch.int64)
        meta.output_token_ids = outputs
        params = [s.sampling_params for s in states]
        meta.frequency_penalties = h2d.put([p.frequency_penalty for p in params], torch.float32)
        meta.presence_penalties = h2d.put([p.presence_penalty for p in params], torch.float32)
        meta.repetition_penalties = h2d.put([p.repetition_penalty for p in params], torch.float32)


def _allowed_token_ids(states: list[CachedRequestState],
                       drafts_before: list[list[int]] | None) -> dict[int, Any]:
    """SamplingMetadata.allowed_token_ids: a request's own list, or where its structured
    output stands (after the drafts before the row, when verifying)."""
    allowed = {}
    for i, s in enumerate(states):
        if s.grammar is not None:
            state = s.grammar.state_after(drafts_before[i]) if drafts_before else None
            allowed[i] = s.grammar.allowed_ids(state)
        elif s.sampling_params.allowed_token_ids is not None:
            allowed[i] = s.sampling_params.allowed_token_ids
    return allowed


def _draft_logits_indices(ends: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """The last 1 + num_drafts[i] token indices before each ends[i], in order."""
    counts = num_drafts + 1
    starts = np.repeat(ends - counts, counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return starts + offsets


def _reads_outputs(state: CachedRequestState) -> bool:
    """Whether the request's sampling may read its outputs: penalties, or min_tokens
    (a pooling request samples nothing)."""
    p = state.sampling_params
    return state.pooling_params is None and p is not None and (
        _has_penalties(p) or bool(p.min_tokens) or state.grammar is not None)


def _logit_bias(biases: list[dict[int, float] | None], h2d: HostToDevice) -> tuple | None:
    """SamplingMetadata.logit_bias from each row's SamplingParams.logit_bias."""
    entries = [(row, token, bias) for row, row_bias in enumerate(biases) if row_bias
               for token, bias in row_bias.items()]
    if not entries:
        return None
    rows, tokens, values = zip(*entries)
    return (h2d.put(list(rows), torch.int64), h2d.put(list(tokens), torch.int64),
            h2d.put(list(values), torch.float32))


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _optional_tensor(values: list, neutral: Any, dtype: torch.dtype,
                     h2d: HostToDevice) -> torch.Tensor | None:
    if all(v == neutral for v in values):
        return None
    return h2d.put(values, dtype)
