"""Which Triton kernels compile, when: during start-up, and after the engine is ready.

Every in-memory miss of a Triton kernel (a compile, or a load from the on-disk cache) is
recorded with its specialization, from process start. After LLM() returns, a varied
workload runs: batch sizes 1..max_num_seqs, prompt lengths 1..max_model_len, sampling
options, mixed prefill and decode. Anything that compiles then is listed.

    TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/compile_audit.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


class CompileLog:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.phase = "startup"
        self._started: dict[str, float] = {}

    def install(self) -> None:
        from triton import knobs

        def before(**kw):
            self._started[str(kw["key"])] = time.perf_counter()
            return None

        def after(**kw):
            key = str(kw["key"])
            start = self._started.pop(key, None)
            self.events.append({"phase": self.phase, "repr": kw["repr"], "key": key,
                                "compile_keys": sorted(kw.get("compile", {}) or {}),
                                "seconds": time.perf_counter() - start if start else None})
            return None

        knobs.runtime.jit_cache_hook = before
        knobs.runtime.jit_post_compile_hook = after


def varied_workload(llm, max_seqs: int, max_len: int) -> None:
    from spindle.tools.varied_workload import run_varied_workload

    batch_sizes = (1, 2, 3, 5, 7, 8, 9, 13, 16, 17, 31, 33, 63, 100, 129, 200, max_seqs)
    run_varied_workload(llm, batch_sizes, (1, 2, 7, 15, 16, 17, 100, 333, 1000, max_len - 40),
                        10000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    log = CompileLog()
    log.install()
    import torch
    from throughput import QWEN3_06B, write_random_checkpoint

    from spindle import LLM

    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "qwen3", QWEN3_06B)
        start = time.perf_counter()
        llm = LLM(str(path), dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
                  max_num_batched_tokens=8192)
        ready = time.perf_counter() - start
        ahead = llm.engine.core.executor.worker.runner.kernels_compiled_ahead
        log.phase = "after ready"
        t = time.perf_counter()
        varied_workload(llm, 256, 4096)
        workload_s = time.perf_counter() - t
        t = time.perf_counter()
        varied_workload(llm, 256, 4096)
        second_s = time.perf_counter() - t
        print(llm.engine.core.startup_table)
        llm.shutdown()
    by_phase: dict[str, list] = {}
    for e in log.events:
        by_phase.setdefault(e["phase"], []).append(e)
    print(f"kernels compiled ahead on threads: {ahead}")
    print(f"ready in {ready:.2f} s; varied workload {workload_s:.2f} s first, "
          f"{second_s:.2f} s again")
    for phase, events in by_phase.items():
        total = sum(e["seconds"] or 0 for e in events)
        print(f"--- {phase}: {len(events)} kernels, {total:.2f} s ---")
        for e in events:
            print(f"{e['seconds'] or 0:7.3f}  {e['repr'][:400]}")
    if args.json:
        args.json.write_text(json.dumps({"ready_s": ready, "compiled_ahead": ahead,
                                         "workload_s": workload_s,
                                         "second_s": second_s, "events": log.events,
                                         "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
