"""Executor: how many worker processes, where, and how calls reach them.

The engine talks to workers only through an Executor. Its one control primitive
is collective_rpc(method, ...): run a Worker method (by name) or a function
(called as fn(worker, *args, **kwargs)) on every worker and return their replies.
Everything else is built on it. An executor never knows what a step computes: it
forwards a SchedulerOutput and returns a ModelRunnerOutput.

The contract lives here, once; a subclass only moves calls and replies:
- Failure is final. A subclass reports the first failure through _fail(error)
  (a dead worker, a fatal step error); the base records it, has the subclass wake
  every waiter (_on_failure), and then, on its own "failure thread", never a
  caller's, runs the failure callbacks once and stops the workers
  (_stop_workers). Every pending and later call raises ExecutorFailedError.
- Timeouts: a step that outlives parallel.step_timeout_s is taken for a hung
  collective and fails the executor (the ranks' states are unknown from then on);
  any other call's timeout raises TimeoutError and leaves the executor as it was.
- Callables travel by value (cloudpickle) to workers in other processes or actors.
- Capabilities are declared as class attributes, never probed.
"""

from __future__ import annotations

import abc
import importlib
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, ClassVar

from spindle.cache.spec import CacheRequirements, KVCacheConfig
from spindle.config import EngineConfig
from spindle.executor.errors import ExecutorFailedError
from spindle.step_messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_BACKENDS = {
    "uni": "spindle.executor.uniproc:UniProcExecutor",
    "mp": "spindle.executor.multiproc:MultiProcExecutor",
    "ray": "spindle.executor.ray_executor:RayExecutor",
}
# How long a second shutdown() caller, or shutdown() after a failure, waits for the
# first one (or the failure thread) before giving up with a warning.
SHUTDOWN_WAIT_S = 30.0


class Executor(abc.ABC):
    # execute_model_async launches a step and returns at once (async scheduling).
    supports_async_scheduling: ClassVar[bool] = False
    # Workers can be pipeline stages (pipeline_parallel_size > 1).
    supports_pipeline_parallel: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        if parallel.pipeline_parallel_size > 1 and not self.supports_pipeline_parallel:
            raise ValueError(f"{type(self).__name__} does not run pipeline stages "
                             f"(pipeline_parallel_size={parallel.pipeline_parallel_size})")
        self.config = config
        self.world_size = parallel.world_size
        self.step_timeout = parallel.step_timeout_s
        self._failure_callbacks: list[Callable[[], None]] = []
        self._lifecycle_lock = threading.Lock()  # _failure, _closing, _failure_thread
        # The first failure of workers in other processes or actors (an in-process
        # executor fails only by raising from the call itself).
        self._failure: ExecutorFailedError | None = None
        self._closing = False  # shutdown() has begun
        self._failure_thread: threading.Thread | None = None
        self._shut_down = threading.Event()
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type["Executor"]:
        backend = config.parallel.distributed_executor_backend
        if backend not in _BACKENDS:
            raise ValueError(f"distributed_executor_backend {backend!r} is not available in this "
                             f"build; available: {sorted(_BACKENDS)}")
        module, name = _BACKENDS[backend].split(":")
        return getattr(importlib.import_module(module), name)

    # ---- what a subclass provides --------------------------------------------------------
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
        futures of one executor resolve in call order. Remote executors start with
        _prepare_call."""

    @abc.abstractmethod
    def _shutdown_workers(self, clean: bool) -> None:
        """Stop every worker and release what the executor holds (called once, by
        shutdown). clean: no failure happened, so workers may be asked to exit."""

    @abc.abstractmethod
    def _stop_workers(self) -> None:
        """Stop the workers after a failure, at once (on the failure thread): peers of
        a dead worker may sit in a collective forever. Idempotent."""

    def _on_failure(self) -> None:
        """Wake every thread waiting on the workers (called once, right after the
        failure is recorded, on the thread that reported it)."""

    # ---- steps -------------------------------------------------------------------------
    @property
    def output_rank(self) -> int:
        """The rank whose ModelRunnerOutput the engine reads (the last pipeline stage)."""
        return self.world_size - self.config.parallel.tensor_parallel_size

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return self.collective_rpc("execute_model", args=(sched,), timeout=self.step_timeout,
                                       unique_reply_rank=self.output_rank)
        except TimeoutError as e:
            raise self._step_timed_out(sched, e) from e

    def execute_model_async(self, sched: SchedulerOutput) -> "LaunchedStep":
        """Send a step and return at once; get() on the result waits for its output,
        within the same step timeout (counted from the send)."""
        future = self.collective_rpc("execute_model", args=(sched,), timeout=self.step_timeout,
                                     unique_reply_rank=self.output_rank, non_block=True)
        return LaunchedStep(self, sched, future)

    def _step_timed_out(self, sched: SchedulerOutput, error: TimeoutError) -> BaseException:
        """Fail the executor for a step that did not finish in time (a hung collective:
        some ranks may have finished it, so their states are unknown); returns the
        error to raise."""
        self._fail(ExecutorFailedError(f"step {sched.step_id} did not finish within "
                                       f"{self.step_timeout:g}s (step_timeout_s): {error}"))
        return self._unusable_error()

    # ---- lifecycle calls ---------------------------------------------------------------------
    def determine_available_memory(self) -> list[int]:
        return self.collective_rpc("determine_available_memory")

    def cache_requirements(self) -> list[CacheRequirements]:
        return self.collective_rpc("cache_requirements")

    def initialize_kv_cache(self, kv_config: KVCacheConfig) -> None:
        """allocate_kv_cache, warmup and freeze_gc_heap on every worker, in that order."""
        self.collective_rpc("allocate_kv_cache", args=(kv_config,))
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

    def update_weights(self, source) -> list[dict]:
        """Every worker loads new weights (each takes its shard): a checkpoint directory,
        which each reads itself, or (name, tensor) pairs, which travel to each."""
        return self.collective_rpc("update_weights", args=(source,))

    def init_weight_transfer(self, address: str, timeout_s: float) -> None:
        """Every worker joins a trainer's WeightSender (spindle/rl/weight_transfer.py)."""
        self.collective_rpc("init_weight_transfer", args=(address, self.world_size, timeout_s))

    def receive_weights(self) -> list[dict]:
        """Every worker loads what the trainer sends next."""
        return self.collective_rpc("receive_weights")

    # ---- health ------------------------------------------------------------------------------
    def lifecycle_reports(self) -> list[list[dict]]:
        return self.collective_rpc("lifecycle_report")

    def heartbeats(self) -> list[Any]:
        return self.collective_rpc("heartbeat")

    def check_health(self, timeout: float = 10.0) -> None:
        """Raise ExecutorFailedError if the executor failed or a worker is dead, and
        TimeoutError (naming the ranks and where they are) if a worker does not answer
        within timeout; a slow answer alone does not fail the executor."""
        self.collective_rpc("check_health", timeout=timeout)

    # ---- failure -----------------------------------------------------------------------------
    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """callback() runs once, on the executor's failure thread, when it fails."""
        self._failure_callbacks.append(callback)

    @property
    def failure(self) -> ExecutorFailedError | None:
        """The first failure, or None while the executor is healthy."""
        return self._failure

    @property
    def is_failed(self) -> bool:
        return self._failure is not None

    def raise_if_failed(self) -> None:
        """Raise the error that failed the executor, if it failed."""
        if self._failure is not None:
            raise self._failure.copy()

    def _fail(self, error: ExecutorFailedError) -> None:
        """Record the first failure (later ones, and any during shutdown, are its
        consequences), wake every waiter, then stop the workers and run the failure
        callbacks on the failure thread (no lock of any caller held)."""
        with self._lifecycle_lock:
            if self._failure is not None or self._closing:
                return
            self._failure = error
            self._failure_thread = threading.Thread(target=self._after_failure, daemon=True,
                                                    name="spindle-executor-failure")
        logger.error("executor failed: %s", error)
        self._on_failure()
        self._failure_thread.start()

    def _after_failure(self) -> None:
        for callback in self._failure_callbacks:
            try:
                callback()
            except Exception:
                logger.exception("a failure callback raised")
        try:
            self._stop_workers()
        except Exception:
            logger.exception("stopping the workers after the failure raised")

    def _unusable(self) -> BaseException | None:
        """What a call to this executor raises now, or None while it is usable."""
        if self._failure is not None:
            return self._failure.copy()
        if self._closing:
            return RuntimeError("the executor has been shut down")
        return None

    def _unusable_error(self) -> BaseException:
        return self._unusable() or RuntimeError("the executor has been shut down")

    def _raise_if_unusable(self) -> None:
        error = self._unusable()
        if error is not None:
            raise error

    # ---- calls to workers elsewhere ----------------------------------------------------------
    def _prepare_call(self, method: str | Callable,
                      unique_reply_rank: int | None) -> tuple[str | bytes, str]:
        """Check unique_reply_rank; return what travels (a method name, or a function
        pickled by value) and the call's name (for errors and heartbeats)."""
        self._check_reply_rank(unique_reply_rank)
        if isinstance(method, str):
            return method, method
        return pickle_callable(method), getattr(method, "__name__", "<callable>")

    def _check_reply_rank(self, unique_reply_rank: int | None) -> None:
        if unique_reply_rank is not None and not 0 <= unique_reply_rank < self.world_size:
            raise ValueError(f"unique_reply_rank must be in 0..{self.world_size - 1}, "
                             f"got {unique_reply_rank}")

    # ---- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker and release what the executor holds. Idempotent: a second
        caller waits for the first. Returns once a failure's handling (callbacks,
        stopping the workers) has finished too."""
        with self._lifecycle_lock:
            first = not self._closing
            self._closing = True
            failure_thread = self._failure_thread
        if first:
            try:
                self._shutdown_workers(clean=self._failure is None)
            finally:
                self._shut_down.set()
        elif not self._shut_down.wait(SHUTDOWN_WAIT_S):
            logger.warning("shutdown: the first shutdown did not finish in %.0fs", SHUTDOWN_WAIT_S)
        if failure_thread is not None and failure_thread is not threading.current_thread():
            failure_thread.join(SHUTDOWN_WAIT_S)
            if failure_thread.is_alive():
                logger.warning("shutdown: the failure handling did not finish in %.0fs",
                               SHUTDOWN_WAIT_S)


class LaunchedStep:
    """A step sent to the workers; get() waits for the output rank's reply. A step
    that outlives the step timeout (counted from the send) fails the executor, as in
    execute_model."""

    def __init__(self, executor: Executor, sched: SchedulerOutput, future: Future) -> None:
        self._executor = executor
        self._sched = sched
        self._future = future

    def get(self) -> ModelRunnerOutput:
        try:
            return self._future.result()
        except TimeoutError as e:
            raise self._executor._step_timed_out(self._sched, e) from e


def pickle_callable(fn: Callable) -> bytes:
    """fn by value, for a worker in another process (it need not be importable there)."""
    import cloudpickle

    try:
        return cloudpickle.dumps(fn)
    except Exception as e:
        raise TypeError(f"collective_rpc cannot send {fn!r} to the workers: {e}") from e
