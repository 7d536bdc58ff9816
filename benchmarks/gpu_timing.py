"""Device time of the benchmarks' calls, by CUDA events: replays of a CUDA graph (as a
captured decode step runs its kernels) or eager calls, and the device's copy bandwidth,
the ceiling the kernel benchmarks compare against. Imported by scripts run from this
folder (`python benchmarks/<script>.py` puts it on sys.path)."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path
from typing import Callable

import torch

CALLS = 20


def _median_us(run: Callable[[], object], iters: int, per_run: int = 1) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_run)
    return statistics.median(times)


def graph_us(fn: Callable[[int], object], iters: int, calls: int = CALLS) -> float:
    """Median microseconds of one fn(i) call, from iters replays of a CUDA graph of
    `calls` calls (i = 0 .. calls - 1), launch gaps included. One eager fn(0) first (it
    compiles and allocates outside the graph), and warm-up replays. Raises what the
    capture raises (fn synchronizing with the host, say)."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    for _ in range(5):
        graph.replay()
    return _median_us(graph.replay, iters, calls)


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 50) -> float:
    """Milliseconds a replay of an already captured graph, by events around `replays`
    replays in a row (after 3 warm-up replays): the device's time, gaps included."""
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def eager_us(fn: Callable[[], object], iters: int) -> float:
    """Median microseconds of one fn() call, each launched and timed on its own (its
    host launch time shows where it is longer than the device work)."""
    fn()
    torch.cuda.synchronize()
    return _median_us(fn, iters)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second of an nbytes device-to-device copy, read plus written (the
    median of 20), launched eagerly (captured in a CUDA graph the same copy is much
    slower: 2.78 against about 4.2 TB/s on an H200, 2026-12-04)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return 2 * src.numel() / (eager_us(lambda: dst.copy_(src), 20) / 1e6)


def write_rows(path: Path, rows: list[dict], copy_bw: float) -> None:
    """A kernel benchmark's rows as JSON, with the device, versions and copy bandwidth."""
    path.write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
         "python": platform.python_version(), "copy_bandwidth": copy_bw, "rows": rows},
        indent=1))
