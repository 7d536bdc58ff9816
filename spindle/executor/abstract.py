"""Executor: how many worker processes, where, and how calls reach them.

The engine talks to workers only through an Executor. Its one control primitive
is collective_rpc(method, ...): run a Worker method (by name) or a function
(called as fn(worker, *args, **kwargs)) on every worker and return their replies.
Everything else is built on it. An executor never knows what a step computes: it
forwards a SchedulerOutput and returns a ModelRunnerOutput.
"""

from __future__ import annotations

import abc
import importlib
import logging
from typing import Any, Callable

from spindle.config import EngineConfig
from spindle.executor.errors import ExecutorFailedError
from spindle.step_messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_BACKENDS = {
    "uni": "spindle.executor.uniproc:UniProcExecutor",
    "mp": "spindle.executor.multiproc:MultiProcExecutor",
    "ray": "spindle.executor.ray_executor:RayExecutor",
}


class Executor(abc.ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._failure_callbacks: list[Callable[[], None]] = []
        self.is_failed = False
        # The first failure of workers in other processes or actors (an in-process
        # executor fails only by raising from the call itself).
        self._failure: ExecutorFailedError | None = None
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        backend = config.parallel.distributed_executor_backend
        if backend not in _BACKENDS:
            raise ValueError(f"distributed_executor_backend {backend!r} is not available in this "
                             f"build; available: {sorted(_BACKENDS)}")
        module, name = _BACKENDS[backend].split(":")
        return getattr(importlib.import_module(module), name)

    @abc.abstractmethod
    def _init_executor(self) -> None:
        """Create the workers and run init_device and load_model on each."""

    @abc.abstractmethod
    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, non_block: bool = False) -> Any:
        """Run method on every worker. Returns the list of replies in rank order, or
        only the reply of unique_reply_rank when it is given (others stay silent).
        timeout: seconds to wait for the replies; TimeoutError names the ranks that did
        not answer. non_block: return a concurrent.futures.Future at once instead;
        futures of one executor resolve in call order."""

    @property
    def output_rank(self) -> int:
        """The rank whose ModelRunnerOutput the engine reads (the last pipeline stage)."""
        return self.config.parallel.world_size - self.config.parallel.tensor_parallel_size

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", args=(sched,),
                                   unique_reply_rank=self.output_rank)

    def _execute_with_step_timeout(self, sched: SchedulerOutput,
                                   timeout: float) -> ModelRunnerOutput:
        """execute_model for executors with worker processes or actors, which provide
        _fail(error) and _unusable_error(): a step that outlives timeout is taken for
        a hung collective, and the ranks' states are unknown from then on (some may
        have finished the step), so the executor fails as a whole."""
        try:
            return self.collective_rpc("execute_model", args=(sched,), timeout=timeout,
                                       unique_reply_rank=self.output_rank)
        except TimeoutError as e:
            raise self._step_timed_out(sched, timeout, e) from e

    def _step_timed_out(self, sched: SchedulerOutput, timeout: float,
                        error: TimeoutError) -> BaseException:
        """Fail the executor for a step that did not finish in time; returns the
        error to raise."""
        self._fail(ExecutorFailedError(f"step {sched.step_id} did not finish within "
                                       f"{timeout:.0f}s: {error}"))
        return self._unusable_error()

    def _launch_step(self, sched: SchedulerOutput, timeout: float) -> "LaunchedStep":
        """Send a step to the workers and return at once (for executors whose
        collective_rpc returns futures with non_block=True and a deadline)."""
        future = self.collective_rpc("execute_model", args=(sched,), timeout=timeout,
                                     unique_reply_rank=self.output_rank, non_block=True)
        return LaunchedStep(self, sched, timeout, future)

    def determine_available_memory(self) -> list[int]:
        return self.collective_rpc("determine_available_memory")

    def kv_cache_block_bytes(self) -> list[int]:
        return self.collective_rpc("kv_cache_block_bytes")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """allocate_kv_cache, warmup and freeze_gc_heap on every worker, in that order."""
        self.collective_rpc("allocate_kv_cache", args=(num_blocks,))
        self.collective_rpc("warmup")
        self.collective_rpc("freeze_gc_heap")

    # ---- sleep mode (workers started with enable_sleep_mode) ----------------------------
    def sleep(self, level: int) -> list[dict]:
        """Every worker gives its weights' and KV cache's device memory back."""
        return self.collective_rpc("sleep", args=(level,))

    def wake_up(self, tags: list[str] | None = None) -> list[dict]:
        """Every worker takes the memory of tags back (None: all that sleeps)."""
        return self.collective_rpc("wake_up", args=(tags,))

    def sleep_state(self) -> list[dict]:
        return self.collective_rpc("sleep_state")

    def lifecycle_reports(self) -> list[list[dict]]:
        return self.collective_rpc("lifecycle_report")

    def heartbeats(self) -> list[Any]:
        return self.collective_rpc("heartbeat")

    def check_health(self, timeout: float = 10.0) -> None:
        """Raise if any worker is dead or does not answer within timeout seconds."""
        self.collective_rpc("check_health", timeout=timeout)

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """callback() runs once, from any thread, when the executor fails."""
        self._failure_callbacks.append(callback)

    @property
    def failure(self) -> ExecutorFailedError | None:
        """The first failure, or None while the executor is healthy."""
        return self._failure

    def raise_if_failed(self) -> None:
        """Raise the error that failed the executor, if it failed."""
        if self._failure is not None:
            raise self._failure.copy()

    def _unusable_error(self) -> BaseException:
        """What a call to a failed or shut-down executor raises."""
        if self._failure is not None:
            return self._failure.copy()
        return RuntimeError("the executor has been shut down")

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and release what the executor holds. Idempotent."""


class LaunchedStep:
    """A step sent to worker processes; get() waits for the output rank's reply.
    A step that outlives its timeout (counted from the send) fails the executor,
    as in execute_model."""

    def __init__(self, executor: Executor, sched: SchedulerOutput, timeout: float,
                 future: Any) -> None:
        self._executor = executor
        self._sched = sched
        self._timeout = timeout
        self._future = future

    def get(self) -> ModelRunnerOutput:
        try:
            return self._future.result()
        except TimeoutError as e:
            raise self._executor._step_timed_out(self._sched, self._timeout, e) from e
