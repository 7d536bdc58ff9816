"""What a batch-1 decode step costs the device between two replays of its graph, and
what it would cost if the graph advanced its own inputs and wrote its token to the host.

With SPINDLE_GRAPH_ADVANCE=0, a steady greedy batch-1 step (the graph feed on: its input
id already in place) runs, on the device: the staged inputs' host-to-device copy
(positions, sequence lengths, slots), the graph, the token's device-to-host copy and an
event. On an H100 a step was the replay plus 12-17 us
(docs/benchmarks.md), on an H200 plus 28-35. This script builds
the engine as throughput.py does (Qwen3-0.6B shape, bf16), runs one request, then times
`--steps` iterations of each variant by events around them (the host runs ahead: each
iteration only enqueues), in microseconds an iteration:

- replay: the batch-1 graph alone, back to back;
- engine: stage, replay, token back, event (a steady greedy step's device work);
- stage + replay; replay + token back;
- epilogue kernel: replay, then one small kernel that stores the token into pinned host
  memory (mapped: no copy engine) and adds `delta` (0 here) to positions, sequence
  lengths and slots, then the event;
- in-graph epilogue: the same kernel captured at the end of a copy of the batch-1 graph;
  replay, event: what a graph that advances its own inputs would cost;
- in-graph advance, token copied back: the kernel without the host store, in the graph,
  then the copy and event.

    python benchmarks/replay_gap.py [--steps 300] [--rounds 3] [--json out.json]

It builds its engine with SPINDLE_GRAPH_ADVANCE=0 (unless that is set otherwise, which
it refuses): graphs that advance their own inputs move the sequence on at every replay,
so the variants that stage nothing would time ever longer contexts (its first two runs,
with the advance on, were void for that: docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

from throughput import checkpoint, engine_after_one_request


@triton.jit
def _epilogue_kernel(token_ptr, host_ptr, positions_ptr, seq_lens_ptr, slots_ptr, delta,
                     HOST: tl.constexpr):
    """One program: the token to the host (HOST), then positions, the sequence length
    and the slot of row 0 advanced by delta."""
    if HOST:
        tl.store(host_ptr, tl.load(token_ptr))
    tl.store(positions_ptr, tl.load(positions_ptr) + delta)
    tl.store(seq_lens_ptr, tl.load(seq_lens_ptr) + delta)
    tl.store(slots_ptr, tl.load(slots_ptr) + delta)


def epilogue(runner, token: torch.Tensor, host: torch.Tensor | None) -> None:
    _epilogue_kernel[(1,)](token, host if host is not None else token, runner.positions,
                           runner.seq_lens, runner.slot_mappings[0], 0,
                           HOST=host is not None, num_warps=1)


def timed_us(iteration, steps: int) -> float:
    """Device microseconds an iteration, by events around `steps` of them."""
    for _ in range(5):
        iteration()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        iteration()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / steps


def variants(runner) -> dict:
    """name -> one iteration (a callable that only enqueues)."""
    graph = runner.graphs[1, 1, False]
    greedy = runner.outputs[1, 1, False].greedy
    if greedy is None:
        raise SystemExit("the batch-1 graph takes no argmax (SPINDLE_GRAPH_ARGMAX=0?)")
    host_inputs = runner._host_sets[0][0]
    pinned = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    event = torch.cuda.Event()

    def stage():
        runner._staged[1:].copy_(host_inputs[1:], non_blocking=True)

    def back():
        pinned[:1].copy_(greedy, non_blocking=True)
        event.record()

    out = {
        "replay": graph.replay,
        "engine (stage, replay, token back)": lambda: (stage(), graph.replay(), back()),
        "stage + replay": lambda: (stage(), graph.replay()),
        "replay + token back": lambda: (graph.replay(), back()),
    }
    try:
        epilogue(runner, greedy, pinned)
        torch.cuda.synchronize()
        host_ok = True
    except Exception as exc:  # (Triton refusing a pinned host pointer: say so, go on)
        print(f"the epilogue's host store failed: {type(exc).__name__}: {exc}")
        host_ok = False
    if host_ok:
        out["replay + epilogue kernel (token to host)"] = lambda: (
            graph.replay(), epilogue(runner, greedy, pinned), event.record())
    with_host = captured_with_epilogue(runner, pinned if host_ok else None)
    if host_ok:
        out["in-graph epilogue (token to host)"] = lambda: (with_host.replay(), event.record())
    device_only = captured_with_epilogue(runner, None)
    out["in-graph advance, token copied back"] = lambda: (device_only.replay(), back())
    return out


@torch.inference_mode()
def captured_with_epilogue(runner, host: torch.Tensor | None) -> torch.cuda.CUDAGraph:
    """A new batch-1 graph: the engine's step, then the epilogue kernel (in the
    runner's graph pool, as the engine captures its graphs)."""
    epilogue(runner, runner.outputs[1, 1, False].greedy, host)  # (compiled outside)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=runner.pool):
        out = runner._step(1)
        epilogue(runner, out.greedy, host)
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("SPINDLE_GRAPH_ADVANCE", "0")  # (see the module docstring)
    if not torch.cuda.is_available():
        raise SystemExit("replay_gap.py needs a CUDA device")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "host": platform.processor(), "us": {}}
    with tempfile.TemporaryDirectory() as tmp:
        llm, runner = engine_after_one_request(checkpoint(Path(tmp) / "qwen3-0.6b-shape"))
        try:
            if runner.advances:
                raise SystemExit("replay_gap.py times the graphs as captured without the "
                                 "advance (SPINDLE_GRAPH_ADVANCE=0): with it each replay "
                                 "moves the sequence on, and the replays slow as the "
                                 "context grows")
            with torch.inference_mode():  # (the runner's buffers are inference tensors)
                each = variants(runner)
                for _ in range(args.rounds):  # (the variants alternate round by round)
                    for name, iteration in each.items():
                        result["us"].setdefault(name, []).append(
                            timed_us(iteration, args.steps))
        finally:
            llm.shutdown()
    base = statistics.median(result["us"]["replay"])
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}")
    print(f"{'variant':<45} | {'us an iteration':>15} | {'over the replay':>15} | rounds")
    for name, times in result["us"].items():
        median = statistics.median(times)
        spread = ", ".join(f"{t:.1f}" for t in times)
        print(f"{name:<45} | {median:>15.1f} | {median - base:>15.1f} | {spread}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
