"""The host's own work in each batch-1 decode step, phase by phase, unprofiled, on one
GPU: throughput.py's batch-1 case (the Qwen3-0.6B-shaped checkpoint, a 512-token
prompt, greedy). Each phase of each step is timed with perf_counter around the engine's
own calls (scheduling, the step's launch, the wait for the previous step's tokens,
applying them, turning them into outputs), and the garbage collector's passes are
timed through gc.callbacks. Prints each phase's quartiles, 90th percentile and most,
and the steps whose host work outlasted the decode graph's replay (the device then
idles): which phase made them long.

    python benchmarks/host_phases.py [--new-tokens 256] [--context 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch1_profile import HostWaits  # noqa: E402
from throughput import QWEN3_06B, graph_replay_ms, write_random_checkpoint  # noqa: E402

PHASES = ("schedule", "launch", "wait", "tokens_in", "update", "outputs", "gc")
# Parts of the launch, timed inside it (not added to the phases above).
LAUNCH_PARTS = ("prepare", "feed", "graph_run", "stage", "replay", "sample", "to_host")


class PhaseClock:
    """Per-step seconds of each phase, through wrappers installed on the engine's
    objects (instance attributes: nothing outside this engine is touched)."""

    def __init__(self, llm) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        clock = self
        core = llm.engine.core
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.scheduler, "update_from_output", "update")
        self._wrap(core.executor, "execute_model_async", "launch")
        self._wrap(llm.engine.output_processor, "process", "outputs")
        runner = core.executor.worker.runner
        self._wrap(runner, "_record_and_report", "tokens_in")
        self._wrap(runner.input_batch, "prepare", "prepare")
        self._wrap(runner, "_inflight_feed", "feed")
        self._wrap(runner, "_sample", "sample")
        graphs = runner.graph_runner
        if graphs is not None:
            self._wrap(graphs, "run", "graph_run")
            self._wrap(graphs, "_stage_inputs", "stage")
            for graph in graphs.graphs.values():
                self._wrap(graph, "replay", "replay")
        from spindle.runner.async_output import PendingOutput
        self._copy_cls, self._copy = PendingOutput, PendingOutput._copy_to_host

        def timed_copy(pending, sampled):
            start = time.perf_counter()
            clock._copy(pending, sampled)
            clock.add("to_host", time.perf_counter() - start)

        PendingOutput._copy_to_host = timed_copy
        self._waits = HostWaits().__enter__()  # (each wait for a step's tokens)
        original_step = llm.engine.step

        def timed_step():
            self.current = dict.fromkeys(PHASES + LAUNCH_PARTS, 0.0)
            waits_before = len(self._waits.each)
            start = time.perf_counter()
            out = original_step()
            self.current["total"] = time.perf_counter() - start
            self.current["wait"] = sum(self._waits.each[waits_before:])
            self.steps.append(self.current)
            return out

        llm.engine.step = timed_step
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _wrap(self, obj, name: str, phase: str) -> None:
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - start)

        setattr(obj, name, timed)

    def add(self, phase: str, seconds: float) -> None:
        if self.current:
            self.current[phase] = self.current.get(phase, 0.0) + seconds

    def _on_gc(self, stage: str, info: dict) -> None:
        if stage == "start":
            self._gc_start = time.perf_counter()
        else:
            self.add("gc", time.perf_counter() - self._gc_start)
            self.add(f"gc{info['generation']}", 1.0)

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)
        self._waits.__exit__(None, None, None)
        self._copy_cls._copy_to_host = self._copy


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"q1": at(0.25), "median": at(0.5), "q3": at(0.75), "p90": at(0.9),
            "max": ordered[-1], "mean": sum(ordered) / len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_phases.py needs a CUDA device")
    from spindle import LLM, SamplingParams

    prompt = [random.Random(1).randint(0, 10000) for _ in range(args.context)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens + 1, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "qwen3-0.6b-shape", QWEN3_06B)
        llm = LLM(str(path), dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
                  max_num_batched_tokens=8192, enable_prefix_caching=False)
        llm.generate([prompt], greedy, use_tqdm=False)  # warm-up
        replay_us = graph_replay_ms(llm).get("graph_replay_ms_b1", float("nan")) * 1e3
        clock = PhaseClock(llm)
        start = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)  # throughput.py's subtrahend
        short_steps, short_wall = len(clock.steps), time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([prompt], greedy, use_tqdm=False)
        wall = time.perf_counter() - start
        clock.close()
        llm.shutdown()
    edges = {"short_run_us": short_wall * 1e6,
             "short_run_steps_us": [s["total"] * 1e6 for s in clock.steps[:short_steps]],
             "long_run_us": wall * 1e6,
             "long_run_steps_sum_us": sum(s["total"] for s in clock.steps[short_steps:]) * 1e6,
             "long_run_first_steps_us": [s["total"] * 1e6
                                         for s in clock.steps[short_steps:short_steps + 5]],
             "long_run_last_steps_us": [s["total"] * 1e6 for s in clock.steps[-3:]],
             "tok_s_as_throughput_py": args.new_tokens / (wall - short_wall)}
    clock.steps = clock.steps[short_steps:]
    steps = clock.steps[3:-2]  # decode steps only (the prompt's and the last ones out)
    for s in steps:
        s["host"] = s["total"] - s["wait"]
    table = {p: quantiles([s.get(p, 0.0) * 1e6 for s in steps])
             for p in PHASES + ("host", "total") + LAUNCH_PARTS}
    late = [s for s in steps if s["host"] * 1e6 > replay_us]
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(),
              "replay_us": replay_us, "wall_us_per_token": wall * 1e6 / (args.new_tokens + 1),
              "steps": len(steps), "phases_us": table, "edges": edges,
              "late_steps": [{k: v * 1e6 if k in PHASES + LAUNCH_PARTS + ("host", "total")
                              else v
                              for k, v in s.items()} for s in late],
              "gc_passes": {g: sum(s.get(f"gc{g}", 0) for s in steps) for g in range(3)}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"{result['device']}, torch {result['torch']}; {len(steps)} decode steps; graph "
          f"replay {replay_us:.1f} us; wall {result['wall_us_per_token']:.1f} us a token")
    print(f"{'phase (us)':<10} {'q1':>8} {'median':>8} {'q3':>8} {'p90':>8} {'max':>8} "
          f"{'mean':>8}")
    for phase, q in table.items():
        label = ("  " if phase in LAUNCH_PARTS else "") + phase
        print(f"{label:<10} " + " ".join(f"{q[k]:>8.1f}" for k in
                                         ("q1", "median", "q3", "p90", "max", "mean")))
    print(f"gc passes by generation: {result['gc_passes']}")
    print(f"a run of 1 token: {edges['short_run_us']:.0f} us, its steps "
          + " ".join(f"{t:.0f}" for t in edges["short_run_steps_us"]))
    print(f"the long run: {edges['long_run_us']:.0f} us, its steps' sum "
          f"{edges['long_run_steps_sum_us']:.0f}; first steps "
          + " ".join(f"{t:.0f}" for t in edges["long_run_first_steps_us"]) + "; last "
          + " ".join(f"{t:.0f}" for t in edges["long_run_last_steps_us"])
          + f"; tok/s as throughput.py counts: {edges['tok_s_as_throughput_py']:.0f}")
    print(f"steps whose host work outlasted the replay: {len(late)} of {len(steps)}")
    for s in late[:12]:
        print("  " + " ".join(f"{p} {s.get(p, 0) * 1e6:.0f}" for p in PHASES + ("host",)))


if __name__ == "__main__":
    main()
