"""ModelPool: several models served from one device, taking turns through sleep mode.

Each model has its own engine (an AsyncLLM over its own executor and worker
processes); the pool only decides which of them are awake. A request for a sleeping
model waits in that model's queue while the pool puts awake models to sleep until
the newcomer fits (at most max_awake_models awake, and the device bytes of the awake
ones within device_memory_budget_bytes), then wakes it and lets the request in. The
engines never learn of each other: sleep mode is the whole swap mechanism.

The policy, decided by one swapper task so that no two decisions race:
- The model that has waited longest goes first: waiting means a request queued for
  it, or requests of its own frozen when an earlier swap put it to sleep.
- Room is made from idle awake models first, the least recently used first.
- A busy awake model is put to sleep only once it has been awake for time_slice_s
  (the fairness bound): its unfinished requests freeze (sleep mode "keep") and go on,
  recomputing their KV cache, when it is awake again. So while others wait, no model
  holds the device for much longer than a time slice, and a request waits at most
  about (models - 1) x (time slice + swap time).
- Sleep level per model: "auto" is level 1 (weights kept in host RAM) when the host
  has room for them beside host_memory_reserve_bytes, else level 2 (weights dropped
  and reloaded from the checkpoint on wake); or a fixed 1 or 2.
- A model whose engine dies is failed: its requests fail, the others serve on, and
  restart() gives it a fresh engine while the pool keeps serving.

Models are loaded one at a time at start(), each with the device to itself (those
loaded before it are put to sleep first): each engine sizes its KV cache as if alone,
by its own gpu_memory_utilization. Every pool method runs on the event loop of its
caller; start() and shutdown() are synchronous.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

import psutil

from spindle.config import EngineArgs, EngineConfig, PoolArgs
from spindle.engine.async_llm import AsyncLLM, RequestStream, outputs_of
from spindle.engine.llm_engine import LLMEngine, ProcessedPrompt, PromptType
from spindle.engine.pause import EngineUnavailableError, PauseMode
from spindle.engine.stats import StatLogger
from spindle.outputs import RequestOutput
from spindle.pooling_params import PoolingParams
from spindle.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SLEEP_LEVEL_CHOICES = ("auto", 1, 2)
DEFAULT_TIME_SLICE_S = 5.0
_POLL_S = 0.5  # how often the swapper looks for engines that died
_ADD_ATTEMPTS = 3


class ModelState(str, enum.Enum):
    LOADING = "loading"    # its engine is being built (start, restart)
    AWAKE = "awake"
    SLEEPING = "sleeping"  # going to sleep
    ASLEEP = "asleep"
    WAKING = "waking"
    FAILED = "failed"      # its engine died; restart() brings it back
    STOPPED = "stopped"    # no engine (restart in progress)


class ModelUnavailableError(EngineUnavailableError):
    """A pool model cannot serve now (failed, restarting, shut down): a 503."""


@dataclass(frozen=True)
class PoolModel:
    """One model of a pool: the name clients ask for, and its engine's arguments."""

    name: str
    engine_args: EngineArgs
    sleep_level: int | str = "auto"  # 1, 2, or "auto" (see the module docstring)


@dataclass
class ModelStats:
    load_seconds: float | None = None  # the latest engine build (start, restart)
    wakes: int = 0
    sleeps: int = 0
    wake_seconds: float = 0.0    # total
    last_wake_seconds: float | None = None
    sleep_seconds: float = 0.0   # total
    queued_requests: int = 0     # requests that waited for the model to be awake
    queue_seconds: float = 0.0   # their total wait
    failures: int = 0
    restarts: int = 0


@dataclass(frozen=True)
class PoolEvent:
    """What listeners hear: kind is "wake", "sleep", "load", "queued", "failed",
    "restart" or "state"; seconds for the timed kinds, level for sleep and wake."""

    kind: str
    model: str
    state: ModelState
    seconds: float | None = None
    level: int | None = None


@dataclass
class _Waiter:
    future: asyncio.Future
    since: float
    takes_lease: bool  # a request (True), or a wake_up()/restart() call (False)


@dataclass
class _Member:
    spec: PoolModel
    engine: AsyncLLM | None = None
    config: EngineConfig | None = None
    state: ModelState = ModelState.STOPPED
    level: int | None = None            # the sleep level while asleep
    generation: int = 0                 # engines built for it so far (leases are per engine)
    leases: int = 0                     # admitted requests of the current engine not finished
    waiters: list[_Waiter] = field(default_factory=list)
    frozen_since: float | None = None   # asleep with unfinished requests, since
    awake_since: float = 0.0
    last_used: float = 0.0
    device_bytes: int = 0               # weights + KV cache, measured awake
    weight_bytes: int = 0
    error: str | None = None
    stat_loggers: list[StatLogger] = field(default_factory=list)
    stats: ModelStats = field(default_factory=ModelStats)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def demand_since(self) -> float | None:
        """Since when it has waited for the device; None: it does not."""
        times = [w.since for w in self.waiters]
        if self.leases and self.frozen_since is not None:
            times.append(self.frozen_since)
        return min(times) if times else None


class _Lease:
    """An admitted request's hold on its model: busy until released (once)."""

    def __init__(self, pool: "ModelPool", member: _Member) -> None:
        self._pool, self._member, self._generation = pool, member, member.generation
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        member = self._member
        if member.generation == self._generation and member.leases > 0:
            member.leases -= 1
        member.last_used = time.monotonic()
        self._pool._poke()


class LeasedStream:
    """A request's RequestStream that releases its lease on its model when it ends
    (its final output, an error, or close())."""

    def __init__(self, stream: RequestStream, lease: _Lease) -> None:
        self._stream, self._lease = stream, lease
        self.request_id = stream.request_id

    @property
    def finished(self) -> bool:
        return self._stream.finished

    def __aiter__(self) -> "LeasedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            output = await self._stream.__anext__()
        except BaseException:
            self._lease.release()
            raise
        if output.finished:
            self._lease.release()
        return output

    def close(self) -> None:
        self._stream.close()
        self._lease.release()


class PooledEngine:
    """One pool model as serving code sees an AsyncLLM: add_request() waits in the
    model's queue until it is awake, and the stream it returns keeps the model busy
    until the request ends. Tokenizer work runs while the model sleeps, so a bad
    prompt is refused without a swap."""

    def __init__(self, pool: "ModelPool", member: _Member) -> None:
        self._pool, self._member = pool, member
        self.name = member.name

    @property
    def config(self) -> EngineConfig:
        return self._member.config

    async def add_request(self, prompt: PromptType | ProcessedPrompt,
                          params: SamplingParams | PoolingParams | None = None,
                          request_id: str | None = None, lora_request: Any = None,
                          priority: int = 0) -> LeasedStream:
        """As AsyncLLM.add_request, the model woken first (lora_request and priority:
        as there)."""
        arrival = time.monotonic()
        processed = await self._pool._engine_of(self._member).process_prompt(prompt, params)
        if isinstance(params, SamplingParams):
            params.validate()  # before a swap, not after
        for _ in range(_ADD_ATTEMPTS):
            lease = await self._pool._acquire(self._member)
            try:
                engine = self._pool._engine_of(self._member)
                stream = await engine.add_processed(processed, params, request_id, arrival,
                                                    lora_request, priority)
            except EngineUnavailableError:  # put to sleep in between (a zero time slice)
                lease.release()
                continue
            except BaseException:
                lease.release()
                raise
            return LeasedStream(stream, lease)
        raise ModelUnavailableError(f"model {self.name!r} went back to sleep {_ADD_ATTEMPTS} "
                                    "times before the request got in; retry (or raise the "
                                    "pool's time slice)")

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request: Any = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        async for output in outputs_of(await self.add_request(prompt, params, request_id,
                                                              lora_request, priority)):
            yield output

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await self._pool._engine_of(self._member).call(fn)

    async def with_tokenizer(self, fn: Callable[[Any], Any]) -> Any:
        return await self._pool._engine_of(self._member).with_tokenizer(fn)

    async def abort(self, request_id: str) -> None:
        await self._pool._engine_of(self._member).abort(request_id)


class ModelPool:
    """Several engines on one device; see the module docstring for the policy."""

    def __init__(self, models: Sequence[PoolModel], max_awake_models: int = 1,
                 device_memory_budget_bytes: int | None = None,
                 time_slice_s: float = DEFAULT_TIME_SLICE_S,
                 host_memory_reserve_bytes: int | None = None) -> None:
        _check_pool_args(models, max_awake_models, device_memory_budget_bytes, time_slice_s,
                         host_memory_reserve_bytes)
        self.max_awake_models = max_awake_models
        self.device_memory_budget_bytes = device_memory_budget_bytes
        self.time_slice_s = float(time_slice_s)
        total = psutil.virtual_memory().total
        self.host_memory_reserve_bytes = (max(2 * 2**30, total // 10)
                                          if host_memory_reserve_bytes is None
                                          else host_memory_reserve_bytes)
        self._members = {m.name: _Member(spec=dataclasses.replace(
            m, engine_args=_pooled_engine_args(m.engine_args))) for m in models}
        self._listeners: list[Callable[[PoolEvent], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._swapper: asyncio.Task | None = None
        self._changed: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._closed = False

    @classmethod
    def from_args(cls, paths: Sequence[str], names: Sequence[str] | None,
                  engine_args: EngineArgs, pool_args: PoolArgs | None = None) -> "ModelPool":
        """A pool (not started) of the checkpoints at paths, served as names (None: the
        paths), each engine made of engine_args with that model and its overrides."""
        pool_args = pool_args or PoolArgs()
        names = list(names or paths)
        if len(names) != len(paths):
            raise ValueError(f"give one served model name per model: {len(paths)} models, "
                             f"{len(names)} names ({', '.join(names)})")
        overrides = dict(pool_args.model_overrides or {})
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise ValueError(f"model_overrides names models the pool does not serve: "
                             f"{', '.join(unknown)} (it serves {', '.join(names)})")
        levels = pool_args.sleep_levels(len(paths))
        models = [PoolModel(name, dataclasses.replace(engine_args, model=str(path),
                                                      **overrides.get(name, {})), level)
                  for path, name, level in zip(paths, names, levels)]
        budget = pool_args.device_memory_budget
        return cls(models, max_awake_models=pool_args.max_awake_models,
                   device_memory_budget_bytes=None if budget is None else int(budget * 2**30),
                   time_slice_s=pool_args.swap_time_slice)

    # ---- starting and stopping -------------------------------------------------------
    def start(self) -> "ModelPool":
        """Load every model, one at a time with the device to itself; the last one
        loaded stays awake. A model that fails to load stops the start (the ones
        loaded are shut down) with an error naming it."""
        loaded: list[tuple[_Member, LLMEngine]] = []
        try:
            for member in self._members.values():
                for earlier, engine in loaded:
                    if earlier.state is ModelState.AWAKE:
                        self._sleep_at_start(earlier, engine)
                engine, seconds = self._build_engine(member)
                loaded.append((member, engine))
                self._set_awake(member, "load", seconds, level=None)
        except BaseException:
            for member, engine in loaded:
                engine.shutdown()
                member.state, member.level = ModelState.STOPPED, None
            raise
        for member, engine in loaded:
            member.engine = self._wrap(member, engine)
        logger.info("model pool ready: %s", ", ".join(
            f"{m.name} ({m.state.value}{'' if m.level is None else f', level {m.level}'})"
            for m in self._members.values()))
        return self

    def _sleep_at_start(self, member: _Member, engine: LLMEngine) -> None:
        level = self._level_for(member)
        start = time.monotonic()
        engine.sleep(level, PauseMode.KEEP)
        self._set_asleep(member, level, time.monotonic() - start)

    def _build_engine(self, member: _Member) -> tuple[LLMEngine, float]:
        """(Any thread.) A new engine for member, awake, with its memory measured; and
        the seconds it took. The caller marks the member awake."""
        start = time.monotonic()
        try:
            engine = LLMEngine.from_engine_args(member.spec.engine_args)
        except ValueError as e:  # a bad configuration: the CLI reports it as one
            raise ValueError(f"model {member.name!r} failed to load: {e}") from e
        except Exception as e:
            raise RuntimeError(f"model {member.name!r} failed to load: {e!r}") from e
        try:
            self._measure(member, engine)
        except BaseException:
            engine.shutdown()
            raise
        member.config = engine.config
        return engine, time.monotonic() - start

    def _measure(self, member: _Member, engine: LLMEngine) -> None:
        workers = engine.core.sleep_state()["workers"]
        member.weight_bytes = sum(w["device_bytes"].get("weights", 0) for w in workers)
        member.device_bytes = sum(sum(w["device_bytes"].values()) for w in workers)
        budget = self.device_memory_budget_bytes
        if budget is not None and member.device_bytes > budget:
            raise ValueError(
                f"model {member.name!r} holds {_gib(member.device_bytes)} of device memory "
                f"awake (weights {_gib(member.weight_bytes)} + KV cache), more than the whole "
                f"device_memory_budget ({_gib(budget)}): raise the budget, or give the model "
                "a smaller gpu_memory_utilization / kv_cache_memory_bytes")

    def _wrap(self, member: _Member, engine: LLMEngine) -> AsyncLLM:
        wrapped = AsyncLLM(engine)
        for stat_logger in member.stat_loggers:
            wrapped.add_stat_logger(stat_logger)
        return wrapped

    def shutdown(self) -> None:
        """Stop every engine and the swapper. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._swapper is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._swapper.cancel)
        for member in self._members.values():
            for waiter in member.waiters:
                _settle(waiter.future, ModelUnavailableError("the model pool was shut down"))
            if member.engine is not None:
                member.engine.shutdown()
            member.state = ModelState.STOPPED

    # ---- what users call -------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._members)

    def engine(self, name: str) -> PooledEngine:
        """The model's engine handle (add_request, generate, call, with_tokenizer)."""
        return PooledEngine(self, self._member(name))

    async def generate(self, name: str, prompt: PromptType,
                       params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's cumulative outputs from model name (waking it first
        when it sleeps)."""
        async for output in self.engine(name).generate(prompt, params, request_id):
            yield output

    async def sleep(self, name: str, level: int | None = None) -> None:
        """Put an awake model to sleep now (None: its configured level); requests in
        flight freeze. It wakes again when a request needs it."""
        member = self._member(name)
        if level is not None and level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._ensure_swapper()
        async with self._lock:
            if member.state is not ModelState.AWAKE:
                raise ValueError(f"model {name!r} is {member.state.value}, not awake: "
                                 "nothing to put to sleep")
            await self._put_to_sleep(member, level or self._level_for(member))
        self._raise_if_failed(member)

    async def wake_up(self, name: str) -> None:
        """Wake a model now, putting others to sleep as the limits require (by the same
        policy as a request's wake: it may wait for a busy model's time slice)."""
        member = self._member(name)
        await self._wait_for(member, takes_lease=False)

    async def restart(self, name: str) -> None:
        """Give a model a fresh engine (after a failure, or at will: its requests in
        flight are aborted). Returns once the new engine is awake."""
        member = self._member(name)
        self._ensure_swapper()
        async with self._lock:
            old, member.engine = member.engine, None
            member.state, member.error = ModelState.STOPPED, None
            member.leases, member.frozen_since, member.level = 0, None, None
            member.stats.restarts += 1
            self._emit("restart", member)
            if old is not None:
                await asyncio.to_thread(old.shutdown)
        await self._wait_for(member, takes_lease=False)

    async def check_health(self, name: str) -> None:
        """Raise if the model cannot serve: failed, restarting, or its engine unwell."""
        member = self._member(name)
        self._raise_if_failed(member)
        engine = self._engine_of(member)
        try:
            await engine.check_health()
        except Exception as e:
            self._fail(member, f"its engine is not healthy: {e}")
            raise ModelUnavailableError(f"model {name!r} failed: {member.error}") from e

    def status(self) -> list[dict[str, Any]]:
        """Per model: state, sleep level, memory, requests in flight and queued, error,
        and the swap statistics."""
        return [self.model_status(name) for name in self._members]

    def model_status(self, name: str) -> dict[str, Any]:
        m = self._member(name)
        self._reap_dead([m])
        return {"name": m.name, "state": m.state.value, "sleep_level": m.level,
                "device_bytes": m.device_bytes, "weight_bytes": m.weight_bytes,
                "requests_in_flight": m.leases, "requests_queued": len(m.waiters),
                "error": m.error, "stats": dataclasses.asdict(m.stats)}

    def config(self, name: str) -> EngineConfig:
        return self._member(name).config

    def add_stat_logger(self, name: str, stat_logger: StatLogger) -> None:
        """stat_logger records the model's engine, and each engine a restart builds."""
        member = self._member(name)
        member.stat_loggers.append(stat_logger)
        if member.engine is not None:
            member.engine.add_stat_logger(stat_logger)

    def remove_stat_logger(self, name: str, stat_logger: StatLogger) -> None:
        member = self._member(name)
        member.stat_loggers = [s for s in member.stat_loggers if s is not stat_logger]
        if member.engine is not None:
            member.engine.remove_stat_logger(stat_logger)

    def add_listener(self, listener: Callable[[PoolEvent], None]) -> None:
        """listener(event) on every swap, queue wait, failure and state change."""
        self._listeners.append(listener)

    def abort_all_nowait(self) -> None:
        for member in self._members.values():
            if member.engine is not None and not member.engine.is_dead:
                member.engine.abort_all_nowait()

    # ---- admission ------------------------------------------------------------------
    def _member(self, name: str) -> _Member:
        try:
            return self._members[name]
        except KeyError:
            raise ValueError(f"the pool has no model {name!r}; it has "
                             f"{', '.join(repr(n) for n in self._members)}") from None

    def _engine_of(self, member: _Member) -> AsyncLLM:
        self._raise_if_failed(member)
        if member.engine is None:
            raise ModelUnavailableError(f"model {member.name!r} is {member.state.value} (its "
                                        "engine is being restarted); retry shortly")
        return member.engine

    def _raise_if_failed(self, member: _Member) -> None:
        if self._closed:
            raise ModelUnavailableError("the model pool was shut down")
        self._reap_dead([member])
        if member.state is ModelState.FAILED:
            raise ModelUnavailableError(f"model {member.name!r} failed ({member.error}) and "
                                        "serves no requests until it is restarted")

    async def _acquire(self, member: _Member) -> _Lease:
        """A lease on member once it is awake (at once when it is)."""
        waited = await self._wait_for(member, takes_lease=True)
        if waited is not None:
            member.stats.queued_requests += 1
            member.stats.queue_seconds += waited
            self._emit("queued", member, seconds=waited)
        return _Lease(self, member)

    async def _wait_for(self, member: _Member, takes_lease: bool) -> float | None:
        """Return once member is awake: at once (None) when it is, else after queueing
        (the seconds waited). A lease-taking waiter holds a lease once this returns."""
        self._raise_if_failed(member)
        self._ensure_swapper()  # (it also notices engines that die)
        if member.state is ModelState.AWAKE:
            if takes_lease:
                member.leases += 1
                member.last_used = time.monotonic()
            return None
        waiter = _Waiter(asyncio.get_running_loop().create_future(), time.monotonic(),
                         takes_lease)
        member.waiters.append(waiter)
        self._poke()
        try:
            await waiter.future
        except asyncio.CancelledError:
            granted = waiter.future.done() and not waiter.future.cancelled() \
                and waiter.future.exception() is None
            if granted and takes_lease:  # granted, then cancelled before it resumed
                _Lease(self, member).release()
            raise
        finally:
            if waiter in member.waiters:
                member.waiters.remove(waiter)
                self._poke()
        return time.monotonic() - waiter.since

    # ---- the swapper ------------------------------------------------------------------
    def _ensure_swapper(self) -> None:
        if self._closed:
            raise ModelUnavailableError("the model pool was shut down")
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._swapper is not None and not self._swapper.done():
            return
        # A new event loop (or the first one): asyncio primitives belong to one loop.
        self._loop, self._changed, self._lock = loop, asyncio.Event(), asyncio.Lock()
        self._swapper = loop.create_task(self._swap_loop(), name="spindle-model-pool")

    def _poke(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _swap_loop(self) -> None:
        while not self._closed:
            self._changed.clear()
            try:
                async with self._lock:
                    delay = await self._rebalance()
            except Exception:  # a bug here must not stall every model: log, go on
                logger.exception("the model pool's swapper failed; retrying")
                delay = _POLL_S
            if delay == 0:
                continue
            try:
                async with asyncio.timeout(_POLL_S if delay is None else min(delay, _POLL_S)):
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def _rebalance(self) -> float | None:
        """One decision: wake (or load) the model first in line, or put one to sleep to
        make room for it. 0: act again at once; else the seconds until a busy model's
        time slice ends (None: nothing waits)."""
        self._reap_dead()
        candidate = self._first_in_line()
        if candidate is None:
            return None
        if self._fits(candidate):
            await self._bring_up(candidate)
            return 0
        victim, wait = self._choose_victim(time.monotonic())
        if victim is None:
            return wait
        await self._put_to_sleep(victim, self._level_for(victim))
        return 0

    def _reap_dead(self, members: Sequence[_Member] | None = None) -> None:
        """Mark the members (None: all) whose engine died as failed."""
        if self._closed:
            return
        for member in self._members.values() if members is None else members:
            if member.engine is not None and member.engine.is_dead \
                    and member.state is not ModelState.FAILED:
                self._fail(member, f"its engine died: {member.engine.error}")

    def _first_in_line(self) -> _Member | None:
        waiting = [m for m in self._members.values()
                   if m.state in (ModelState.ASLEEP, ModelState.STOPPED)
                   and m.demand_since is not None]
        return min(waiting, key=lambda m: m.demand_since) if waiting else None

    def _awake(self) -> list[_Member]:
        return [m for m in self._members.values() if m.state is ModelState.AWAKE]

    def _fits(self, candidate: _Member) -> bool:
        awake = self._awake()
        if len(awake) >= self.max_awake_models:
            return False
        budget = self.device_memory_budget_bytes
        return budget is None or sum(m.device_bytes for m in awake) \
            + candidate.device_bytes <= budget

    def _choose_victim(self, now: float) -> tuple[_Member | None, float | None]:
        """The awake model to put to sleep: an idle one (least recently used first),
        else a busy one whose time slice is over (awake longest first). Otherwise
        (None, seconds until the first slice ends)."""
        awake = self._awake()
        idle = [m for m in awake if m.leases == 0]
        if idle:
            return min(idle, key=lambda m: m.last_used), None
        if not awake:
            return None, None
        ends = {id(m): m.awake_since + self.time_slice_s for m in awake}
        over = [m for m in awake if ends[id(m)] <= now]
        if over:
            return min(over, key=lambda m: m.awake_since), None
        return None, max(0.01, min(ends.values()) - now)

    async def _bring_up(self, member: _Member) -> None:
        """Wake member (or load it, when it has no engine), then let its queue in."""
        previous_level = member.level
        if member.engine is None:
            member.state = ModelState.LOADING
            self._emit("state", member)
            try:
                engine, seconds = await asyncio.to_thread(self._build_engine, member)
            except Exception as e:
                self._fail(member, f"loading failed: {e}")
                return
            member.engine = self._wrap(member, engine)
            self._set_awake(member, "load", seconds, level=None)
        else:
            member.state = ModelState.WAKING
            self._emit("state", member)
            start = time.monotonic()
            try:
                await member.engine.wake_up()
            except Exception as e:
                self._fail(member, f"waking failed: {e}")
                return
            self._set_awake(member, "wake", time.monotonic() - start, previous_level)
        for waiter in member.waiters:
            if not waiter.future.done():
                if waiter.takes_lease:
                    member.leases += 1
                waiter.future.set_result(None)

    async def _put_to_sleep(self, member: _Member, level: int) -> None:
        member.state = ModelState.SLEEPING
        self._emit("state", member)
        start = time.monotonic()
        try:
            await member.engine.sleep(level, PauseMode.KEEP)
        except Exception as e:
            self._fail(member, f"going to sleep failed: {e}")
            return
        self._set_asleep(member, level, time.monotonic() - start)

    def _set_awake(self, member: _Member, kind: str, seconds: float,
                   level: int | None) -> None:
        now = time.monotonic()
        if kind == "load":  # a new engine: what the old one admitted is not its business
            member.generation += 1
            member.leases, member.error = 0, None
        member.state, member.level, member.frozen_since = ModelState.AWAKE, None, None
        member.awake_since = member.last_used = now
        if kind == "load":
            member.stats.load_seconds = seconds
        if kind == "wake":
            member.stats.wakes += 1
            member.stats.wake_seconds += seconds
            member.stats.last_wake_seconds = seconds
        self._emit(kind, member, seconds=seconds, level=level)
        logger.info("model %s %s in %.3f s", member.name,
                    "loaded" if kind == "load" else f"woke from level {level}", seconds)

    def _set_asleep(self, member: _Member, level: int, seconds: float) -> None:
        member.state, member.level = ModelState.ASLEEP, level
        member.frozen_since = time.monotonic() if member.leases else None
        member.stats.sleeps += 1
        member.stats.sleep_seconds += seconds
        self._emit("sleep", member, seconds=seconds, level=level)
        logger.info("model %s asleep (level %d) in %.3f s%s", member.name, level, seconds,
                    f", {member.leases} request(s) frozen" if member.leases else "")

    def _level_for(self, member: _Member) -> int:
        """The sleep level for member now: its fixed one, or for "auto" 1 while the host
        keeps host_memory_reserve_bytes free beside a copy of the weights, else 2."""
        level = member.spec.sleep_level
        if level != "auto":
            return int(level)
        available = psutil.virtual_memory().available
        return 1 if available - member.weight_bytes >= self.host_memory_reserve_bytes else 2

    def _fail(self, member: _Member, reason: str) -> None:
        if member.state is ModelState.FAILED:
            return
        logger.error("model %s failed: %s; its requests fail, the other models serve on",
                     member.name, reason)
        member.state, member.error = ModelState.FAILED, reason
        member.stats.failures += 1
        error = ModelUnavailableError(f"model {member.name!r} failed ({reason}) and serves no "
                                      "requests until it is restarted")
        for waiter in member.waiters:
            _settle(waiter.future, error)
        self._emit("failed", member)
        if member.engine is not None:  # its workers may hold device memory: stop them
            threading.Thread(target=member.engine.shutdown, name=f"spindle-stop-{member.name}",
                             daemon=True).start()

    def _emit(self, kind: str, member: _Member, seconds: float | None = None,
              level: int | None = None) -> None:
        event = PoolEvent(kind, member.name, member.state, seconds, level)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("model pool listener %r failed", listener)


def _settle(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _pooled_engine_args(args: EngineArgs) -> EngineArgs:
    """A pool engine sleeps, and runs its workers in processes of their own (the mp
    executor, unless another is asked for), so one model's fault stays its own."""
    return dataclasses.replace(args, enable_sleep_mode=True,
                               distributed_executor_backend=args.distributed_executor_backend
                               or "mp")


def _check_pool_args(models: Sequence[PoolModel], max_awake_models: int,
                     budget: int | None, time_slice_s: float, reserve: int | None) -> None:
    if not models:
        raise ValueError("a model pool needs at least one model")
    names = [m.name for m in models]
    for m in models:
        if not isinstance(m.name, str) or not m.name:
            raise ValueError(f"every pool model needs a non-empty name, got {m.name!r}")
        if m.sleep_level not in SLEEP_LEVEL_CHOICES:
            raise ValueError(f"model {m.name!r}: sleep_level must be one of "
                             f"{', '.join(map(str, SLEEP_LEVEL_CHOICES))}, got {m.sleep_level!r}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"pool model names must be unique; repeated: {', '.join(duplicates)}")
    if isinstance(max_awake_models, bool) or not isinstance(max_awake_models, int) \
            or max_awake_models < 1:
        raise ValueError(f"max_awake_models must be an integer >= 1, got {max_awake_models!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget <= 0):
        raise ValueError(f"device_memory_budget_bytes must be a positive integer, got {budget!r}")
    if not isinstance(time_slice_s, (int, float)) or not time_slice_s >= 0:
        raise ValueError(f"time_slice_s must be >= 0 seconds, got {time_slice_s!r}")
    if reserve is not None and (not isinstance(reserve, int) or reserve < 0):
        raise ValueError(f"host_memory_reserve_bytes must be >= 0, got {reserve!r}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
