"""The continuous-batching scheduler: which requests run this step, and how many
of their tokens, under a token budget and the KV cache's free blocks.

Token-budget scheduling (as in vLLM v1): there is no "prefill step" or "decode
step"; each step a request is given num_tokens - num_computed_tokens tokens to
compute (1 for a decode, a prompt or a prompt chunk for a prefill), and prefills
and decodes share the step.

Call protocol: schedule() -> the runner executes the SchedulerOutput ->
update_from_output(that output, the runner's output). update_from_output must
follow every schedule(), also when nothing was scheduled (pass an empty
ModelRunnerOutput): it is also where requests the scheduler finished on its own
are reported.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence

from spindle.cache.spec import CacheGroup
from spindle.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from spindle.engine.kv_cache_manager import NO_HIT, KVCacheManager, PrefixCacheStats
from spindle.engine.stats import SpecDecodeStats
from spindle.engine.no_kv_cache_manager import NoKVCacheManager
from spindle.engine.request import Request, RequestStatus
from spindle.engine.request_queue import WaitingQueue, check_priority, priority_key
from spindle.outputs import RequestFailure
from spindle.step_messages import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                                   NewRequestData, SchedulerOutput)


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager.

    Invariants:
      * Every unfinished request is in exactly one of waiting (request_queue.py: FCFS,
        preempted requests back at its front; or by priority) or running (in admission
        order; by priority under that policy), and in self.requests; finished requests
        are in none of them and hold no blocks.
      * Priority policy: a lower Request.priority is admitted, and scheduled, first (then
        first come, first served); when blocks run out the lowest-priority running
        request is preempted first. A waiting request never preempts a running one.
      * Waiting requests hold no blocks and have num_computed_tokens == 0.
      * len(running) <= max_num_seqs; one step schedules at most
        max_num_batched_tokens tokens.
      * After schedule(), num_computed_tokens of each scheduled request already
        counts the tokens scheduled in that step.
      * Only running requests are preempted, most recently admitted first, and never
        one already scheduled in the current step; a step with a preemption admits
        no waiting request.
      * Progress: a request whose known tokens need more blocks than the whole
        cache has (or, without chunked prefill, more tokens than a step's budget)
        could never run; schedule() finishes it (FINISHED_LENGTH if it has output
        tokens, else FINISHED_ABORTED) and reports it from the next
        update_from_output(), rather than looping forever. Any other request can
        always run once it is the oldest running one, since it then preempts all
        the others if need be.
      * A pooling request is scheduled with its whole prompt in one step (never
        chunked, no prefix hits) and finishes in the update_from_output() of that
        step, with its embedding.
      * Encoder-decoder models: a request's encoder runs in the step that admits it
        (it computes the request's first decoder tokens); one step admits requests
        whose encoder positions (num_encoder_tokens) fit max_num_encoder_tokens
        together, the encoder's compute budget; the others wait, in order.
      * With 0 KV blocks (a model without a KV cache) a NoKVCacheManager stands in:
        only the token budget and max_num_seqs limit a step.
      * LongRoPE past its original length (long_rope_from): a request's tokens rotate
        by the short factors while it is no longer than that, by the long ones once it
        is; it is encoded again, all its tokens, when it grows past it (see
        _encode_again_long), and its drafts never cross it while short.
      * LoRA adapters: the running requests use at most max_loras adapters (the
        runner's slots); a waiting request whose adapter would be one more waits, and
        the queue behind it (first come, first served).
      * Speculative decoding: a step speculates when fewer than disable_by_batch_size
        requests run. A decode request is then scheduled with 1 + d tokens, its d
        drafts (the runner's proposals from its last step, padded to k where there is
        room) in SchedulerOutput.spec_token_ids; update_from_output takes the rejected ones
        back out of num_computed_tokens (their cache slots are overwritten later).
        With async scheduling, a speculating step adds no output placeholder: a
        request's next step waits for its tokens and drafts.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_kv_blocks: int, async_scheduling: bool = False,
                 cache_groups: Sequence[CacheGroup] | None = None,
                 num_state_slots: int = 0, enable_prefix_caching: bool | None = None,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        if num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks must be >= 0, got {num_kv_blocks}")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        if enable_prefix_caching is None:
            enable_prefix_caching = cache_config.enable_prefix_caching
        # No blocks and no state slots: the model has no cache (encoder-only).
        self.kv_cache_manager = (
            KVCacheManager(num_kv_blocks, cache_config.block_size, enable_prefix_caching,
                           cache_groups, num_state_slots,
                           max_step_tokens=scheduler_config.max_num_batched_tokens)
            if num_kv_blocks > 0 or num_state_slots > 0
            else NoKVCacheManager(cache_config.block_size))
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(scheduler_config.scheduling_policy)
        self._by_priority = self.waiting.by_priority
        self.running: list[Request] = []
        # Finished since the last schedule(): the runner must forget them.
        self._finished_req_ids: set[str] = set()
        # Requests the scheduler itself finished, reported by update_from_output().
        self._pending_outputs: list[EngineCoreOutput] = []
        # Preempted outside schedule() (preempt_all): reported by the next schedule().
        self._preempted_outside: set[str] = set()
        self._step_id = 0
        self.num_preemptions = 0  # since start, for stats and tests
        # Schedule step N+1 before step N's tokens are back (see engine_core.py).
        self.async_scheduling = async_scheduling
        self._step_cap = self.max_num_seqs  # requests one schedule() may pick
        self.speculative_config = speculative_config
        self.spec_decode_stats = SpecDecodeStats()
        self._speculating = False  # whether the step being scheduled speculates
        self.long_rope_from = scheduler_config.long_rope_from

    # ------------------------------------------------------------------ queries

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or a finish is still to be reported."""
        return self.get_num_unfinished_requests() > 0 or bool(self._pending_outputs)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv_cache_manager.prefix_cache_stats

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False (nothing done) while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    # -------------------------------------------------------- request lifecycle

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(f"request {request.request_id!r} must be new (WAITING, "
                             "nothing computed)")
        check_priority(request.priority, self.scheduler_config.scheduling_policy)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        """Finish requests as FINISHED_ABORTED; unknown or finished ids are ignored."""
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus,
                        stop_reason: int | str | None = None) -> None:
        """Finish requests from outside (abort, or a stop string the output processor
        found): free their blocks, drop them from the queues, and report them to the
        runner in the next SchedulerOutput.finished_req_ids. Unknown or already
        finished ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish status must be a FINISHED_* status, got {status!r}")
        ids = {req_ids} if isinstance(req_ids, str) else set(req_ids)
        finished = []
        for rid in ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            request.stop_reason = stop_reason
            self._finish(request, status)
            finished.append(request)
        if not finished:
            return
        gone = {r.request_id for r in finished}
        self.running = [r for r in self.running if r.request_id not in gone]
        self.waiting.remove(gone)

    # ---------------------------------------------------------------- schedule

    def schedule(self, max_num_reqs: int | None = None) -> SchedulerOutput:
        """Pick this step's requests and token counts (see the class docstring).
        max_num_reqs caps the requests of this step (pipeline parallelism splits the
        requests between the batches in flight)."""
        out = SchedulerOutput()
        self.kv_cache_manager.release_held_snapshots()
        self._step_cap = max_num_reqs if max_num_reqs is not None else self.max_num_seqs
        budget = self.max_num_batched_tokens
        spec = self.speculative_config
        self._speculating = out.speculate = (
            spec is not None and len(self.running) < spec.disable_by_batch_size)
        preemptions = self.num_preemptions
        budget = self._schedule_running(out, budget)
        if self.num_preemptions == preemptions:
            self._schedule_waiting(out, budget)

        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            if (self.async_scheduling and not out.speculate and request.num_computed_tokens
                    == request.num_tokens + request.num_output_placeholders):
                request.num_output_placeholders += 1  # its next token is being sampled
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.state_copies_before, out.state_copies_after = self.kv_cache_manager.take_state_copies()
        out.preempted_req_ids |= self._preempted_outside
        self._preempted_outside = set()
        out.finished_req_ids = self._finished_req_ids
        self._finished_req_ids = set()
        self._step_id += 1
        out.step_id = self._step_id
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule running requests in admission order, preempting from the back
        when blocks run out. Returns the budget left."""
        # (Runs for every running request every step: lookups are hoisted.)
        manager = self.kv_cache_manager
        running, scheduled, cached = self.running, out.num_scheduled_tokens, out.cached_requests
        plain_decode = not self._speculating
        long_rope = self.long_rope_from is not None
        index = 0
        while index < len(running) and budget > 0 and len(scheduled) < self._step_cap:
            request = running[index]
            num_tokens = len(request.all_token_ids)
            placeholders = request.num_output_placeholders
            num_new = num_tokens + placeholders - request.num_computed_tokens
            if placeholders and len(request.output_token_ids) + placeholders >= request.max_tokens:
                num_new = 0  # the in-flight token is its last: nothing more to compute
            if num_new <= 0:
                # Its last step's token is not back yet (only with outputs in flight).
                index += 1
                continue
            if long_rope and self._grows_past_short_rope(request, num_new):
                if placeholders:
                    index += 1  # (its re-encoding needs the token being sampled)
                    continue
                running.pop(index)
                self._encode_again_long(request, out)
                continue
            if self._can_never_fit(request, num_new):
                running.pop(index)
                self._finish_unfittable(request)
                continue
            if num_new == 1 and plain_decode and manager.holds_next_token(request):
                # The common decode step: nothing to cut, allocate or propose.
                if request.spec_token_ids:
                    request.spec_token_ids = []
                cached.append(CachedRequestData(
                    req_id=request.request_id, new_block_ids=manager.no_new_block_ids(),
                    num_computed_tokens=request.num_computed_tokens))
                scheduled[request.request_id] = 1
                budget -= 1
                index += 1
                continue
            if num_new > 1:  # (a decode step schedules one token: nothing to cut)
                if self._chunkable(request):
                    num_new = manager.align_chunk(request, request.num_computed_tokens,
                                                  min(num_new, budget))
                elif num_new > budget:
                    index += 1
                    continue
            drafts, lookahead = (), 0
            if self._speculating:
                drafts = self._drafts_for(request, num_new, budget)
                lookahead = len(drafts) + self._lookahead(request, num_new + len(drafts))
            elif request.spec_token_ids:
                request.spec_token_ids = []  # (they follow only its current tokens)
            new_blocks = self._allocate_or_preempt(request, num_new, out, lookahead)
            if new_blocks is None:
                break  # request preempted itself: nothing after it is left
            cached.append(CachedRequestData(
                req_id=request.request_id, new_block_ids=manager.new_block_ids(new_blocks),
                num_computed_tokens=request.num_computed_tokens))
            if drafts:
                out.spec_token_ids[request.request_id] = drafts
                num_new += len(drafts)
            scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1
        return budget

    def _drafts_for(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The drafts a decode step of request verifies (its proposals, cut to the
        step's budget, its max_tokens and max_model_len), in a speculating step. Its
        proposals are used up either way: they follow only its current tokens.

        Fewer proposals than num_speculative_tokens (none included) are padded with
        the last token, where there is room: steps whose requests all verify k drafts
        replay a CUDA graph. Verification stays exact whatever the drafts are; a
        padding draft that is accepted is a token the target drew."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        request.num_proposed = 0
        if num_new != 1 or request.num_output_placeholders:
            return []
        room = max(0, min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                          self.scheduler_config.max_model_len - request.num_tokens))
        if self.long_rope_from is not None and not request.rope_long:
            # (drafts past the original length would be verified with the short factors)
            room = min(room, max(0, self.long_rope_from - request.num_tokens))
        drafts = drafts[:room]
        request.num_proposed = len(drafts)
        k = self.speculative_config.num_speculative_tokens
        if room >= k:
            drafts = drafts + [drafts[-1] if drafts else request.all_token_ids[-1]] * (
                k - len(drafts))
        return drafts

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Slots past the step's tokens that proposing for request writes (a draft
        model's own tokens), in a speculating step where request samples."""
        spec = self.speculative_config
        end = request.num_computed_tokens + num_new
        if not spec.num_lookahead_tokens or end < request.num_tokens:
            return 0
        return max(0, min(spec.num_lookahead_tokens, self.scheduler_config.max_model_len - end))

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput,
                             num_lookahead: int = 0):
        """Allocate for a running request, preempting the most recently admitted
        running requests until it fits. None if request itself had to go."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=num_lookahead)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_req_ids.add(victim.request_id)
            if victim is request:
                return None

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in the queue's order (first come, first served, or by
        priority) while seats, budget, the encoder's budget, adapter slots and blocks
        last; never preempts."""
        encoder_budget = self.scheduler_config.max_num_encoder_tokens
        adapters: set[int] | None = None  # (the running adapters, made when first needed)
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(out.num_scheduled_tokens) < self._step_cap):
            request = self.waiting.peek()
            if self._grows_past_short_rope(request, request.num_tokens):
                request.encode_long()  # (it has nothing computed: nothing to encode again)
            if request.num_encoder_tokens > encoder_budget:
                break  # its encoder waits for the next step's budget
            if request.lora_int_id is not None:
                if adapters is None:
                    adapters = {r.lora_int_id for r in self.running
                                if r.lora_int_id is not None}
                if request.lora_int_id not in adapters \
                        and len(adapters) >= self.scheduler_config.max_loras:
                    break  # its adapter waits for a slot: one of the running ones to finish
            hits, num_hit_tokens = NO_HIT, 0
            if (request.num_computed_tokens == 0 and not request.is_pooling
                    and request.prompt_logprobs is None):  # (those compute every token)
                hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - request.num_computed_tokens - num_hit_tokens
            if self._can_never_fit(request, num_new):
                self.waiting.pop()
                self._finish_unfittable(request)
                continue
            if self._chunkable(request):
                num_new = self.kv_cache_manager.align_chunk(
                    request, request.num_computed_tokens + num_hit_tokens, min(num_new, budget))
            elif num_new > budget:
                break
            lookahead = (self._lookahead(request, num_hit_tokens + num_new)
                         if self._speculating else 0)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, hits, lookahead)
            if new_blocks is None:
                break
            self.waiting.pop()
            self._admit(request, num_hit_tokens)
            if request.lora_int_id is not None:
                adapters.add(request.lora_int_id)
            out.new_requests.append(NewRequestData(
                req_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.runner_sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
                pooling_params=request.pooling_params,
                prompt_embeds=request.prompt_embeds,
                encoder_inputs=request.encoder_inputs,
                rope_long=request.rope_long, lora_request=request.lora_request))
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            encoder_budget -= request.num_encoder_tokens

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens += num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        if self._by_priority:  # (running in priority order: the back is preempted first)
            bisect.insort(self.running, request, key=priority_key)
        else:
            self.running.append(request)

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and put it at the front of the waiting
        queue; it recomputes (with prefix hits) when readmitted. Caller removed it
        from self.running."""
        self._requeue(request)
        request.num_output_placeholders = 0  # an in-flight token is dropped; recomputed later
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, request: Request) -> None:
        """Free a running request's blocks and put it back at the front of the waiting
        queue (in its place, by priority) with nothing computed. Caller removed it from
        self.running."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self.waiting.add_front(request)

    def _grows_past_short_rope(self, request: Request, num_new: int) -> bool:
        """Whether computing num_new more tokens of request makes it longer than
        LongRoPE's original length while its tokens rotate by the short factors."""
        return (self.long_rope_from is not None and not request.rope_long
                and request.num_computed_tokens + num_new > self.long_rope_from)

    def _encode_again_long(self, request: Request, out: SchedulerOutput) -> None:
        """request is about to grow past LongRoPE's original length. transformers then
        encodes the whole sequence again with the long factors (Phi-3's generate drops
        its cache once), and so does the engine: the request gives its blocks back (the
        prefix cache keeps them, under its short hashes), returns to the front of the
        waiting queue with nothing computed, and is admitted again as a resumed request,
        in this step if there is room. Caller removed it from self.running. Unlike a
        preemption, this lets other waiting requests in."""
        self._requeue(request)  # (its short blocks cached under their hashes first)
        request.encode_long()
        out.preempted_req_ids.add(request.request_id)

    def preempt_all(self) -> int:
        """Preempt every running request (before the KV cache is discarded, e.g. by
        sleep): each recomputes its tokens when it runs again, so nothing is lost.
        Returns how many were preempted."""
        victims, self.running = self.running, []
        for request in reversed(victims):  # the oldest ends up first in the queue
            self._preempt(request)
            self._preempted_outside.add(request.request_id)
        return len(victims)

    def _can_never_fit(self, request: Request, num_new: int) -> bool:
        # (Runs for every running request every step: the cheap test first.)
        if not self.kv_cache_manager.can_ever_fit(len(request.all_token_ids)):
            return True
        return num_new > self.max_num_batched_tokens and not self._chunkable(request)

    def _chunkable(self, request: Request) -> bool:
        """Whether request's prompt may be split across steps: never for a pooling
        request, whose pooler needs the whole prompt in one step."""
        return self.enable_chunked_prefill and not request.is_pooling

    def _finish_unfittable(self, request: Request) -> None:
        """Finish a request that could never be scheduled (caller removed it from its
        queue); the client learns of it from the next update_from_output()."""
        status = (RequestStatus.FINISHED_LENGTH if request.num_output_tokens > 0
                  else RequestStatus.FINISHED_ABORTED)
        self._finish(request, status)
        self._pending_outputs.append(EngineCoreOutput(
            req_id=request.request_id, new_token_ids=[],
            finish_reason=request.get_finish_reason()))

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished, free its blocks, forget it; the caller removes it from
        waiting/running."""
        request.status = status
        self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ update

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append the sampled tokens, apply stop conditions, free finished requests.

        Per token, in order: a stop token (sampling_params.all_stop_token_ids) once
        num_output_tokens >= min_tokens -> FINISHED_STOPPED (stop_reason: the token if
        the user listed it in stop_token_ids, None for EOS); else num_output_tokens >=
        max_tokens -> FINISHED_LENGTH. Tokens after a finishing token are dropped.
        Returns one EngineCoreOutput per request that got tokens or finished.
        Requests not scheduled in scheduler_output, or finished/aborted since, are
        ignored.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        scheduled = scheduler_output.num_scheduled_tokens
        if runner_output.failed_requests:
            outputs.extend(self._finish_failed(runner_output.failed_requests))
        if runner_output.pooled_outputs:
            outputs.extend(self._finish_pooled(scheduled, runner_output))
        logprobs = runner_output.logprobs
        proposals = runner_output.spec_token_ids
        if runner_output.prompt_logprobs:
            self._store_prompt_logprobs(runner_output.prompt_logprobs)
        any_finished = False
        for i, rid in enumerate(runner_output.req_ids):
            token_ids = runner_output.sampled_token_ids[i]
            request = self.requests.get(rid)
            if token_ids and request is not None and request.num_output_placeholders:
                request.num_output_placeholders -= 1
            if (not token_ids or request is None or rid not in scheduled
                    or request.status != RequestStatus.RUNNING):
                continue
            drafts = scheduler_output.spec_token_ids.get(rid)
            if drafts:
                self._take_back_rejected(request, len(drafts), len(token_ids))
            new_tokens = self._append_until_stop(request, token_ids)
            finished = request.status != RequestStatus.RUNNING  # (it was running above)
            outputs.append(EngineCoreOutput(
                req_id=rid, new_token_ids=new_tokens,
                num_cached_tokens=request.num_cached_tokens,
                new_logprobs=logprobs[i][:len(new_tokens)] if i < len(logprobs) else [],
                finish_reason=request.get_finish_reason() if finished else None,
                stop_reason=request.stop_reason,
                prompt_logprobs=(self._take_prompt_logprobs(request)
                                 if request.prompt_logprobs is not None else None)))
            if finished:
                self._finish(request, request.status)
                any_finished = True
            elif proposals and not request.num_output_placeholders:
                # (with a later step in flight, the proposal follows stale tokens)
                request.spec_token_ids = proposals[i]
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def _store_prompt_logprobs(self, chunks: dict) -> None:
        """Keep the prompt logprobs a step computed (by position: a chunk computed again
        after a preemption overwrites itself) until the request's first token."""
        for rid, (start, entries) in chunks.items():
            request = self.requests.get(rid)
            if request is None or request.prompt_logprobs is None:
                continue
            request.prompt_logprobs[start:start + len(entries)] = entries

    def _take_prompt_logprobs(self, request: Request) -> list | None:
        """A request's prompt logprobs, once: with its first token. From then on the
        request is one without them (a recompute after a preemption neither scores its
        prompt again nor is kept from prefix-cache hits)."""
        entries = request.prompt_logprobs
        if any(entry is None for entry in entries):
            raise RuntimeError(f"request {request.request_id!r} sampled before every prompt "
                               "token's logprob was computed")
        request.prompt_logprobs_delivered()
        return entries

    def _take_back_rejected(self, request: Request, num_drafts: int, num_tokens: int) -> None:
        """A verified step gave num_tokens tokens: the accepted drafts and one more.
        The rejected drafts were not computed after all."""
        num_accepted = num_tokens - 1
        if not 0 <= num_accepted <= num_drafts:
            raise RuntimeError(f"request {request.request_id!r}: {num_tokens} tokens from a "
                               f"step verifying {num_drafts} drafts")
        request.num_computed_tokens -= num_drafts - num_accepted
        proposed = request.num_proposed  # (the stats leave padding drafts out)
        if proposed:
            self.spec_decode_stats.observe(proposed, min(num_accepted, proposed))

    def _finish_failed(self, failures: dict[str, RequestFailure]) -> list[EngineCoreOutput]:
        """Requests the runner could not prepare fail alone (FINISHED_ERROR)."""
        failed = [rid for rid in failures if rid in self.requests]
        self.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(req_id=rid, new_token_ids=[], finish_reason="error",
                                 error=failures[rid]) for rid in failed]

    def _finish_pooled(self, scheduled: dict[str, int],
                       runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """A pooling request is done after its one step: report its embedding and
        finish it (FINISHED_STOPPED)."""
        outputs = []
        for rid, pooled in zip(runner_output.req_ids, runner_output.pooled_outputs):
            request = self.requests.get(rid)
            if (pooled is None or request is None or rid not in scheduled
                    or request.status != RequestStatus.RUNNING):
                continue
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineCoreOutput(req_id=rid, new_token_ids=[], finish_reason="stop",
                                            pooled_output=pooled))
        if outputs:
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append token_ids until one finishes the request (its status is then set);
        returns the tokens appended."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        appended = token_ids
        for i, token in enumerate(token_ids, start=1):
            if token in params.all_stop_token_ids and num_output + i >= params.min_tokens:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token if token in params.stop_token_ids else None
            elif num_output + i >= request.max_tokens:
                request.status = RequestStatus.FINISHED_LENGTH
            else:
                continue
            appended = token_ids[:i]
            break
        request.append_output_token_ids(appended)
        return list(appended)
