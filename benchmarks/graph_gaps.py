"""Where a decode graph's replay time goes between its kernels, on one GPU.

Builds the engine as benchmarks/throughput.py does (Qwen3-0.6B shape, bf16, the same
settings), runs one batch-1 request of 8 tokens, then for each captured size asked for
times the graph's replays by CUDA events and profiles a few of them: the kernels' busy
time, the replay's span from its first kernel to its last, and the idle time between
kernels (and its largest gaps, by the kernels on either side). With --recapture it then
captures every graph again (largest first, in the same memory pool, as at start) and
measures once more.

Made for the question docs/benchmarks.md leaves open (2026-12-06): with the greedy
argmax in the graphs of <= 8 requests (the default), the graphs of 64 and 256 requests
replay ~90 us slower than with SPINDLE_GRAPH_ARGMAX=0, all of it idle between kernels.
Compare variants in fresh processes:

    python benchmarks/graph_gaps.py [--sizes 64 256] [--recapture] [--json out.json]
    SPINDLE_GRAPH_ARGMAX=0 python benchmarks/graph_gaps.py [--recapture]

(The profiling part ran on an H100 in the twenty-ninth session as a script of that
session; --recapture had not run on a GPU when this was written.)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_timing import replay_ms
from nano_breakdown import device_timeline
from throughput import checkpoint, engine_after_one_request, one_request


def replay_gaps(graph, replays: int) -> dict:
    """The profiler's view of `replays` replays: per replay, the span, the busy time
    and the idle time between kernels (us), and the largest gaps of 1 us or more."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    timeline = device_timeline(prof, gap_us=1.0, top=4)
    span, busy = timeline["span_ms"] * 1e3 / replays, timeline["busy_ms"] * 1e3 / replays
    return dict(span_us=span, busy_us=busy, idle_us=span - busy, gaps=timeline["gaps"])


def measure(runner, sizes: list[int], replays: int) -> list[dict]:
    rows = []
    for size in sizes:
        graph = runner.graphs[1, size, False]
        rows.append(dict(size=size, event_ms=replay_ms(graph), **replay_gaps(graph, replays)))
    runner.forget_device_inputs()  # (an advancing graph moved its inputs on each replay)
    return rows


def format_rows(label: str, rows: list[dict]) -> str:
    lines = [label, f"{'size':>5} | {'event ms':>8} | {'span us':>8} | {'busy us':>8} | "
             f"{'idle us':>8} | largest gaps (ms over the profiled replays)"]
    for r in rows:
        gaps = "; ".join(f"{g['between']} {g['ms']:.3f}" for g in r["gaps"][:2])
        lines.append(f"{r['size']:>5} | {r['event_ms']:>8.3f} | {r['span_us']:>8.1f} | "
                     f"{r['busy_us']:>8.1f} | {r['idle_us']:>8.1f} | {gaps}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256],
                        help="captured decode batch sizes to measure")
    parser.add_argument("--replays", type=int, default=4, help="replays under the profiler")
    parser.add_argument("--recapture", action="store_true",
                        help="capture every graph again, then measure again")
    parser.add_argument("--checkpoint", type=Path,
                        help="keep the random checkpoint here (default: a temporary one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_gaps.py needs a CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.checkpoint or Path(tmp) / "qwen3-0.6b-shape")
        llm, runner = engine_after_one_request(path)
        try:
            missing = [s for s in args.sizes if (1, s, False) not in runner.graphs]
            if missing:
                raise SystemExit(f"no captured graph of sizes {missing}; captured: "
                                 f"{sorted(runner.sizes)}")
            result = {"device": torch.cuda.get_device_name(),
                      "as_started": measure(runner, args.sizes, args.replays)}
            print(format_rows("as started", result["as_started"]))
            if args.recapture:
                runner.capture()
                one_request(llm)
                result["recaptured"] = measure(runner, args.sizes, args.replays)
                print(format_rows("every graph captured again", result["recaptured"]))
        finally:
            llm.shutdown()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
