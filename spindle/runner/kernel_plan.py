"""Kernel plans: the Triton kernel variants an engine's warm-up needed, kept beside
Triton's on-disk cache for the next start of the same engine.

Compiling ahead (compile_ahead.py) discovers the variants by running the warm-up's
forward passes once with every compiling launch skipped. On a machine whose Triton
cache already holds the kernels, that pass is pure overhead: some 20 forward passes
(the warm-up steps and one per CUDA-graph batch size) and a wait for the kernels to
load, about 0.5 s of a warm start of a 0.6B model on the H200 host. With a plan, the
next start loads every variant of it on threads at once and skips the discovery
passes.

A plan is a JSON file `<Triton cache dir>/spindle_plans/<fingerprint>.json`. The
fingerprint hashes everything that decides which variants the warm-up launches: the
engine configuration, the checkpoint's config, the SPINDLE_* switches set in the
environment (switches.kernel_switch_settings), this worker's rank and world size, the
device, and the torch and Triton versions. Each entry names its kernel (module and
name) and the kernel's source hash (JITFunction.cache_key): a kernel whose source has
changed since makes the plan stale, and it is not used. Since the plan lives in the
Triton cache directory, an empty cache (TRITON_CACHE_DIR pointing elsewhere) has no
plan either, and the warm-up then compiles ahead as before.

A plan never decides correctness: a variant missing from it compiles on first use
during the warm-up (each CUDA-graph shape runs eagerly once before its capture), is
recorded, and the plan is rewritten. A plan that cannot be read or written is ignored
(a debug log says why).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import torch

from spindle.runner.compile_ahead import preload, recording_compiles, with_index

logger = logging.getLogger(__name__)

PLAN_FORMAT = 1
PLAN_DIR = "spindle_plans"


def engine_fingerprint(*parts: str) -> str:
    """A short hash of parts plus the torch and Triton versions."""
    import triton

    text = "\n".join([f"plan format {PLAN_FORMAT}", torch.__version__, triton.__version__,
                      *parts])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def plan_path(fingerprint: str) -> Path | None:
    """Where the plan of this fingerprint lives: in Triton's cache directory."""
    try:
        from triton import knobs

        cache_dir = knobs.cache.dir
    except (ImportError, AttributeError):
        return None
    return Path(cache_dir) / PLAN_DIR / f"{fingerprint}.json" if cache_dir else None


def variant_entry(jit_function: Any, specialization_data: str) -> dict:
    fn = jit_function.fn
    return {"module": fn.__module__, "name": fn.__qualname__,
            "source_key": jit_function.cache_key, "specialization": specialization_data}


def save_plan(path: Path, variants: Iterable[tuple[Any, str]]) -> bool:
    """Write the plan of variants ((JITFunction, specialization data) pairs, duplicates
    dropped) to path, atomically. False (and a debug log) when it cannot be written."""
    entries, seen = [], set()
    for jit_function, data in variants:
        entry = variant_entry(jit_function, data)
        key = (entry["module"], entry["name"], data)
        if key not in seen:
            seen.add(key)
            entries.append(entry)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": PLAN_FORMAT, "variants": entries}))
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("kernel plan %s not written: %s", path, e)
        with contextlib.suppress(OSError):
            tmp.unlink()
        return False
    return True


def load_plan(path: Path) -> list[tuple[Any, str]] | None:
    """The plan's (JITFunction, specialization data) pairs, or None when there is no
    usable plan: none written yet, unreadable, of another format, or stale (a kernel
    gone or its source changed since)."""
    try:
        plan = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.debug("kernel plan %s not readable: %s", path, e)
        return None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        logger.debug("kernel plan %s: not of format %d", path, PLAN_FORMAT)
        return None
    variants = []
    for entry in plan.get("variants", []):
        jit_function = _resolve(entry)
        if jit_function is None:
            logger.debug("kernel plan %s is stale: %s.%s", path, entry.get("module"),
                          entry.get("name"))
            return None
        variants.append((jit_function, entry["specialization"]))
    return variants


def _resolve(entry: Any) -> Any:
    """The JITFunction an entry names, if it still has the entry's source hash."""
    try:
        module = importlib.import_module(entry["module"])
        jit_function = module
        for part in entry["name"].split("."):
            jit_function = getattr(jit_function, part)
        if jit_function.cache_key != entry["source_key"]:
            return None
        return jit_function
    except (ImportError, AttributeError, KeyError, TypeError):
        return None


def preload_variants(variants: list[tuple[Any, str]], device: torch.device,
                     threads: int) -> dict:
    """Load (from Triton's cache, or compile) every variant on `threads` threads and wait.
    Returns {"kernels", "wait_s", "failed"}: failed lists the variants that raised
    (they will compile on first use instead).

    A kernel that has compiled variants in this process already (another engine of
    the process warmed up first) is left alone: a preload would replace its loaded
    variants, and what this engine still lacks of it compiles on first use."""
    start = time.perf_counter()
    failed = []
    device = with_index(device)
    todo = [v for v in variants if not _has_compiled_variants(v[0])]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="spindle-plan") as pool:
        futures = [(variant, pool.submit(preload, variant[0], variant[1], device))
                   for variant in todo]
        for variant, future in futures:
            try:
                future.result()
            except Exception as e:  # a variant that no longer loads: compiled on use
                logger.debug("kernel plan: %s did not preload: %s", variant[0].fn.__name__, e)
                failed.append(variant)
    return {"kernels": len(todo) - len(failed), "wait_s": time.perf_counter() - start,
            "failed": failed}


def _has_compiled_variants(jit_function: Any) -> bool:
    """Whether this process holds a compiled variant of the kernel on any device."""
    caches = getattr(jit_function, "device_caches", None) or {}
    return any(len(entry[0]) for entry in list(caches.values()))


class KernelPlan:
    """One engine's plan over its start: preloaded once (when a usable plan exists),
    added to by the compile-ahead passes and by misses, saved after the warm-up when
    it gained something."""

    def __init__(self, fingerprint: str) -> None:
        self.path = plan_path(fingerprint)
        self.used = False  # a plan was loaded and its kernels preloaded
        self.variants: list[tuple[Any, str]] = []
        self.changed = False

    def preload(self, device: torch.device, threads: int) -> dict | None:
        """Preload every variant of the saved plan (see preload_variants); None, and
        nothing done, when there is no usable plan."""
        if self.used:  # (a second profile run of this engine: loaded already)
            return {"kernels": 0, "wait_s": 0.0, "failed": []}
        variants = load_plan(self.path) if self.path is not None else None
        if variants is None:
            return None
        report = preload_variants(variants, device, threads)
        failed = {id(v) for v in report["failed"]}
        self.variants = [v for v in variants if id(v) not in failed]
        self.changed = bool(failed)
        self.used = True
        return report

    def add(self, variants: Iterable[tuple[Any, str]]) -> None:
        variants = list(variants)
        if variants:
            self.variants.extend(variants)
            self.changed = True

    @contextlib.contextmanager
    def recording_misses(self):
        """Kernels compiled inside (on launch: the plan missed them) join the plan."""
        with recording_compiles() as compiled:
            yield
        if compiled:
            logger.debug("kernel plan: %d Triton kernels were not in it", len(compiled))
        self.add(compiled)

    def save(self) -> None:
        """Write the plan if this start added to it."""
        if self.changed and self.path is not None and save_plan(self.path, self.variants):
            self.changed = False
