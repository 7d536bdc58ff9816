"""EngineCore: the scheduler and the executor, stepped together.

step() is the whole loop: schedule -> execute -> update. The core handles token
ids only; text lives in the output processor above it.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

from spindle.cache.spec import CacheRequirements, KVCacheConfig
from spindle.config import EngineConfig
from spindle.engine.batch_queue import BatchQueue
from spindle.engine.pause import PauseMode, SchedulingGate, SleepModeUnavailableError
from spindle.engine.request import Request, RequestStatus
from spindle.engine.scheduler import Scheduler
from spindle.engine.startup_table import format_startup_table
from spindle.executor.abstract import Executor
from spindle.step_messages import EngineCoreOutput, ModelRunnerOutput

logger = logging.getLogger(__name__)

# What wake_up can wake: the two memory tags, and scheduling.
SLEEP_TAGS = ("weights", "kv_cache", "scheduling")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        self.executor = Executor.get_class(config)(config)
        try:
            self.kv_config = self._initialize_kv_caches()
        except BaseException as error:
            # Said before the shutdown: after a device fault (a device-side assert) the
            # freeing of device memory there can abort the process before the exception
            # reaches the caller.
            logger.error("engine start failed: %s: %s", type(error).__name__, error)
            self.executor.shutdown()
            raise
        # Async scheduling: schedule and launch step N+1 while step N runs on the device.
        pipelined = config.parallel.pipeline_parallel_size > 1
        self.async_scheduling = (config.scheduler.async_scheduling and not pipelined
                                 and self.executor.supports_async_scheduling)
        self.num_kv_blocks = self.kv_config.num_blocks
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_kv_blocks,
                                   async_scheduling=self.async_scheduling,
                                   cache_groups=self.cache_requirements.groups,
                                   num_state_slots=self.kv_config.num_state_slots,
                                   enable_prefix_caching=self._prefix_caching(),
                                   speculative_config=config.speculative)
        # Pipeline parallelism: up to max_concurrent_batches disjoint batches in flight.
        self.batch_queue = (BatchQueue(self.scheduler, self.executor,
                                       config.parallel.max_concurrent_batches)
                            if pipelined else None)
        self._inflight = None  # (SchedulerOutput, PendingOutput) of the launched step
        self._undelivered: list[EngineCoreOutput] = []  # drained outside step()
        self.gate = SchedulingGate()  # pause / sleep state (engine/pause.py)
        # Which weights the outputs come from: 0 for the checkpoint's, then the caller's
        # version, or the number of updates so far (update_weights).
        self.weight_version: int | str = 0
        self.num_weight_updates = 0
        self._weight_check = None  # (update_weights' check: models/weight_update.py)
        self.startup_seconds = time.perf_counter() - start
        self.startup_table = format_startup_table(self.executor.lifecycle_reports())
        slots = (f", {self.kv_config.num_state_slots} state slots "
                 f"({self.num_state_snapshots} for prefix-cache snapshots)"
                 if self.kv_config.num_state_slots else "")
        logger.info("startup in %.2fs; KV cache: %d blocks of %d tokens%s\n%s",
                    self.startup_seconds, self.num_kv_blocks, config.cache.block_size, slots,
                    self.startup_table)

    def _initialize_kv_caches(self) -> KVCacheConfig:
        """Size the cache from every rank's budget and needs, and allocate it. Every
        rank holds the same block ids and state slots: the counts the tightest rank
        can fit."""
        budgets = self.executor.determine_available_memory()
        needs = self.executor.cache_requirements()
        if len({n.signature() for n in needs}) > 1:
            raise ValueError("the ranks' layers form different cache groups "
                             f"({[n.signature() for n in needs]}): pipeline stages that "
                             "hold different kinds of layers are not supported (choose a "
                             "pipeline_layer_partition that gives every stage the same "
                             "kinds)")
        self.cache_requirements = needs[0]
        kv_config = self._size_cache(budgets, needs)
        self.executor.initialize_kv_cache(kv_config)
        return kv_config

    def _size_cache(self, budgets: list[int], needs: list[CacheRequirements]) -> KVCacheConfig:
        self.num_state_snapshots = 0
        if not needs[0].groups:  # a model without a cache (encoder-only)
            return KVCacheConfig(0)
        # One state slot per running sequence, and the prefix cache's snapshots, set
        # aside before the blocks.
        self.num_state_snapshots = self._state_snapshots(budgets, needs)
        slots = (self.config.scheduler.max_num_seqs + self.num_state_snapshots
                 if needs[0].has_state else 0)
        left = [b - slots * n.slot_bytes for b, n in zip(budgets, needs)]
        num_blocks = (min(b // n.block_bytes for b, n in zip(left, needs))
                      if needs[0].has_paged else 0)
        block_size = self.config.cache.block_size
        max_len = self.config.model.max_model_len
        needed = needs[0].blocks_per_sequence(max_len, block_size,
                                              self.config.scheduler.max_num_batched_tokens)
        if min(left) < 0 or num_blocks < needed:
            state = (f" after {slots} state slots of {needs[0].slot_bytes / 2**20:.1f} MiB"
                     if slots else "")
            raise ValueError(
                f"the KV cache budget ({min(budgets) / 2**20:.1f} MiB{state}: {max(0, num_blocks)} "
                f"blocks of {block_size} tokens) cannot hold one sequence of max_model_len="
                f"{max_len} tokens ({needed} blocks); raise kv_cache_memory_bytes, "
                "gpu_memory_utilization (GPU) or cpu_kv_cache_gb (CPU), or lower max_model_len"
                + (" or max_num_seqs" if slots else ""))
        return KVCacheConfig(num_blocks, slots)

    def _state_snapshots(self, budgets: list[int], needs: list[CacheRequirements]) -> int:
        """State slots kept as prefix-cache snapshots: state_snapshot_slots, by default
        max_num_seqs within a quarter of the tightest rank's budget."""
        cache = self.config.cache
        if not (needs[0].has_state and cache.enable_prefix_caching):
            return 0
        if cache.state_snapshot_slots is not None:
            return cache.state_snapshot_slots
        fit = min(b // 4 // max(1, n.slot_bytes) for b, n in zip(budgets, needs))
        return min(self.config.scheduler.max_num_seqs, fit)

    def _prefix_caching(self) -> bool:
        """Prefix caching as configured; a model with state layers needs snapshot slots
        for it (a hit needs each layer's state at the hit's end)."""
        enabled = self.config.cache.enable_prefix_caching
        if enabled and self.cache_requirements.has_state and not self.num_state_snapshots:
            logger.warning("prefix caching is off: this model has state-space layers and "
                           "no state snapshot slots (state_snapshot_slots=0, or none fit "
                           "in a quarter of the cache budget)")
            return False
        return enabled

    def raise_if_dead(self) -> None:
        """Raise the executor's failure (a dead worker, naming its rank and exit code)."""
        self.executor.raise_if_failed()

    def add_request(self, request: Request) -> None:
        self.raise_if_dead()
        if self.gate.admit(request):  # else held until resume, or refused (paused / asleep)
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.gate.drop_held(request_ids)
        self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: Iterable[str]) -> None:
        """Finish requests the output processor stopped (a stop string matched)."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self._inflight is not None
                or bool(self._undelivered) or self._batches_in_flight())

    def can_step(self) -> bool:
        """True when step() has work to do: unfinished requests and scheduling allowed,
        or outputs of a launched step to collect."""
        return ((self.gate.may_schedule and self.scheduler.has_unfinished_requests())
                or self._inflight is not None or bool(self._undelivered)
                or self._batches_in_flight())

    def _batches_in_flight(self) -> bool:
        return self.batch_queue is not None and self.batch_queue.busy

    def step(self) -> list[EngineCoreOutput]:
        """schedule -> execute -> update. With async scheduling the update is that of
        the previous step: this step is launched first, so the device never waits
        for the host's bookkeeping."""
        outputs, self._undelivered = self._undelivered, []
        if self.batch_queue is not None:
            return outputs + self.batch_queue.step(self.gate.may_schedule)
        if not (self.gate.may_schedule and self.scheduler.has_unfinished_requests()):
            return outputs + self._collect_inflight()
        sched = self.scheduler.schedule()
        idle = sched.is_empty and not (sched.finished_req_ids or sched.preempted_req_ids)
        if not self.async_scheduling:
            runner_output = (ModelRunnerOutput() if idle  # nothing to do or forget
                             else self.executor.execute_model(sched))
            # Always: the scheduler may have finished requests on its own (e.g. one
            # that can never fit), and reports them here.
            return outputs + self.scheduler.update_from_output(sched, runner_output)
        launched = None if idle else self.executor.execute_model_async(sched)
        outputs += self._collect_inflight()
        if launched is None:
            outputs += self.scheduler.update_from_output(sched, ModelRunnerOutput())
        else:
            self._inflight = (sched, launched)
        return outputs

    def _collect_inflight(self) -> list[EngineCoreOutput]:
        """Wait for the launched step (if any) and apply its tokens."""
        if self._inflight is None:
            return []
        sched, pending = self._inflight
        self._inflight = None
        return self.scheduler.update_from_output(sched, pending.get())

    def drain(self) -> None:
        """Finish the launched step now (before pausing, sleeping or shutting down);
        its outputs are delivered by the next step()."""
        self._undelivered += self._collect_inflight()
        if self.batch_queue is not None:
            self._undelivered += self.batch_queue.drain()

    # ---- pause and sleep (the state lives in self.gate) -------------------------
    def pause(self, mode: PauseMode | str) -> list[EngineCoreOutput]:
        """Pause scheduling (see PauseMode). With mode "abort", every unfinished request
        (held ones too) is finished now; their outputs (finish reason "abort") are
        returned for the caller to report, since no step() reports them."""
        mode = PauseMode.parse(mode)
        self.drain()
        self.gate.pause(mode)
        return self._abort_all() if mode is PauseMode.ABORT else []

    def _abort_all(self) -> list[EngineCoreOutput]:
        """Finish every unfinished request (held ones too) with reason "abort"; their
        outputs, since no step() reports them."""
        request_ids = list(self.scheduler.requests) + self.gate.drop_held()
        self.scheduler.abort_requests(request_ids)
        return [EngineCoreOutput(req_id=r, new_token_ids=[], finish_reason="abort")
                for r in request_ids]

    def resume(self) -> None:
        """Unpause: frozen requests go on where they stopped, then held ones, in order."""
        for request in self.gate.resume():
            self.scheduler.add_request(request)

    def sleep(self, level: int, mode: PauseMode | str = PauseMode.KEEP
              ) -> list[EngineCoreOutput]:
        """Stop scheduling (level 0), and release the device memory of the weights and
        the KV cache (levels 1 and 2; the engine must run with enable_sleep_mode).

        mode says what happens to unfinished requests: "keep" freezes them and they go
        on after wake_up (recomputing their tokens, since the KV cache is discarded),
        "wait" runs them to completion first, "abort" finishes them now. Returns the
        outputs this produced (finished or aborted requests) for the caller to report.
        New requests are refused until the engine is awake.
        """
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
        mode = PauseMode.parse(mode)
        if self.gate.is_sleeping:
            raise ValueError(f"the engine is already asleep (level {self.gate.sleep_level}; "
                             f"asleep: {', '.join(self.gate.asleep)}); wake_up first")
        if level > 0 and not self.config.memory.enable_sleep_mode:
            raise SleepModeUnavailableError(
                f"sleep mode is not available: sleep level {level} releases device memory, "
                "which needs an engine started with enable_sleep_mode=True "
                "(--enable-sleep-mode); level 0, which only pauses scheduling, works without")
        self.drain()
        outputs = self._settle_unfinished(mode)
        if level > 0:
            self.scheduler.preempt_all()  # their KV cache is about to be discarded
            self.scheduler.reset_prefix_cache()
            self.executor.sleep(level)
        self.gate.sleep(level, SLEEP_TAGS if level > 0 else ("scheduling",))
        return outputs

    def _settle_unfinished(self, mode: PauseMode) -> list[EngineCoreOutput]:
        """Apply mode to the unfinished requests before sleeping (see sleep())."""
        if mode is PauseMode.ABORT:
            return self._abort_all()
        outputs, self._undelivered = self._undelivered, []
        if mode is PauseMode.WAIT:
            if not self.gate.may_schedule and self.scheduler.has_unfinished_requests():
                self._undelivered = outputs
                raise ValueError("sleep mode 'wait' cannot finish requests while the engine "
                                 f"is paused (mode={self.gate.pause_mode.value}): resume "
                                 "first, or sleep with mode 'keep' or 'abort'")
            while self.scheduler.has_unfinished_requests() or self._inflight is not None:
                outputs += self.step()
            self.drain()
            outputs, self._undelivered = outputs + self._undelivered, []
        return outputs

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake tags ("weights", "kv_cache", "scheduling"; None: every tag asleep).
        Memory can wake in stages (weights, then kv_cache); scheduling wakes only
        once both are awake, and only when named (or tags is None)."""
        if not self.gate.is_sleeping:
            raise ValueError("the engine is not asleep: nothing to wake")
        tags = list(self.gate.asleep if tags is None else tags)
        bad = [t for t in tags if t not in SLEEP_TAGS]
        if bad:
            raise ValueError(f"wake_up tags must be among {', '.join(SLEEP_TAGS)}, got {bad}")
        not_asleep = [t for t in tags if t not in self.gate.asleep]
        if not_asleep:
            raise ValueError(f"cannot wake {', '.join(not_asleep)}: not asleep "
                             f"(asleep: {', '.join(self.gate.asleep)})")
        memory = [t for t in tags if t != "scheduling"]
        still_asleep = [t for t in self.gate.asleep if t != "scheduling" and t not in memory]
        if "scheduling" in tags and still_asleep:
            raise ValueError(f"cannot wake scheduling while {', '.join(still_asleep)} "
                             "still sleeps: wake it first, or in the same call")
        if memory:
            self.executor.wake_up(memory)
        if "kv_cache" in memory:
            self.scheduler.reset_prefix_cache()  # whatever the cache held is gone
        self.gate.wake(tags)

    def update_weights(self, source, version: int | str | None = None,
                       mode: PauseMode | str = PauseMode.WAIT) -> list[EngineCoreOutput]:
        """Load new weights (a checkpoint directory, or (name, tensor) pairs in HF
        naming; checked whole first: a bad source changes nothing) and tag what follows
        with version (None: the number of updates so far).

        mode says what happens to unfinished requests: "wait" (the default) runs them to
        completion on the old weights first, "abort" ends them, "keep" has them
        recompute from their tokens so far, and continue, on the new weights. Asleep,
        nothing runs: the weights must be awake (wake_up(["weights"])), and the requests
        kept by sleep continue on the new weights after wake_up. The prefix cache is
        dropped (its KV came from the old weights). Returns the outputs that settling the
        requests produced, for the caller to report under the old version."""
        from spindle.models.weight_update import WeightCheck

        # Checked here too, so that a bad source is a ValueError whatever the executor.
        if self._weight_check is None:
            self._weight_check = WeightCheck(self.config.model)
        self._weight_check.source(source)
        return self._swap_weights(lambda: self.executor.update_weights(source), version, mode)

    def init_weight_transfer(self, address: str, timeout_s: float) -> None:
        """Join a trainer's WeightSender (spindle/rl/weight_transfer.py); returns once
        every worker and the trainer are connected."""
        self.executor.init_weight_transfer(address, timeout_s)

    def receive_weights(self, version: int | str | None = None,
                        mode: PauseMode | str = PauseMode.WAIT) -> list[EngineCoreOutput]:
        """update_weights with what the trainer's next WeightSender.send() sends."""
        def receive() -> None:
            refused = [r["refused"] for r in self.executor.receive_weights() if "refused" in r]
            if refused:  # (every rank refused before loading anything)
                raise ValueError(refused[0])

        return self._swap_weights(receive, version, mode)

    def _swap_weights(self, load, version: int | str | None,
                      mode: PauseMode | str) -> list[EngineCoreOutput]:
        mode = PauseMode.parse(mode)
        if version is not None and (isinstance(version, bool)
                                    or not isinstance(version, (int, str))):
            raise ValueError(f"weight version must be an int or a str, got {version!r}")
        if "weights" in self.gate.asleep:
            raise ValueError("the weights are asleep: wake_up(['weights']) before "
                             "updating them (the KV cache may stay asleep)")
        self.drain()
        if self.gate.is_sleeping:
            outputs, self._undelivered = self._undelivered, []
        else:
            outputs = self._settle_unfinished(mode)
            if mode is PauseMode.KEEP:
                self.scheduler.preempt_all()  # their KV came from the old weights
        load()
        self.scheduler.reset_prefix_cache()
        self.num_weight_updates += 1
        self.weight_version = self.num_weight_updates if version is None else version
        logger.info("weights updated (version %s)", self.weight_version)
        return outputs

    def sleep_state(self) -> dict:
        """The engine's sleep state, and each worker's (when sleep mode is on)."""
        state = {"level": self.gate.sleep_level, "asleep": list(self.gate.asleep)}
        if self.config.memory.enable_sleep_mode:
            state["workers"] = self.executor.sleep_state()
        return state

    def shutdown(self) -> None:
        self._inflight = None  # a launched step's outputs are not wanted any more
        if self.batch_queue is not None:
            self.batch_queue.clear()
        self.executor.shutdown()
