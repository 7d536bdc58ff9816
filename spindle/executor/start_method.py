"""How the multi-process executor starts its workers: fork or spawn.

fork copies this process: no new interpreter, no re-import, and a script that
creates the engine at its top level (without `if __name__ == "__main__":`) works.
Only CPU workers are forked (a CUDA runtime, which this process initialises to
count devices, does not survive a fork). What else a fork copies, and how the
worker copes (multiproc_worker.worker_main):
- torch's OpenMP pool, once this process ran a parallel op: its threads are gone
  in the child, and the forking thread's next parallel region waits for them
  forever. The worker serves from a fresh thread, which gets a pool of its own.
- the tokenizers library's thread pool: the library turns parallelism off in the
  child (some versions also print a warning unless TOKENIZERS_PARALLELISM is set;
  it is set for the child, which never tokenizes).
- open file descriptors: the child closes the executors' pipe ends it inherited,
  so that a pipe still reads EOF when its one holder exits.
- signal handlers: the worker restores SIGTERM's default.
- other threads of this process do not exist in the child; a lock one of them held
  stays held there, and the worker takes none of theirs (logging's and the import
  lock are reset by Python itself).
spawn starts a fresh interpreter, which runs the main script again before the
worker's own code. A script that creates the engine at its top level would start
an engine in every worker: the worker stops at once instead
(EXIT_MAIN_SCRIPT_RERUN), and the executor's error says what to add.

Nothing here knows what a worker does.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import sys
from typing import Iterator

import torch

from spindle.platforms.interface import Platform

# The exit status of a spawned worker that found itself running the parent's main
# script at its top level (distinct from multiproc_worker's EXIT_* codes).
EXIT_MAIN_SCRIPT_RERUN = 4
GUARD_ADVICE = ("put the code that creates the engine (and uses it) under "
                "`if __name__ == \"__main__\":`, or use worker_start_method='fork' "
                "(--worker-start-method fork) for CPU workers")


def resolve_start_method(requested: str, platform: Platform) -> tuple[str, str]:
    """(fork | spawn, why): the start method for this engine's worker processes.
    Raises ValueError for fork where it cannot work."""
    cuda_here = torch.cuda.is_initialized()
    if requested == "fork":
        if not platform.workers_may_fork:
            raise ValueError(f"worker_start_method='fork' cannot start {platform.device_type} "
                             "workers (a CUDA runtime does not survive a fork); use 'spawn' "
                             "or 'auto'")
        if cuda_here:
            raise ValueError("worker_start_method='fork' cannot be used once this process "
                             "holds a CUDA context; use 'spawn' or 'auto'")
        return "fork", "worker_start_method='fork'"
    if requested == "spawn":
        return "spawn", "worker_start_method='spawn'"
    if not platform.workers_may_fork:
        return "spawn", (f"{platform.device_type} workers are always spawned (a CUDA runtime "
                         "does not survive a fork)")
    if cuda_here:
        return "spawn", "this process holds a CUDA context, which a fork would copy broken"
    return "fork", "CPU workers are forked"


def running_main_script_in_child() -> bool:
    """True while this process is a child started by spawn (or forkserver) that runs
    its parent's main script again: multiprocessing does that before the child's own
    work, and flags it with the attribute its own check (spawn's
    _check_not_importing_main) reads."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def stop_main_script_rerun() -> None:
    """Exit this child process now, saying why (see running_main_script_in_child):
    starting workers from here would start a whole engine in every worker."""
    sys.stderr.write(f"spindle: a worker process stopped: it was running the main script "
                     f"{_script_being_rerun()} again, and that script creates an engine at "
                     f"its top level; {GUARD_ADVICE}\n")
    sys.stderr.flush()
    os._exit(EXIT_MAIN_SCRIPT_RERUN)


def main_script() -> str:
    main = sys.modules.get("__main__")
    return getattr(main, "__file__", None) or "(the main module)"


def _script_being_rerun() -> str:
    """In a child re-running its parent's main script: that script's file (its
    module is only filled in once it has run, so it is read from the stack)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == "__mp_main__":
            return frame.f_code.co_filename
        frame = frame.f_back
    return "(the parent's main module)"


def main_script_rerun_error(why_spawn: str) -> str:
    """The executor's message when a spawned worker exited with EXIT_MAIN_SCRIPT_RERUN."""
    return (f"the worker processes could not start: they are spawned ({why_spawn}), a "
            f"spawned process runs the main script {main_script()} again, and that script "
            f"creates an engine at its top level. Fix: {GUARD_ADVICE}.")


@contextlib.contextmanager
def tokenizers_quiet_in_child() -> Iterator[None]:
    """Around a fork: TOKENIZERS_PARALLELISM=false for the child, so that the
    tokenizers library turns its pool off there without printing a warning (workers
    never tokenize). This process's setting is left as it was (unset: parallel)."""
    if "TOKENIZERS_PARALLELISM" in os.environ:
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
