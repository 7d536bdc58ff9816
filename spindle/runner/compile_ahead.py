"""Triton kernels compiled ahead of the warm-up, on several threads at once.

Triton compiles a kernel the first time it is launched with a new specialization
(argument dtypes, constexprs, alignment): 0.1-1.5 s each, about two dozen for a dense
model, one after another, so a first start on a machine spent some 14 s compiling.
Compiling mostly releases the GIL (MLIR, LLVM and ptxas work outside Python), so
threads compile in parallel: 8 variants of a small GEMM took 2.98 s one after another
and 0.37 s on 8 threads (an H200 host's 16 cores, triton 3.6).

compiling_ahead() is a context in which a launch (from the thread that entered it)
that would compile is not made:
Triton's jit_cache_hook reports the specialization, the compile goes to a thread pool
(JITFunction.preload), and the launch is skipped. Kernels already compiled launch as
usual. The warm-up's forward passes run once inside it to discover what to compile;
their numbers are garbage (skipped kernels leave their outputs unwritten) and are
thrown away, and leaving the context waits for every compile. The warm-up then runs
for real and finds every kernel compiled.

Garbage is harmless there because no spindle kernel produces addresses another one
follows: block tables, slots, positions and state slots come from the host, and MoE
routing is torch's top-k (indices in range whatever the scores). The greedy argmax
(runner/sample/argmax_kernel.py), whose output the host records as the warm-up
request's token, writes its ids into zeros, the chunks' and the rows': a skipped launch
leaves token 0, also where only its first kernel is skipped (the second does not see the
logits' dtype, so an engine of another dtype earlier in the process compiled it). No
kernel is autotuned (a skipped launch would time nothing). SPINDLE_COMPILE_AHEAD=0
switches this off: kernels then compile one by one on first launch, as Triton does by
itself.

triton_variants() counts the compiled variants of every spindle kernel in this process:
what a test reads to show that nothing compiles once the engine is ready.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from spindle.switches import on_off

logger = logging.getLogger(__name__)

SWITCH_ENV = "SPINDLE_COMPILE_AHEAD"
MAX_THREADS = 16


def switched_on() -> bool:
    return on_off(SWITCH_ENV, True)


def compile_threads(processes_per_host: int = 1) -> int:
    """Threads per process: the host's CPUs shared by the processes compiling at once,
    at most MAX_THREADS."""
    return max(1, min(MAX_THREADS, (os.cpu_count() or 1) // max(1, processes_per_host)))


@contextlib.contextmanager
def compiling_ahead(device: torch.device, threads: int) -> Iterator[dict]:
    """Inside: launches from this thread that would compile are skipped and compiled on
    `threads` threads. Yields a dict that reports, once the context is left, how many
    kernels were compiled ("kernels"), the seconds spent waiting for them ("wait_s") and
    each one's (JITFunction, specialization data) ("variants", what a KernelPlan keeps).
    A compile error is raised on leaving (as the launch would have raised it).

    Other threads' launches compile as usual, so engines warming up side by side in
    one process (a model pool) do not skip each other's kernels; a hook installed on
    top of this one while it was active is left in place, and this one then only
    passes calls on."""
    report = {"kernels": 0, "wait_s": 0.0}
    device = with_index(device)
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="spindle-compile")
    pending: dict[tuple[int, str], Future] = {}
    variants: dict[tuple[int, str], tuple] = {}  # (JITFunction, specialization data)

    def skip_and_compile_ahead(jit_function, key, specialization_data) -> bool:
        ident = (id(jit_function), str(key))
        if ident not in pending:
            variants[ident] = (jit_function, specialization_data)
            pending[ident] = pool.submit(preload, jit_function, specialization_data, device)
        return True  # no launch

    try:
        with _compile_hook(skip_and_compile_ahead):
            yield report
    finally:
        start = time.perf_counter()
        try:
            for future in pending.values():
                future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        report.update(kernels=len(pending), wait_s=time.perf_counter() - start,
                      variants=list(variants.values()))


@contextlib.contextmanager
def recording_compiles() -> Iterator[list]:
    """Inside: kernels compile on launch as usual, and the (JITFunction, specialization
    data) of each variant this thread compiles is appended to the yielded list (the
    variants a kernel plan missed)."""
    compiled: list = []

    def record(jit_function, key, specialization_data) -> None:
        compiled.append((jit_function, specialization_data))
        return None  # compile now

    with _compile_hook(record):
        yield compiled


@contextlib.contextmanager
def _compile_hook(on_compile) -> Iterator[None]:
    """Install a Triton jit_cache_hook that calls on_compile(jit_function, key,
    specialization data) for each launch from this thread that would compile, and
    returns what it returns (True: no launch, None: compile now). A hook installed
    before is asked first (its True wins) and put back on leaving; other threads'
    launches and Triton's own preloads (a pool thread's) are passed through. A hook
    installed on top of this one while it was active stays, and this one then only
    passes calls on."""
    from triton import knobs

    previous = knobs.runtime.jit_cache_hook
    owner = threading.get_ident()
    active = True

    def hook(*, key, fn, compile, is_manual_warmup, **kwargs):
        if previous is not None and previous(key=key, fn=fn, compile=compile,
                                             is_manual_warmup=is_manual_warmup, **kwargs):
            return True
        if not active or is_manual_warmup or threading.get_ident() != owner:
            return None
        return on_compile(fn.jit_function, key, compile["specialization_data"])

    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        active = False  # (the hook reads this variable: a later call only passes on)
        if knobs.runtime.jit_cache_hook is hook:
            knobs.runtime.jit_cache_hook = previous


_HASH_THREAD = "spindle-triton-key"


def hash_triton_in_background() -> None:
    """Start computing Triton's own cache key (a hash of its compiler sources and of
    libtriton, some 450 MB: 0.3-0.5 s) on a daemon thread. Triton computes it before its
    first cache lookup in a process; hashing and reading release the GIL, so started
    early it overlaps the import of transformers and the config instead of delaying the
    first kernel of the warm-up. Nothing happens when it is done or running already, or
    when this Triton has no such function."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return
    info = getattr(triton_key, "cache_info", None)
    if info is None or info().currsize:
        return
    if any(t.name == _HASH_THREAD for t in threading.enumerate()):
        return
    threading.Thread(target=triton_key, name=_HASH_THREAD, daemon=True).start()


def with_index(device: torch.device) -> torch.device:
    """device with its index: "cuda" alone means the calling thread's current device,
    which the compiling threads (whose own current device is 0) would not know."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def preload(jit_function, specialization_data: str, device: torch.device) -> None:
    """Compile (or load from Triton's cache) one variant for device, on this thread, and
    load it onto the device: Triton does that at a variant's first launch (the module
    load and the launcher), which would otherwise fall to the warm-up's thread."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # (preload compiles for the thread's current device)
    kernel = jit_function.preload(specialization_data)
    load = getattr(kernel, "_init_handles", None)
    if load is not None:
        try:
            load()
        except Exception as e:  # (the first launch raises it again, where it belongs)
            logger.debug("%s: not loaded ahead: %s", jit_function.fn.__name__, e)


def triton_variants() -> int:
    """Compiled variants of every Triton kernel defined in spindle's loaded modules, on
    every device, in this process."""
    total = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("spindle.") or module is None:
            continue
        for value in list(vars(module).values()):
            caches = getattr(value, "device_caches", None)
            if caches is None or getattr(value, "__module__", None) != name:
                continue
            for entry in list(caches.values()):
                total += len(entry[0])  # (kernel cache, key cache, target, backend, binder)
    return total
