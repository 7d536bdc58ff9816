"""AsyncLLM: the engine behind an asyncio server.

LLMEngine is synchronous and not thread-safe, so one background thread owns it and
runs its step loop; nothing else touches it. Coroutines hand work in through a
command queue (add, abort, pause, any call) and get replies and per-request
outputs back on their own event loop through call_soon_threadsafe. The event loop
never waits on a step, and a step never waits on a client.

Prompts are tokenized and checked before they reach the engine thread, in a few
tokenizer threads (the engine's InputProcessor is thread-safe, and fast tokenizers
release the GIL while they work), so a huge prompt never stalls the steps of the
requests already running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from spindle.config import EngineArgs, EngineConfig
from spindle.engine.llm_engine import LLMEngine, ProcessedPrompt, PromptType
from spindle.engine.pause import PauseMode
from spindle.engine.stats import EngineStats, IterationStats, RequestTimer, StatLogger
from spindle.outputs import RequestFailedError, RequestOutput
from spindle.pooling_params import PoolingParams
from spindle.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Threads that tokenize prompts: one big prompt takes only one of them.
TOKENIZER_THREADS = min(4, os.cpu_count() or 1)


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down: the requests in flight failed with
    it and new ones are refused."""


class RequestStream:
    """One request's outputs on its event loop, in order; an async iterator.

    Outputs are cumulative, so when several arrive between two reads only the
    newest is kept. A consumer that stops early calls close() (or is cancelled
    while waiting): the request is then aborted in the engine.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.finished = False
        self._abort = abort
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the event loop (the engine thread schedules it there)."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the client went away
            self.close()
            raise
        while not isinstance(item, BaseException) and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True  # the engine already forgot the request
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


class AsyncLLM:
    """Asyncio front of one LLMEngine, which a background thread owns and steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.config: EngineConfig = engine.config
        self._inputs = engine.input_processor
        self._inputs.warm_up()  # before the engine thread and the tokenizer threads share it
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS,
                                                  thread_name_prefix="spindle-tokenize")
        self._loop = _EngineLoop(engine)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLM":
        return cls(LLMEngine.from_engine_args(args))

    # ---- requests -----------------------------------------------------------------
    async def add_request(self, prompt: PromptType | ProcessedPrompt,
                          params: SamplingParams | PoolingParams | None = None,
                          request_id: str | None = None,
                          lora_request: Any = None, priority: int = 0) -> RequestStream:
        """Validate and queue a request; raises ValueError for a bad one (the engine
        keeps serving), EngineUnavailableError while paused (abort) or asleep. The
        prompt is tokenized in a tokenizer thread, not on the engine's. A request
        that fails later, alone, makes its stream raise RequestFailedError.
        lora_request: the LoRA adapter (spindle.lora.LoRARequest) to serve it with;
        priority: under scheduling_policy="priority", lower is admitted first."""
        arrival = time.monotonic()
        processed = await self.process_prompt(prompt, params)
        return await self.add_processed(processed, params, request_id, arrival, lora_request,
                                        priority)

    async def process_prompt(self, prompt: PromptType | ProcessedPrompt,
                             params: SamplingParams | PoolingParams | None = None
                             ) -> ProcessedPrompt:
        """The prompt tokenized and checked, in a tokenizer thread (ValueError for a bad
        one); it works while the engine sleeps. add_processed() then queues it."""
        self._loop.raise_if_dead()
        return await self._in_tokenizer_thread(self._process, prompt, params)

    def _process(self, prompt: PromptType | ProcessedPrompt,
                 params: SamplingParams | PoolingParams | None) -> ProcessedPrompt:
        structured = getattr(params, "structured_outputs", None)
        if structured is not None:  # compiled here, off the engine thread (then cached)
            self._loop.engine.grammars.compile(structured)
        return self._inputs.process(prompt, params)

    async def add_processed(self, processed: ProcessedPrompt,
                            params: SamplingParams | PoolingParams | None = None,
                            request_id: str | None = None,
                            arrival_time: float | None = None,
                            lora_request: Any = None, priority: int = 0) -> RequestStream:
        """Queue a prompt process_prompt() made. The command reaches the engine thread
        before this coroutine first suspends, so it is ordered before any command
        submitted after the caller's last check of the engine's state (the model pool
        relies on that). arrival_time (time.monotonic()) starts the request's
        latency clock; None: now."""
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(request_id, self._loop.abort_nowait)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        await self._loop.call(
            lambda: self._loop.add(processed, params, request_id, stream, arrival, lora_request,
                                   priority))
        return stream

    async def with_tokenizer(self, fn: Callable[[Any], Any]) -> Any:
        """fn(tokenizer) in a tokenizer thread, off the engine's thread (say, rendering
        a chat template and tokenizing it). fn must use the tokenizer read-only."""
        return await self._in_tokenizer_thread(fn, self._inputs.tokenizer)

    async def _in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request: Any = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's cumulative outputs; the last one has finished=True."""
        async for output in outputs_of(await self.add_request(prompt, params, request_id,
                                                              lora_request, priority)):
            yield output

    async def abort(self, request_id: str) -> None:
        """Finish a request with reason "abort"; its stream gets that final output."""
        await self._loop.call(lambda: self._loop.abort(request_id))

    def abort_all_nowait(self) -> None:
        """Abort every request in flight without waiting (usable from any thread)."""
        self._loop.post(self._loop.abort_all)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread, between two steps; returns its result.
        The way to use anything of the engine's (its tokenizer too) from a coroutine."""
        return await self._loop.call(lambda: fn(self._loop.engine))

    # ---- pause and sleep (the state is the engine core's SchedulingGate) ---------------
    async def pause(self, mode: PauseMode | str = PauseMode.ABORT) -> None:
        """Pause scheduling. Returns once the pause holds: with mode "wait", after the
        requests in flight finished."""
        mode = PauseMode.parse(mode)
        await self._loop.call(lambda: self._loop.pause(mode))
        if mode is PauseMode.WAIT:
            await self._loop.wait_until(lambda stats: stats.num_in_flight == 0)

    async def resume(self) -> None:
        await self.call(lambda engine: engine.resume())

    async def is_paused(self) -> PauseMode | None:
        """The pause mode, None when not paused."""
        return await self.call(lambda engine: engine.core.gate.pause_mode)

    async def sleep(self, level: int = 1, mode: PauseMode | str = PauseMode.KEEP) -> None:
        """Level 0 stops scheduling; 1 and 2 also release device memory (an engine
        without sleep mode raises SleepModeUnavailableError). mode, for unfinished
        requests: "keep" freezes them until wake_up, "abort" finishes them, "wait"
        lets them finish first (streaming as usual; requests that arrive meanwhile
        are held and run after wake_up)."""
        await self._settling(PauseMode.parse(mode),
                             lambda m: self._loop.deliver(self._loop.engine.sleep(level, m)))

    async def _settling(self, mode: PauseMode, op: Callable[[PauseMode], None]) -> None:
        """Run op(mode) on the engine thread. For mode "wait", the requests in flight
        finish first (streaming as usual; new ones are held), then op runs with "keep"
        (nothing is left to keep) and scheduling resumes (the held requests wait in the
        scheduler, or run, on failure)."""
        if mode is not PauseMode.WAIT:
            await self._loop.call(lambda: op(mode))
            return
        await self.pause(PauseMode.WAIT)
        try:
            await self._loop.call(lambda: op(PauseMode.KEEP))
        finally:
            await self.resume()

    async def update_weights(self, weights: Any, version: int | str | None = None,
                             mode: PauseMode | str = PauseMode.WAIT) -> None:
        """Load new weights (see LLMEngine.update_weights). mode, for requests in flight:
        "wait" (the default) lets them finish on the old weights first (streaming as
        usual; requests that arrive meanwhile wait and run on the new ones), "abort"
        ends them, "keep" has them continue on the new weights. Outputs carry the
        version of the weights that produced them."""
        from spindle.models.weight_update import as_weight_source

        source = as_weight_source(weights)  # (a generator is read here, not on the engine thread)
        await self._settling(PauseMode.parse(mode), lambda m: self._loop.deliver(
            self._loop.engine.update_weights(source, version, m)))

    async def init_weight_transfer(self, address: str, timeout_s: float = 300.0) -> None:
        """Join a trainer's spindle.rl.WeightSender (see LLM.init_weight_transfer)."""
        await self.call(lambda engine: engine.core.init_weight_transfer(address, timeout_s))

    async def receive_weights(self, version: int | str | None = None,
                              mode: PauseMode | str = PauseMode.WAIT) -> None:
        """update_weights with what the trainer sends next; mode as for update_weights."""
        await self._settling(PauseMode.parse(mode), lambda m: self._loop.deliver(
            self._loop.engine.receive_weights(version, m)))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake tags ("weights", "kv_cache", "scheduling"; None: all that sleeps)."""
        await self.call(lambda engine: engine.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return await self.call(lambda engine: engine.core.gate.is_sleeping)

    # ---- control ------------------------------------------------------------------
    async def collective_rpc(self, method: str, args: Sequence[Any] = (),
                             kwargs: dict[str, Any] | None = None,
                             timeout: float | None = None) -> list[Any]:
        """Run a worker method on every worker (between two steps); their replies."""
        return await self.call(lambda engine: engine.core.executor.collective_rpc(
            method, timeout=timeout, args=tuple(args), kwargs=kwargs or {}))

    async def check_health(self) -> None:
        """Raise EngineDeadError if the loop died, or the executor's error if a worker did."""
        def check(engine: LLMEngine) -> None:
            self._loop.raise_if_dead()
            engine.core.executor.check_health()

        await self.call(check)

    # ---- monitoring -------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """The snapshot taken after the engine loop's latest iteration."""
        return self._loop.stats

    @property
    def is_dead(self) -> bool:
        return self._loop.error is not None

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine stopped serving (None while it serves)."""
        return self._loop.error

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """stat_logger.record() runs on the engine thread after every iteration."""
        self._loop.stat_loggers = [*self._loop.stat_loggers, stat_logger]

    def remove_stat_logger(self, stat_logger: StatLogger) -> None:
        self._loop.stat_loggers = [s for s in self._loop.stat_loggers if s is not stat_logger]

    def shutdown(self, timeout: float = 60.0) -> None:
        """Abort what is in flight, stop the workers, end the engine thread. Idempotent."""
        self._loop.stop(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)


async def outputs_of(stream: Any) -> AsyncIterator[RequestOutput]:
    """A request stream's outputs; leaving early closes it (aborting the request)."""
    try:
        async for output in stream:
            yield output
    finally:
        stream.close()


@dataclass
class _Tracked:
    stream: RequestStream
    timer: RequestTimer


_STOP = object()


class _EngineLoop:
    """The thread that owns the LLMEngine: runs commands, steps, delivers outputs.

    Every method not marked otherwise runs on that thread. Outputs and replies
    for an event loop are batched per iteration into one call_soon_threadsafe.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stat_loggers: list[StatLogger] = []
        self.stats = EngineStats.collect(engine)
        self.error: EngineDeadError | None = None
        self._streams: dict[str, _Tracked] = {}
        self._waiters: list[tuple[Callable[[EngineStats], bool], asyncio.Future]] = []
        self._outbox: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}
        self._iteration = IterationStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()  # orders submissions against the final drain
        engine.core.executor.register_failure_callback(self._on_executor_failure)
        self._thread = threading.Thread(target=self._run, name="spindle-engine-loop", daemon=True)
        self._thread.start()

    # ---- from any thread ------------------------------------------------------------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """(Event loop.) Run fn on the engine thread and await its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit((fn, loop, future))
        return await future

    async def wait_until(self, predicate: Callable[[EngineStats], bool]) -> None:
        """(Event loop.) Return once predicate(stats) holds after an iteration."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit((lambda: self._waiters.append((predicate, future)), None, None))
        await future

    def post(self, fn: Callable[[], Any]) -> None:
        """Run fn on the engine thread; nobody waits for it (errors are logged)."""
        self._submit((fn, None, None))

    def abort_nowait(self, request_id: str) -> None:
        self.post(lambda: self.abort(request_id))

    def stop(self, timeout: float) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0fs", timeout)

    def _submit(self, command: tuple) -> None:
        with self._lock:
            if self._closed:
                raise self._dead_error()
            self._commands.put(command)

    def _on_executor_failure(self) -> None:
        """Called on the executor's failure thread when a worker died or hung."""
        self.post(lambda: self._die(RuntimeError("the executor reported a worker failure")))

    # ---- the loop ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._run_commands(block=not self._has_work()):
                if self._has_work():
                    self._step()
                self._end_iteration()
        except BaseException as e:  # a bug in the loop itself: fail loudly, never hang clients
            logger.exception("the engine loop crashed")
            self._die(e)
        finally:
            self._close()

    def _has_work(self) -> bool:
        return self.error is None and self.engine.can_step()

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting for one if block). True once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return False
        while command is not _STOP:
            self._run_command(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return False
        return True

    def _run_command(self, fn: Callable[[], Any], loop, future) -> None:
        try:
            result = fn()
        except Exception as e:
            if future is None:
                logger.exception("engine command failed")
            else:
                self._reply(loop, future, error=e)
        else:
            if future is not None:
                self._reply(loop, future, result=result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._die(e)
            return
        now = time.monotonic()
        for output in outputs:
            self._deliver(output, now)

    def _end_iteration(self) -> None:
        self.stats = EngineStats.collect(self.engine)
        iteration, self._iteration = self._iteration, IterationStats()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(self.stats, iteration)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)
        self._resolve_waiters()
        self._flush()

    # ---- commands ---------------------------------------------------------------------
    def add(self, prompt: ProcessedPrompt, params: SamplingParams | PoolingParams | None,
            request_id: str, stream: RequestStream, arrival_time: float,
            lora_request: Any = None, priority: int = 0) -> None:
        self.raise_if_dead()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.engine.add_request(prompt, params, request_id, lora_request=lora_request,
                                priority=priority)
        self._streams[request_id] = _Tracked(stream, RequestTimer(arrival_time))

    def abort(self, request_id: str) -> None:
        tracked = self._streams.pop(request_id, None)
        if self.error is not None:
            return
        output = self.engine.abort_request(request_id)
        if tracked is not None and output is not None:
            tracked.timer.observe(output, time.monotonic(), self._iteration)
            self._send(tracked.stream.loop, tracked.stream.put, output)

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    def pause(self, mode: PauseMode) -> None:
        self.deliver(self.engine.pause(mode))

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs that a control call (pause, sleep, a weight update) produced to
        their streams, as a step's would be."""
        now = time.monotonic()
        for output in outputs:
            self._deliver(output, now)

    # ---- delivery ---------------------------------------------------------------------
    def _deliver(self, output: RequestOutput, now: float) -> None:
        tracked = self._streams.get(output.request_id)
        if tracked is None:
            return
        tracked.timer.observe(output, now, self._iteration)
        if output.error is not None:  # it failed alone: its stream raises
            error = RequestFailedError(output.request_id, output.error)
            self._send(tracked.stream.loop, tracked.stream.put, error)
        else:
            self._send(tracked.stream.loop, tracked.stream.put, output)
        if output.finished:
            del self._streams[output.request_id]

    def _reply(self, loop, future: asyncio.Future, result: Any = None,
               error: BaseException | None = None) -> None:
        def settle() -> None:
            if future.done():  # the caller was cancelled meanwhile
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self._outbox.setdefault(loop, []).append(settle)

    def _send(self, loop, fn: Callable[[Any], None], arg: Any) -> None:
        self._outbox.setdefault(loop, []).append(lambda: fn(arg))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, callbacks in outbox.items():
            try:
                loop.call_soon_threadsafe(_run_all, callbacks)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening any more

    def _resolve_waiters(self) -> None:
        still = []
        for predicate, future in self._waiters:
            if self.error is not None:
                self._reply(future.get_loop(), future, error=self._dead_error())
            elif predicate(self.stats):
                self._reply(future.get_loop(), future)
            else:
                still.append((predicate, future))
        self._waiters = still

    # ---- failure and shutdown ------------------------------------------------------------
    def _die(self, cause: BaseException) -> None:
        """The engine cannot go on: fail every request in flight and refuse new ones."""
        if self.error is not None:
            return
        logger.error("the engine failed; failing %d request(s) in flight", len(self._streams),
                     exc_info=cause)
        self.error = EngineDeadError(f"the engine failed and stopped serving: {cause!r}")
        self.error.__cause__ = cause
        for tracked in self._streams.values():
            self._send(tracked.stream.loop, tracked.stream.put, self._dead_error())
        self._streams.clear()

    def raise_if_dead(self) -> None:
        if self.error is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        """A fresh error per receiver (one exception object raised in many tasks would
        pile their tracebacks together)."""
        if self.error is None:
            return EngineDeadError("the engine has been shut down")
        error = EngineDeadError(str(self.error))
        error.__cause__ = self.error.__cause__
        return error

    def _close(self) -> None:
        self.abort_all()  # whoever still listens gets a final "abort" output
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")
        with self._lock:
            self._closed = True
        if self.error is None:
            self.error = EngineDeadError("the engine has been shut down")
        self._fail_pending_commands()
        self._resolve_waiters()
        self._flush()

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not _STOP and command[2] is not None:
                self._reply(command[1], command[2], error=self._dead_error())


def _run_all(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()
