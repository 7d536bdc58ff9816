"""BatchQueue: up to max_concurrent_batches steps in flight, for pipeline parallelism.

With P pipeline stages one batch keeps one stage busy at a time. The queue launches
a new batch (schedule -> execute_model without waiting) while earlier ones are still
in the pipeline, and applies their outputs in launch order. The scheduler keeps
batches disjoint by itself: a request whose sampled token is not back yet has
nothing to compute (num_computed_tokens == num_tokens), so it is not scheduled again
until its batch is collected. Stages other than the last never see sampled tokens:
each batch carries the output tokens its requests feed in (attach_step_tokens).
Each batch is sent with the executor's step timeout: a stage that stops answering
fails the executor instead of blocking the engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from spindle.engine.scheduler import Scheduler
from spindle.executor.abstract import Executor, LaunchedStep
from spindle.step_messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput


@dataclass
class _Launched:
    sched: SchedulerOutput
    step: LaunchedStep
    preemptions: dict[str, int]  # req_id -> its preemption count at launch


class BatchQueue:
    def __init__(self, scheduler: Scheduler, executor: Executor, max_batches: int) -> None:
        if max_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {max_batches}")
        self.scheduler = scheduler
        self.executor = executor
        self.max_batches = max_batches
        self.inflight: deque[_Launched] = deque()
        self.peak_in_flight = 0  # most batches in flight at once so far (stats, tests)

    @property
    def busy(self) -> bool:
        return bool(self.inflight)

    def step(self, may_schedule: bool) -> list[EngineCoreOutput]:
        """Launch one batch if there is room and work; collect the oldest batch when
        the queue is full or nothing new could be launched."""
        outputs: list[EngineCoreOutput] = []
        launched = False
        if (may_schedule and len(self.inflight) < self.max_batches
                and self.scheduler.has_unfinished_requests()):
            sched = self.scheduler.schedule(self._requests_per_batch())
            if sched.is_empty and not (sched.finished_req_ids or sched.preempted_req_ids):
                outputs += self.scheduler.update_from_output(sched, ModelRunnerOutput())
            else:
                self._launch(sched)
                launched = not sched.is_empty
        if self.inflight and (not launched or len(self.inflight) >= self.max_batches):
            outputs += self._collect_oldest()
        return outputs

    def _requests_per_batch(self) -> int:
        """An even share of the unfinished requests, so the batches in flight split
        them (one batch holding every request would leave the other stages idle)."""
        active = self.scheduler.get_num_unfinished_requests()
        return max(1, -(-active // self.max_batches))

    def drain(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        while self.inflight:
            outputs += self._collect_oldest()
        return outputs

    def clear(self) -> None:
        self.inflight.clear()

    def _launch(self, sched: SchedulerOutput) -> None:
        attach_step_tokens(sched, self.scheduler)
        step = self.executor.execute_model_async(sched)
        requests = self.scheduler.requests
        counts = {rid: requests[rid].num_preemptions for rid in sched.num_scheduled_tokens
                  if rid in requests}
        self.inflight.append(_Launched(sched, step, counts))
        self.peak_in_flight = max(self.peak_in_flight, len(self.inflight))

    def _collect_oldest(self) -> list[EngineCoreOutput]:
        launched = self.inflight.popleft()
        output = launched.step.get()
        # A request preempted (and perhaps readmitted) since its batch was launched
        # recomputes from scratch: this batch's token for it is stale.
        requests = self.scheduler.requests
        for i, rid in enumerate(output.req_ids):
            request = requests.get(rid)
            if request is not None and request.num_preemptions != launched.preemptions.get(rid):
                output.sampled_token_ids[i] = []
        return self.scheduler.update_from_output(launched.sched, output)


def attach_step_tokens(sched: SchedulerOutput, scheduler: Scheduler) -> None:
    """Put on each cached request the output tokens among this step's inputs."""
    for cached in sched.cached_requests:
        request = scheduler.requests[cached.req_id]
        start = max(cached.num_computed_tokens, request.num_prompt_tokens)
        end = cached.num_computed_tokens + sched.num_scheduled_tokens[cached.req_id]
        if end > start:
            cached.new_token_ids = request.all_token_ids[start:end]
            cached.new_token_start = start
