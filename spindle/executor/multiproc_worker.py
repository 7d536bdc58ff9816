"""The worker process of the multi-process executor (the child side).

It drives the same Worker, through the same lifecycle, as the in-process executor;
only the transport differs:
- startup: init_device and load_model run first, then READY (or the error) goes
  back on the readiness pipe;
- calls arrive through the shared-memory broadcast ring, in order; a reply goes
  back on this rank's reply pipe only when this rank is asked (errors always);
- a thread blocks on the death pipe: when the parent goes away, the process exits
  at once, even if the serving thread is stuck inside a collective;
- it serves from a fresh thread, not the process's main thread (a forked child's
  main thread inherits torch's OpenMP pool bookkeeping without its threads; see
  start_method.py for what else a fork copies and how it is handled);
- an exception in execute_model or a lifecycle stage is fatal (its peers may be
  waiting in a collective that will never complete): it is reported, then the
  process exits. An exception in any other call is reported and serving goes on.

Nothing here knows what a step computes.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from spindle.config import EngineConfig
from spindle.distributed.shm_broadcast import RingHandle, RingReader

logger = logging.getLogger(__name__)

READY = "ready"
FAILED = "failed"
SHUTDOWN = "shutdown"  # the message that ends the serve loop
FATAL_METHODS = frozenset({"init_device", "load_model", "determine_available_memory",
                           "allocate_kv_cache", "warmup", "freeze_gc_heap", "execute_model"})
EXIT_OK = 0
EXIT_FATAL = 1  # a fatal error, reported before exiting
EXIT_STARTUP_FAILED = 2
EXIT_PARENT_DIED = 3


@dataclass
class RpcRequest:
    call_id: int
    method: str | bytes  # a Worker method name, or a cloudpickled fn(worker, *args, **kwargs)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    reply_rank: int | None = None  # None: every rank replies
    label: str = ""  # the function's name, for heartbeats and errors

    @property
    def name(self) -> str:
        return self.method if isinstance(self.method, str) else (self.label or "<callable>")


@dataclass
class RpcReply:
    call_id: int
    rank: int
    ok: bool
    value: Any  # the result, or the error text (with the worker's traceback)
    fatal: bool = False  # the worker exits after sending this
    # time.monotonic() (system-wide) when it failed: when several ranks fail at once
    # (a peer's collective breaks because the first one left), the earliest is the cause.
    failed_at: float = 0.0


@dataclass
class WorkerProcSpec:
    """Everything one worker process needs; pickled once at spawn, copied by fork."""

    config: EngineConfig
    rank: int
    device_index: int
    distributed_init_method: str | None
    num_threads: int
    ring: RingHandle
    heartbeat_name: str
    run_dir: str  # the executor's private directory (the rendezvous store)
    ready_conn: Connection  # write end: READY, or FAILED and the error; later a fatal error
    death_conn: Connection  # read end: EOF when the parent is gone
    reply_conn: Connection  # write end: RpcReply
    # Forked workers: descriptors of this process's executors that the fork copied
    # (the parent's pipe ends); the child closes them first.
    inherited_fds: tuple[int, ...] = ()


def worker_main(spec: WorkerProcSpec) -> None:
    """Entry point of a worker process, forked or spawned. Never returns."""
    _close_inherited_fds(spec)
    _exit_when_parent_dies(spec.death_conn, spec.run_dir)
    # Ctrl-C reaches the whole process group: the parent decides, workers do not die mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a fork copies the parent's handler
    result: list[int] = []
    serving = threading.Thread(target=lambda: result.append(_run(spec)), name="spindle-worker")
    serving.start()
    serving.join()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destructors of communicators whose peers are gone can abort.
    os._exit(result[0] if result else EXIT_FATAL)


def _run(spec: WorkerProcSpec) -> int:
    try:
        return WorkerProc(spec).run()
    except BaseException:  # a bug of this module: still tell the executor what happened
        try:
            spec.ready_conn.send((FAILED, _error_text(spec.rank, "the worker process")))
        except OSError:
            pass
        return EXIT_FATAL


def _close_inherited_fds(spec: WorkerProcSpec) -> None:
    """Close the parent's pipe ends a fork copied: while this process held a copy of
    its own death pipe's write end, it would never read EOF there."""
    keep = {spec.ready_conn.fileno(), spec.death_conn.fileno(), spec.reply_conn.fileno(),
            spec.ring.wakeup.fileno()}
    for fd in spec.inherited_fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # already closed in the parent before the fork


class WorkerProc:
    def __init__(self, spec: WorkerProcSpec) -> None:
        from spindle.executor.heartbeat import HeartbeatBoard
        from spindle.worker.worker import Worker

        self.spec = spec
        self.rank = spec.rank
        self.board = HeartbeatBoard(spec.config.parallel.world_size, name=spec.heartbeat_name)
        self.worker = Worker(spec.config, rank=spec.rank, local_rank=spec.device_index,
                             distributed_init_method=spec.distributed_init_method)
        self.ring: RingReader | None = None

    def run(self) -> int:
        if not self._start():
            return EXIT_STARTUP_FAILED
        try:
            code = self._serve()
        except EOFError:  # the ring's writer is gone: the parent died
            # (as the death-pipe thread does, which may lose the race to exit first)
            shutil.rmtree(self.spec.run_dir, ignore_errors=True)
            return EXIT_PARENT_DIED
        if code == EXIT_OK:
            self._close()  # a fatal exit skips this: peers may still be inside a collective
        return code

    # ---- startup --------------------------------------------------------------------
    def _start(self) -> bool:
        import torch

        try:
            torch.set_num_threads(self.spec.num_threads)
            self.ring = RingReader(self.spec.ring)
            for stage in ("init_device", "load_model"):
                self._beat(stage, busy=True)
                getattr(self.worker, stage)()
            self._beat("ready", busy=False)
        except BaseException:
            self._beat("startup failed", busy=False)
            self.spec.ready_conn.send((FAILED, _error_text(self.rank, "startup")))
            return False
        self.spec.ready_conn.send((READY, os.getpid()))
        return True

    # ---- serving --------------------------------------------------------------------
    def _serve(self) -> int:
        while True:
            try:
                request = self.ring.dequeue()
            except EOFError:
                raise
            except Exception:  # a call this process cannot even decode: nobody to answer
                self.spec.ready_conn.send((FAILED, _error_text(self.rank, "decoding a call")))
                return EXIT_FATAL
            if request == SHUTDOWN:
                return EXIT_OK
            reply = self._handle(request)
            if reply is not None:
                self._send(reply)
            if reply is not None and reply.fatal:
                # Also on the readiness pipe: the executor's monitor reads it when it
                # sees this process exit, whichever thread notices first.
                self.spec.ready_conn.send((FAILED, reply.value))
                return EXIT_FATAL

    def _send(self, reply: RpcReply) -> None:
        try:
            self.spec.reply_conn.send(reply)  # pickles fully before writing a byte
        except Exception:
            self.spec.reply_conn.send(RpcReply(reply.call_id, self.rank, False,
                                               _error_text(self.rank, "sending the reply")))

    def _handle(self, request: RpcRequest) -> RpcReply | None:
        asked = request.reply_rank is None or request.reply_rank == self.rank
        try:
            fn = self._resolve(request.method)
        except BaseException:
            return RpcReply(request.call_id, self.rank, False, _error_text(self.rank, request.name))
        step = _step_of(request, self.worker.heartbeat().last_step)
        self._beat(request.name, busy=True, step=step)
        try:
            value = fn(*request.args, **request.kwargs)
        except BaseException:
            fatal = request.name in FATAL_METHODS
            self._beat(f"{request.name} failed", busy=False, step=step)
            return RpcReply(request.call_id, self.rank, False, _error_text(self.rank, request.name),
                            fatal=fatal, failed_at=time.monotonic())
        self._beat(request.name, busy=False, step=step)
        return RpcReply(request.call_id, self.rank, True, value) if asked else None

    def _resolve(self, method: str | bytes):
        if isinstance(method, str):
            if method.startswith("_"):
                raise AttributeError(f"{method!r} is private: collective_rpc calls public methods")
            return getattr(self.worker, method)
        import cloudpickle

        fn = cloudpickle.loads(method)
        return lambda *args, **kwargs: fn(self.worker, *args, **kwargs)

    def _beat(self, stage: str, busy: bool, step: int | None = None) -> None:
        last_step = self.worker.heartbeat().last_step if step is None else step
        self.board.write(self.rank, stage, last_step, busy, os.getpid())

    def _close(self) -> None:
        try:
            self.worker.shutdown()
        except Exception:  # exiting anyway; the executor reaps this process
            logger.warning("worker rank %d: shutdown raised; exiting anyway", self.rank,
                           exc_info=True)
        if self.ring is not None:
            self.ring.close()
        self.board.close()


def _step_of(request: RpcRequest, last_step: int) -> int:
    if request.name == "execute_model" and request.args:
        return getattr(request.args[0], "step_id", last_step)
    return last_step


def _error_text(rank: int, what: str) -> str:
    exc_type, exc, _ = sys.exc_info()
    return (f"{exc_type.__name__}: {exc}\n--- worker rank {rank} traceback ({what}) ---\n"
            f"{traceback.format_exc()}")


def _exit_when_parent_dies(death_conn: Connection, run_dir: str) -> None:
    def watch() -> None:
        try:
            death_conn.recv()  # nothing is ever sent: this returns only at EOF
        except (EOFError, OSError):
            pass
        # A parent killed outright could not remove its directory: the workers do.
        shutil.rmtree(run_dir, ignore_errors=True)
        os._exit(EXIT_PARENT_DIED)

    threading.Thread(target=watch, name="spindle-death-pipe", daemon=True).start()
