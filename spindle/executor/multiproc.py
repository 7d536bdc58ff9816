"""MultiProcExecutor: one worker process per device; fails fast, never hangs.

Per worker process (started with multiprocessing, by fork or spawn: start_method.py):
- a readiness pipe: READY, or the worker's startup error (later: a fatal error);
- a death pipe: the worker exits when it reads EOF, i.e. when this process is gone;
- a reply pipe: replies of that rank, only when it is asked (errors always).
Calls go out once, through a shared-memory broadcast ring read by every worker
(distributed/shm_broadcast.py). Tensors move between workers through
torch.distributed (the platform's backend: gloo on CPU, NCCL on CUDA), which meets
through a FileStore in a private temporary directory: no port, no fixed name.

Invariants:
- every wait is on (reply pipes, worker sentinels, the executor's wakeup pipe), with
  a deadline where one applies: a worker's death wakes any waiter at once;
- replies resolve calls strictly in call order (non_block futures too);
- the first failure (a death, a fatal error a worker reports, a step past its
  timeout) is final (Executor._fail): every pending and later call raises
  ExecutorFailedError naming the rank and its exit code, failure callbacks run
  once, and the other workers are shut down;
- shutdown: a SHUTDOWN message, a grace period, the death pipes closed, SIGTERM,
  SIGKILL; then the shared memory and the store directory are removed.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from spindle.distributed.shm_broadcast import BroadcastRing
from spindle.executor.abstract import Executor
from spindle.executor.config_snapshot import config_for_workers
from spindle.executor.devices import worker_device_indices
from spindle.executor.errors import ExecutorFailedError, describe_exitcode
from spindle.executor.heartbeat import HeartbeatBoard
from spindle.executor.multiproc_worker import (FAILED, READY, SHUTDOWN, RpcReply, RpcRequest,
                                               WorkerProcSpec, worker_main)
from spindle.executor.start_method import (EXIT_MAIN_SCRIPT_RERUN, main_script_rerun_error,
                                           resolve_start_method, running_main_script_in_child,
                                           stop_main_script_rerun, tokenizers_quiet_in_child)
from spindle.platforms import resolve_platform
from spindle.worker.worker import Heartbeat

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1200.0  # init_device + load_model of the slowest rank
SHUTDOWN_GRACE_S = 5.0  # a clean exit after SHUTDOWN
KILL_GRACE_S = 2.0  # after closing the death pipes, then after SIGTERM


def worker_threads(world_size: int, requested: int | None = None) -> int:
    """Torch threads per worker: requested (EngineArgs.cpu_threads) if set, else the
    cores this process may use, split between the workers, so that N workers on one
    host do not oversubscribe it."""
    return requested or max(1, len(os.sched_getaffinity(0)) // world_size)


@dataclass
class _WorkerHandle:
    rank: int
    process: Any  # multiprocessing SpawnProcess
    ready_conn: Connection  # read end
    death_conn: Connection  # write end (closing it tells the worker to exit)
    reply_conn: Connection  # read end


class MultiProcExecutor(Executor):
    supports_async_scheduling = True  # workers run steps in order, from the ring
    supports_pipeline_parallel = True

    # ---- startup ------------------------------------------------------------------------
    def _init_executor(self) -> None:
        if running_main_script_in_child():
            stop_main_script_rerun()  # a spawned child's re-run of an unguarded script
        parallel = self.config.parallel
        platform = resolve_platform(self.config.device.device_type)
        device_indices = worker_device_indices(parallel, platform)  # raises before any process
        self.start_method, self._start_method_reason = resolve_start_method(
            parallel.worker_start_method, platform)
        self._state_lock = threading.Lock()  # pending calls
        self._send_lock = threading.Lock()  # ring writes in call order; closing the ring
        self._recv_lock = threading.Lock()  # one thread reads replies at a time
        self._teardown_lock = threading.Lock()
        self._death_lock = threading.Lock()
        self._board_lock = threading.Lock()  # heartbeat reads against closing the board
        self._final_beats: list[Heartbeat] | None = None
        self._pending: deque[_RpcFuture] = deque()
        self._by_id: dict[int, _RpcFuture] = {}
        self._call_ids = itertools.count(1)
        self._torn_down = False
        # Written once (failure or shutdown) and never drained: a level-triggered flag
        # that every wait includes.
        self._wakeup_r, self._wakeup_w = os.pipe()
        self._workers: list[_WorkerHandle] = []
        self._run_dir = tempfile.mkdtemp(prefix="spindle-mp-")
        self.ring = BroadcastRing(self.world_size)
        self.board = HeartbeatBoard(self.world_size)
        self._monitor: threading.Thread | None = None
        _LIVE.add(self)
        try:
            self._start_workers(device_indices)
            self._wait_until_ready()
        except BaseException:
            self._closing = True
            self._teardown(grace=0.0)
            _LIVE.discard(self)
            self._close_pipes()
            raise
        self._monitor = threading.Thread(target=self._monitor_workers, daemon=True,
                                         name="spindle-mp-monitor")
        self._monitor.start()

    def _start_workers(self, device_indices: list[int]) -> None:
        fork = self.start_method == "fork"
        ctx = multiprocessing.get_context(self.start_method)
        store = os.path.join(self._run_dir, "store")
        init_method = f"file://{store}" if self.world_size > 1 else None
        threads = worker_threads(self.world_size, self.config.device.cpu_threads)
        config = config_for_workers(self.config)  # spawned workers start without transformers
        for rank, device_index in enumerate(device_indices):
            ready_r, ready_w = ctx.Pipe(duplex=False)
            death_r, death_w = ctx.Pipe(duplex=False)
            reply_r, reply_w = ctx.Pipe(duplex=False)
            parent_ends = [ready_r.fileno(), death_w.fileno(), reply_r.fileno()]
            spec = WorkerProcSpec(config, rank, device_index, init_method, threads,
                                  self.ring.reader_handle(rank), self.board.name, self._run_dir,
                                  ready_w, death_r, reply_w,
                                  inherited_fds=tuple(_executor_fds() + parent_ends) if fork
                                  else ())
            process = ctx.Process(target=worker_main, args=(spec,), daemon=True,
                                  name=f"spindle-worker-{rank}")
            with tokenizers_quiet_in_child() if fork else contextlib.nullcontext():
                process.start()
            for child_end in (ready_w, death_r, reply_w):
                child_end.close()  # only the child holds these now: its death reads as EOF
            self._workers.append(_WorkerHandle(rank, process, ready_r, death_w, reply_r))
        self.ring.release_reader_ends()
        logger.info("started %d worker processes by %s (%s; pids %s), %d torch threads each",
                    self.world_size, self.start_method, self._start_method_reason,
                    [h.process.pid for h in self._workers], threads)

    def _open_fds(self) -> list[int]:
        """The descriptors this executor holds in this process (a forked worker closes
        its copies)."""
        fds = [self._wakeup_r, self._wakeup_w] + self.ring.open_fds()
        for h in self._workers:
            fds += [c.fileno() for c in (h.ready_conn, h.death_conn, h.reply_conn) if not c.closed]
        return fds

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = {h.rank: h for h in self._workers}
        while waiting:
            objects = [h.ready_conn for h in waiting.values()]
            objects += [h.process.sentinel for h in waiting.values()]
            ready = wait(objects, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise ExecutorFailedError(
                    f"workers {sorted(waiting)} not ready after {STARTUP_TIMEOUT_S:.0f}s: "
                    f"{self._describe_ranks(sorted(waiting))}")
            for h in list(waiting.values()):
                if h.ready_conn not in ready and h.process.sentinel not in ready:
                    continue
                status = _read_status(h.ready_conn)
                if status is not None and status[0] == READY:
                    del waiting[h.rank]
                elif status is not None and status[0] == FAILED:
                    raise ExecutorFailedError(
                        f"worker rank {h.rank} failed during startup: {status[1]}", rank=h.rank)
                elif not h.process.is_alive() or status is None:
                    h.process.join(timeout=1.0)
                    if h.process.exitcode == EXIT_MAIN_SCRIPT_RERUN:
                        raise ExecutorFailedError(
                            main_script_rerun_error(self._start_method_reason), rank=h.rank,
                            exitcode=h.process.exitcode)
                    raise ExecutorFailedError(
                        f"worker rank {h.rank} (pid {h.process.pid}) died during startup with "
                        f"{describe_exitcode(h.process.exitcode)}", rank=h.rank,
                        exitcode=h.process.exitcode)

    # ---- calls ----------------------------------------------------------------------------
    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, non_block: bool = False) -> Any:
        future = self._submit(method, tuple(args), kwargs or {}, unique_reply_rank, timeout)
        return future if non_block else future.result()

    def _submit(self, method: str | Callable, args: tuple, kwargs: dict,
                unique_reply_rank: int | None, timeout: float | None) -> "_RpcFuture":
        payload, name = self._prepare_call(method, unique_reply_rank)
        ranks = range(self.world_size) if unique_reply_rank is None else (unique_reply_rank,)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._send_lock:
            self._raise_if_unusable()
            call_id = next(self._call_ids)
            future = _RpcFuture(self, call_id, name, tuple(ranks), unique_reply_rank is not None,
                                timeout, deadline)
            with self._state_lock:
                self._pending.append(future)
                self._by_id[call_id] = future
            try:
                self.ring.enqueue(RpcRequest(call_id, payload, args, kwargs, unique_reply_rank,
                                             label=name), abort=self._unusable)
            except BaseException:
                with self._state_lock:
                    if self._by_id.pop(call_id, None) is not None:
                        self._pending.remove(future)
                raise
        return future

    def _resolve_until(self, future: "_RpcFuture", timeout: float | None) -> None:
        """Read replies, resolving calls in order, until future is done, its own
        deadline passed (it then fails with TimeoutError, even while earlier calls are
        still pending), or timeout (of this wait) passes."""
        user_deadline = None if timeout is None else time.monotonic() + timeout
        while not future.done():
            limit = _earliest(user_deadline, future.deadline)
            wait_s = -1 if limit is None else max(0.0, limit - time.monotonic())
            if not self._recv_lock.acquire(timeout=wait_s):
                self._expire_if_late(future)
                if not future.done():
                    return
                continue
            try:
                if not self._read_replies_once(future, user_deadline):
                    return
            finally:
                self._recv_lock.release()

    def _read_replies_once(self, target: "_RpcFuture", user_deadline: float | None) -> bool:
        """One wait for replies, deaths or the wakeup flag, then resolve what completed.
        False when user_deadline passed."""
        head = self._head()
        if head is None:
            return True  # everything resolved (or failed) meanwhile
        deadline = _earliest(head.deadline, target.deadline, user_deadline)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = set(wait(self._wait_objects(), timeout=timeout))
        replies: list[RpcReply] = []
        for h in self._workers:
            if h.reply_conn in ready:
                replies += self._drain_reply_pipe(h)
        fatal = sorted((r for r in replies if r.fatal), key=lambda r: r.failed_at)
        if fatal:
            self._fail_fatal(fatal[0])  # the earliest: later ones are its consequences
        for reply in replies:
            self._route(reply)
        for h in self._workers:
            if h.process.sentinel in ready:
                self._on_worker_death(h.rank)
        self._resolve_completed()
        self._expire_if_late(head)
        self._expire_if_late(target)
        if not target.done() and user_deadline is not None and time.monotonic() >= user_deadline:
            return False
        return True

    def _wait_objects(self) -> list:
        objects: list = [self._wakeup_r]
        for h in self._workers:
            objects += [h.reply_conn, h.process.sentinel]
        return objects

    def _drain_reply_pipe(self, h: _WorkerHandle) -> list[RpcReply]:
        replies = []
        try:
            while h.reply_conn.poll():
                replies.append(h.reply_conn.recv())
        except (EOFError, OSError):
            pass  # the pipe closed: the process is exiting, its sentinel reports it
        return replies

    def _fail_fatal(self, reply: RpcReply) -> None:
        with self._state_lock:
            future = self._by_id.get(reply.call_id)
        name = future.name if future is not None else "a call"
        self._fail(ExecutorFailedError(f"worker rank {reply.rank} failed in {name} (fatal: the "
                                       f"worker exits): {reply.value}", rank=reply.rank))

    def _route(self, reply: RpcReply) -> None:
        if reply.fatal:
            return  # handled by _fail_fatal
        with self._state_lock:
            future = self._by_id.get(reply.call_id)
        if future is None:
            return  # a late reply to a call that timed out
        if not reply.ok:
            future.error = future.error or RuntimeError(
                f"worker rank {reply.rank}: {future.name} raised {reply.value}")
        else:
            future.replies[reply.rank] = reply.value

    def _resolve_completed(self) -> None:
        """Resolve head calls that are complete, in order."""
        while True:
            with self._state_lock:
                if not self._pending or not self._pending[0].complete():
                    return
                future = self._pending.popleft()
                del self._by_id[future.call_id]
            future.finish()

    def _expire_if_late(self, future: "_RpcFuture") -> None:
        if (not future.done() and future.deadline is not None
                and time.monotonic() >= future.deadline):
            self._expire(future)

    def _expire(self, future: "_RpcFuture") -> None:
        with self._state_lock:
            if self._by_id.pop(future.call_id, None) is None:
                return
            self._pending.remove(future)
        missing = [r for r in future.ranks if r not in future.replies]
        # Every rank's whereabouts: a silent rank may be waiting on another one.
        future.set_exception(TimeoutError(
            f"collective_rpc({future.name!r}): rank(s) {missing} did not answer within "
            f"{future.timeout}s; {self._describe_ranks(list(range(self.world_size)))}"))

    def _head(self) -> "_RpcFuture | None":
        if self._failure is not None or self._closing:
            self._fail_pending()
            return None
        with self._state_lock:
            return self._pending[0] if self._pending else None

    # ---- failure --------------------------------------------------------------------------
    def _monitor_workers(self) -> None:
        """Wake on the first worker death (or on the wakeup flag) and report it."""
        sentinels = {h.process.sentinel: h.rank for h in self._workers}
        ready = wait(list(sentinels) + [self._wakeup_r])
        for obj in ready:
            if obj in sentinels:
                self._on_worker_death(sentinels[obj])
                return

    def _on_worker_death(self, rank: int) -> None:
        with self._death_lock:  # the monitor and a waiting caller may both see it
            error = self._death_error(rank)
        if error is not None:
            self._fail(error)

    def _death_error(self, rank: int) -> ExecutorFailedError | None:
        if self._closing or self._failure is not None:
            return None  # exits during shutdown are expected; only the first failure counts
        h = self._workers[rank]
        status = _read_status(h.ready_conn)  # a fatal error the worker reported, if any
        h.process.join(timeout=1.0)
        code = h.process.exitcode
        if status is not None and status[0] == FAILED:
            message = (f"worker rank {rank} (pid {h.process.pid}) exited with "
                       f"{describe_exitcode(code)} after a fatal error: {status[1]}")
        else:
            beat = self._board_beats()[rank]
            message = (f"worker rank {rank} (pid {h.process.pid}) died unexpectedly with "
                       f"{describe_exitcode(code)}; last in {beat.last_stage} (step "
                       f"{beat.last_step}, {beat.seconds_since:.1f}s before)")
        return ExecutorFailedError(message, rank=rank, exitcode=code)

    def _on_failure(self) -> None:
        """Fail every pending call at once, and wake every waiter."""
        try:
            os.write(self._wakeup_w, b"!")
        except OSError:
            pass  # a shutdown closed the pipes meanwhile: nobody is waiting
        self._fail_pending()

    def _stop_workers(self) -> None:
        self._teardown(grace=0.0)

    def _fail_pending(self) -> None:
        with self._state_lock:
            pending = list(self._pending)
            self._pending.clear()
            self._by_id.clear()
        for future in pending:
            future.set_exception(self._unusable_error())

    # ---- health -----------------------------------------------------------------------------
    def heartbeats(self) -> list[Heartbeat]:
        """Where every rank is, read from shared memory: no call to the workers, so a
        rank stuck inside a collective still answers."""
        beats = self._board_beats()
        for h, beat in zip(self._workers, beats):
            if not h.process.is_alive():
                beats[h.rank] = self._exited_beat(h, beat)
        return beats

    def _board_beats(self) -> list[Heartbeat]:
        with self._board_lock:
            if self._final_beats is not None:
                return list(self._final_beats)  # the board is gone: its last reading
            return [self.board.read(h.rank) for h in self._workers]

    def _exited_beat(self, h: _WorkerHandle, beat: Heartbeat) -> Heartbeat:
        if beat.last_stage.startswith("exited"):
            return beat
        return Heartbeat(rank=h.rank, last_stage=f"exited ({describe_exitcode(h.process.exitcode)}) "
                         f"after {beat.last_stage}", last_step=beat.last_step,
                         seconds_since=beat.seconds_since, busy=False, pid=h.process.pid)

    def _describe_ranks(self, ranks: list[int]) -> str:
        try:
            beats = self.heartbeats()
        except Exception:  # during teardown; the ranks alone still help
            return f"ranks {ranks}"
        return "; ".join(f"rank {b.rank} {'in' if b.busy else 'after'} {b.last_stage} "
                         f"(step {b.last_step}) for {b.seconds_since:.1f}s"
                         for b in beats if b.rank in ranks)

    # ---- shutdown ---------------------------------------------------------------------------
    def _shutdown_workers(self, clean: bool) -> None:
        """SHUTDOWN through the ring (when clean), then _teardown; then the pipes."""
        os.write(self._wakeup_w, b"!")
        if clean:
            try:
                with self._send_lock:
                    self.ring.enqueue(SHUTDOWN, timeout=1.0)
            except Exception:  # a full or closed ring: the signals below still work
                logger.warning("could not send SHUTDOWN to the workers; stopping them by "
                               "signal", exc_info=True)
                clean = False
        self._fail_pending()
        self._teardown(grace=SHUTDOWN_GRACE_S if clean else 0.0)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join()
        _LIVE.discard(self)  # before its descriptors close: a later fork must not close them
        self._close_pipes()

    def _teardown(self, grace: float) -> None:
        """Stop every worker process, then remove the shared memory and the store
        directory. grace 0 (a failure): no clean exit is awaited, SIGTERM goes out at
        once (a worker may still be importing, before its death-pipe thread runs).
        Idempotent; safe from any thread."""
        with self._teardown_lock:
            if self._torn_down:
                return
            processes = [h.process for h in self._workers]
            _join_all(processes, grace)
            for h in self._workers:
                h.death_conn.close()  # the worker's watcher thread exits the process at EOF
            if grace > 0:
                _join_all(processes, KILL_GRACE_S)
            for p in processes:
                if p.is_alive():
                    p.terminate()
            _join_all(processes, KILL_GRACE_S)
            for p in processes:
                if p.is_alive():
                    logger.warning("worker pid %d ignored SIGTERM; sending SIGKILL", p.pid)
                    p.kill()
            _join_all(processes, None)
            with self._send_lock:
                self.ring.close()
            with self._board_lock:
                self._final_beats = [self.board.read(h.rank) for h in self._workers]
                self.board.close()
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._torn_down = True

    def _close_pipes(self) -> None:
        for h in self._workers:
            h.ready_conn.close()
            h.reply_conn.close()
        os.close(self._wakeup_r)
        os.close(self._wakeup_w)

    @property
    def worker_pids(self) -> list[int]:
        return [h.process.pid for h in self._workers]


class _RpcFuture(Future):
    """A call's future. result() reads replies itself (no reader thread), resolving every
    earlier call first, so futures resolve in call order."""

    def __init__(self, executor: MultiProcExecutor, call_id: int, name: str,
                 ranks: tuple[int, ...], single: bool, timeout: float | None,
                 deadline: float | None) -> None:
        super().__init__()
        self._executor = executor
        self.call_id = call_id
        self.name = name
        self.ranks = ranks
        self.single = single
        self.timeout = timeout
        self.deadline = deadline
        self.replies: dict[int, Any] = {}
        self.error: BaseException | None = None

    def complete(self) -> bool:
        return self.error is not None or len(self.replies) == len(self.ranks)

    def finish(self) -> None:
        if self.error is not None:
            self.set_exception(self.error)
        elif self.single:
            self.set_result(self.replies[self.ranks[0]])
        else:
            self.set_result([self.replies[r] for r in self.ranks])

    def result(self, timeout: float | None = None) -> Any:
        self._executor._resolve_until(self, timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._executor._resolve_until(self, timeout)
        return super().exception(timeout=0)


def _read_status(conn: Connection) -> tuple | None:
    """A message waiting on a readiness pipe, or None (nothing, or EOF)."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def _join_all(processes: list, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    for p in processes:
        p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _earliest(*deadlines: float | None) -> float | None:
    present = [d for d in deadlines if d is not None]
    return min(present) if present else None


# Executors still running at interpreter exit: shut down before multiprocessing's own
# exit hook (atexit runs hooks last-registered first), so nothing is left behind.
_LIVE: "weakref.WeakSet[MultiProcExecutor]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_executors() -> None:
    for executor in list(_LIVE):
        executor.shutdown()


def _executor_fds() -> list[int]:
    """The descriptors every live executor of this process holds: what a forked
    worker must close (a pipe reads EOF only once every copy of its other end is
    closed)."""
    return [fd for executor in list(_LIVE) for fd in executor._open_fds()]
