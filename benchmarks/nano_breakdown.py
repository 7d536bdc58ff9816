"""Where the "nano" workload's time goes, on one GPU: prefill vs decode steps, decode
steps by batch size (the tail of the run, when few sequences remain), host vs device,
and, in three windows of steps (prompt chunks at the start, full-batch decode, the
tail), each kernel's share of device time, the device's idle gaps between kernels and
decode attention's KV read rate; plus the host's time by Python function over a few
prefill steps (cProfile); and, for every step that runs eagerly (with prompt tokens),
where its host time goes: launching the forward, the LM head, the sampler, against the
step's device time, with the LM-head calls that held the host longer than 1 ms.
With --probe-queue, each such step also waits, once its forward is launched, until the
device has run it, and reports how long that took: near zero where the device waits
for the host's launches, the device's backlog where launches ran ahead of it (or
blocked behind it). The wait holds the host there, so the run's figures move.

Same checkpoint, engine settings and workload as benchmarks/throughput.py. Every
engine step is recorded: its wall time, its scheduled tokens (a decode request has
one, a prefill chunk more), the context its decode requests read, and how long the
host waited for the device in it (with async scheduling a step launches its own work
and then waits for the previous step's: a step that never waits is host-bound). A
step's roofline is that of throughput.py: all weights plus the KV of its decode
requests, at the copy bandwidth measured in the same run. The kernel shares come from
torch.profiler over the windows (CUDA graph replays included).

    python benchmarks/nano_breakdown.py [--json out.json] [--probe-queue]
    python benchmarks/nano_breakdown.py --smoke     # a tiny CPU run of the bookkeeping
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import (QWEN3_06B, copy_bandwidth, kv_bytes_per_token,  # noqa: E402
                        nano_params, nano_workload, write_random_checkpoint)

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128,
            tie_word_embeddings=True)
# Decode steps are grouped by how many sequences they decode.
BATCH_BUCKETS = ((192, 10**9), (128, 191), (64, 127), (16, 63), (1, 15))


@dataclass
class Step:
    wall_s: float
    wait_s: float  # host blocked on the device
    decode_reqs: int
    prefill_tokens: int
    decode_context: int  # tokens of KV the decode requests read


class StepRecorder:
    """Wraps the engine's step and its executor's launch to record a Step per step,
    and runs torch.profiler over the steps given in windows ({name: (first, last)})."""

    def __init__(self, engine, windows: dict[str, tuple[int, int]], cuda: bool,
                 host_window: tuple[int, int] | None = None) -> None:
        self.steps: list[Step] = []
        self.profiles: dict[str, object] = {}
        self.host_profile: cProfile.Profile | None = None
        self._windows, self._cuda, self._host_window = windows, cuda, host_window
        self._active: tuple[str, object] | None = None
        self._current = dict(wait=0.0, decode=0, prefill=0, context=0)
        core = engine.core
        scheduler = core.scheduler
        launch = core.executor.execute_model_async

        def recorded_launch(sched):
            pending = launch(sched)
            for rid, n in sched.num_scheduled_tokens.items():
                if n == 1:
                    self._current["decode"] += 1
                    self._current["context"] += scheduler.requests[rid].num_computed_tokens
                else:
                    self._current["prefill"] += n
            return _TimedPending(pending, self._current)

        core.executor.execute_model_async = recorded_launch
        step = engine.step

        def recorded_step():
            self._profile_edge(len(self.steps))
            host = self._host_window is not None and \
                self._host_window[0] <= len(self.steps) <= self._host_window[1]
            if host:
                self.host_profile = self.host_profile or cProfile.Profile()
                self.host_profile.enable()
            start = time.perf_counter()
            out = step()
            if host:
                self.host_profile.disable()
            c = self._current
            self.steps.append(Step(time.perf_counter() - start, c["wait"], c["decode"],
                                   c["prefill"], c["context"]))
            self._current.update(wait=0.0, decode=0, prefill=0, context=0)
            return out

        engine.step = recorded_step

    def _profile_edge(self, index: int) -> None:
        if self._active is not None and index > self._windows[self._active[0]][1]:
            name, prof = self._active
            prof.stop()
            self.profiles[name] = prof
            self._active = None
        for name, (first, _) in self._windows.items():
            if index == first and self._active is None:
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
                prof = profile(activities=activities)
                prof.start()
                self._active = (name, prof)

    def finish(self) -> None:
        if self._active is not None:
            name, prof = self._active
            prof.stop()
            self.profiles[name] = prof
            self._active = None


class _TimedPending:
    """A launched step whose get() adds the time it blocks to the step being recorded
    (with async scheduling, the step that collects it)."""

    def __init__(self, pending, current: dict) -> None:
        self._pending, self._current = pending, current

    def get(self):
        start = time.perf_counter()
        out = self._pending.get()
        self._current["wait"] += time.perf_counter() - start
        return out

    def __getattr__(self, name):
        return getattr(self._pending, name)


class EagerStepTimer:
    """Host time inside the runner's eager steps (those with prompt tokens): from the
    step's start to the end of the forward's launch, in the LM head and in the sampler,
    and the whole step's host and device time (CUDA events; None on the CPU). Also every
    LM-head call of the run that held the host more than 1 ms (cuBLAS's first call at a
    row count it has not served blocks until the device catches up). probe_queue: wait
    at the end of the forward's launch until the device has run it (see the module
    docstring)."""

    def __init__(self, runner, cuda: bool, probe_queue: bool = False) -> None:
        self.rows: list[dict] = []
        self.slow_heads: list[tuple[int, float]] = []  # (rows, seconds)
        self._marks: dict | None = None
        state = runner._require_state()
        forward, logits, sampler = state.forward, state.compute_logits, runner.sampler
        launch = runner.execute_model_async

        def timed_forward(*args, **kwargs):
            out = forward(*args, **kwargs)
            self._mark("forward")
            if probe_queue and cuda and self._marks is not None:
                launched, start = torch.cuda.Event(), time.perf_counter()
                launched.record()
                launched.synchronize()
                self._mark("behind", time.perf_counter() - start)
            return out

        def timed_logits(hidden):
            start = time.perf_counter()
            out = logits(hidden)
            seconds = time.perf_counter() - start
            if seconds > 1e-3:
                self.slow_heads.append((hidden.shape[0], seconds))
            self._mark("head", seconds)
            return out

        def timed_sampler(*args, **kwargs):
            start = time.perf_counter()
            out = sampler(*args, **kwargs)
            self._mark("sampler", time.perf_counter() - start)
            return out

        def timed_launch(sched):
            tokens = sum(sched.num_scheduled_tokens.values())
            if tokens <= len(sched.num_scheduled_tokens):  # a decode step (graphs)
                return launch(sched)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
            self._marks = {"start": time.perf_counter()}
            if events:
                events[0].record()
            try:
                return launch(sched)
            finally:
                if events:
                    events[1].record()
                marks, self._marks = self._marks, None
                self.rows.append(dict(tokens=tokens, reqs=len(sched.num_scheduled_tokens),
                                      host_s=time.perf_counter() - marks["start"],
                                      forward_s=marks.get("forward", marks["start"]) - marks["start"],
                                      head_s=marks.get("head", 0.0),
                                      behind_s=marks.get("behind"),
                                      sampler_s=marks.get("sampler", 0.0), events=events))

        state.forward, state.compute_logits = timed_forward, timed_logits
        runner.sampler, runner.execute_model_async = timed_sampler, timed_launch

    def _mark(self, name: str, seconds: float | None = None) -> None:
        if self._marks is not None:
            self._marks[name] = time.perf_counter() if seconds is None else seconds

    def report(self) -> dict:
        """The rows with device times filled in (call after the device is idle)."""
        rows = []
        for r in self.rows:
            events = r.pop("events")
            r["device_s"] = events[0].elapsed_time(events[1]) / 1e3 if events else None
            rows.append(r)
        return dict(eager_steps=rows, slow_lm_heads=[dict(rows=m, ms=s * 1e3)
                                                     for m, s in self.slow_heads])


def format_eager_steps(report: dict) -> str:
    lines = ["--- eager steps (with prompt tokens): host ms from the step's start; those in "
             "the prefill profiler window and the cProfile window carry those tools' host "
             "time ---",
             f"{'tokens':>6s} {'reqs':>4s} {'forward':>8s} {'behind':>8s} {'LM head':>8s} "
             f"{'sampler':>8s} {'host':>8s} {'device':>8s}"]

    def ms(seconds):
        return f"{seconds * 1e3:8.2f}" if seconds is not None else f"{'-':>8s}"
    for r in report["eager_steps"]:
        lines.append(f"{r['tokens']:6d} {r['reqs']:4d} {ms(r['forward_s'])} "
                     f"{ms(r['behind_s'])} {ms(r['head_s'])} {ms(r['sampler_s'])} "
                     f"{ms(r['host_s'])} {ms(r['device_s'])}")
    slow = report["slow_lm_heads"]
    lines.append(f"LM-head calls over 1 ms in the run: {len(slow)}, "
                 f"{sum(h['ms'] for h in slow):.1f} ms in all"
                 + (f", at rows {sorted({h['rows'] for h in slow})}" if slow else ""))
    return "\n".join(lines)


def kernel_shares(prof, cuda: bool, top: int = 14) -> list[dict]:
    """Device time per kernel name (host time per op on CPU), largest first, with its
    share of the window's total."""
    rows = []
    for event in prof.key_averages():
        t = (event.self_device_time_total if cuda else event.self_cpu_time_total)
        if t > 0 and (not cuda or event.device_type.name == "CUDA"):
            rows.append((event.key, t, event.count))
    total = sum(t for _, t, _ in rows) or 1
    rows.sort(key=lambda r: -r[1])
    return [dict(name=name[:90], ms=t / 1e3, calls=count, share=t / total)
            for name, t, count in rows[:top]] + [dict(name="(total)", ms=total / 1e3,
                                                       calls=0, share=1.0)]


def device_timeline(prof, gap_us: float = 3.0, top: int = 8) -> dict:
    """Whether the device idles inside a window: the span from its first kernel (or
    copy) to its last, the time something ran, and the idle gaps of gap_us or more
    grouped by the kernels on either side (e.g. between one step's graph and the
    next step's LM head), largest total first."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name)
                   for e in prof.events() if e.device_type.name == "CUDA")
    if not spans:
        return {}
    busy, gaps = 0.0, {}
    run_start, run_end, last_name = spans[0][0], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > run_end:
            busy += run_end - run_start
            if start - run_end >= gap_us:
                key = f"{last_name[:40]} -> {name[:40]}"
                total, count = gaps.get(key, (0.0, 0))
                gaps[key] = (total + start - run_end, count + 1)
            run_start = start
        if end >= run_end:
            run_end, last_name = end, name
    busy += run_end - run_start
    span = spans[-1][1] - spans[0][0]
    ranked = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(span_ms=span / 1e3, busy_ms=busy / 1e3, idle_share=1 - busy / span,
                gaps=[dict(between=k, ms=t / 1e3, count=c) for k, (t, c) in ranked])


def attention_bandwidth(steps: list[Step], kernels: list[dict], kv_per_token: int,
                        bandwidth: float) -> dict:
    """The decode-attention kernel's KV read rate over a window: the KV bytes its steps'
    decode requests read (their context; this step's new token comes from registers)
    over the kernel's device time there. Empty when the window ran no such kernel."""
    ms = sum(r["ms"] for r in kernels if "_decode_kernel" in r["name"])
    if not ms:
        return {}
    kv = sum(s.decode_context for s in steps) * kv_per_token
    return dict(kv_gb=kv / 1e9, ms=ms, tb_s=kv / (ms / 1e3) / 1e12,
                of_copy=kv / (ms / 1e3) / bandwidth)


def summarize(steps: list[Step], weight_bytes: int, kv_per_token: int,
              bandwidth: float) -> dict:
    def roof(s: Step) -> float:
        return (weight_bytes + s.decode_context * kv_per_token) / bandwidth if s.decode_reqs else 0.0

    def row(label, chosen):
        wall = sum(s.wall_s for s in chosen)
        floor = sum(roof(s) for s in chosen)
        return dict(label=label, steps=len(chosen), wall_s=wall,
                    tokens=sum(s.decode_reqs for s in chosen),
                    host_bound_steps=sum(1 for s in chosen if s.wait_s < 1e-4),
                    wait_s=sum(s.wait_s for s in chosen), roofline_s=floor,
                    x_roofline=floor / wall if wall else 0.0)

    rows = [row("steps with prefill tokens", [s for s in steps if s.prefill_tokens])]
    decode = [s for s in steps if not s.prefill_tokens and s.decode_reqs]
    for low, high in BATCH_BUCKETS:
        label = f"decode, {low}+ sequences" if high > 10**8 else f"decode, {low}-{high} sequences"
        rows.append(row(label, [s for s in decode if low <= s.decode_reqs <= high]))
    rows.append(row("all steps", steps))
    return dict(rows=rows)


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'steps':34s} {'n':>5s} {'wall s':>7s} {'tokens':>7s} {'waited s':>8s} "
             f"{'host-bound':>10s} {'roofline s':>10s} {'x roof':>6s}"]
    for r in rows:
        lines.append(f"{r['label']:34s} {r['steps']:5d} {r['wall_s']:7.3f} {r['tokens']:7d} "
                     f"{r['wait_s']:8.3f} {r['host_bound_steps']:10d} {r['roofline_s']:10.3f} "
                     f"{r['x_roofline']:6.2f}")
    return "\n".join(lines)


def format_kernels(name: str, rows: list[dict]) -> str:
    lines = [f"--- {name}: time per kernel ---"]
    for r in rows:
        lines.append(f"{r['share'] * 100:5.1f}% {r['ms']:9.2f} ms {r['calls']:6d}  {r['name']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--probe-queue", action="store_true",
                        help="wait after each eager step's forward launch until the device "
                             "has run it, and report that wait (the 'behind' column)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model on the CPU, 8 sequences: checks the bookkeeping")
    args = parser.parse_args()
    from spindle import LLM

    cuda = not args.smoke
    shape = TINY if args.smoke else QWEN3_06B
    num_seqs = 8 if args.smoke else args.num_seqs
    prompts, outputs = nano_workload(num_seqs)
    if args.smoke:
        prompts = [[t % TINY["vocab_size"] for t in p[:40]] for p in prompts]
        outputs = [o // 40 for o in outputs]
    result: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if cuda else "cpu"}
    bandwidth = copy_bandwidth() if cuda else 20e9
    result["copy_bandwidth_TBps"] = bandwidth / 1e12
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "model", shape)
        llm = LLM(str(path), dtype="bfloat16", device="cuda" if cuda else "cpu",
                  max_model_len=4096 if cuda else 256, max_num_seqs=num_seqs,
                  max_num_batched_tokens=8192 if cuda else 512, enable_prefix_caching=False)
        runner = llm.engine.core.executor.worker.runner
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv_per_token = kv_bytes_per_token(shape)
        params = nano_params(outputs)
        llm.generate(prompts[:16], params[:16], use_tqdm=False)  # warm-up call
        # Windows: 6 steps of prompt chunks at the start, 30 full-batch decode steps
        # after the prefills, and 30 steps of the tail (the longest output is
        # max(outputs) steps; the last 30 have few sequences).
        last = max(outputs)
        windows = {"prefill": (1, 6), "full batch": (last // 4, last // 4 + 29),
                   "tail": (last - 40, last - 11)}
        # cProfile (host time by Python function) over prefill steps that no
        # torch.profiler window covers: where a prefill step's host time goes.
        host_window = (8, 13)
        recorder = StepRecorder(llm.engine, windows, cuda, host_window=host_window)
        eager = EagerStepTimer(runner, cuda, args.probe_queue)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        recorder.finish()
        if cuda:
            torch.cuda.synchronize()
        result.update(eager.report())
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        result.update(nano_tok_s=produced / seconds, nano_seconds=seconds,
                      output_tokens=produced, weight_bytes=weight_bytes)
        result.update(summarize(recorder.steps, weight_bytes, kv_per_token, bandwidth))
        result["kernels"] = {name: kernel_shares(prof, cuda)
                             for name, prof in recorder.profiles.items()}
        result["steps"] = [asdict(s) for s in recorder.steps]
        if recorder.host_profile is not None:
            text = io.StringIO()
            pstats.Stats(recorder.host_profile, stream=text).sort_stats("tottime").print_stats(30)
            result["prefill_host_profile"] = text.getvalue()
            result["prefill_host_steps"] = host_window
        result["timeline"] = {name: device_timeline(prof)
                              for name, prof in recorder.profiles.items()} if cuda else {}
        result["attention"] = {name: attention_bandwidth(
            recorder.steps[first:last + 1], result["kernels"].get(name, []), kv_per_token,
            bandwidth) for name, (first, last) in windows.items()}
        llm.shutdown()
    if "prefill_host_profile" in result:
        first, last = result["prefill_host_steps"]
        print(f"--- host time of prefill steps {first}-{last} (cProfile, by own time) ---")
        print(result["prefill_host_profile"].strip()[-6000:])
    for name, rows in result["kernels"].items():
        print(format_kernels(name, rows))
    print(format_eager_steps(result))
    print(format_rows(result["rows"]))
    for name, t in result["timeline"].items():
        if t:
            print(f"--- {name}: device busy {t['busy_ms']:.1f} of {t['span_ms']:.1f} ms "
                  f"({t['idle_share'] * 100:.1f}% idle); largest gaps:")
            for g in t["gaps"]:
                print(f"  {g['ms']:7.2f} ms {g['count']:5d}x  {g['between']}")
    for name, a in result["attention"].items():
        if a:
            print(f"decode attention, {name}: {a['kv_gb']:.1f} GB of KV in {a['ms']:.1f} ms, "
                  f"{a['tb_s']:.2f} TB/s = {a['of_copy']:.2f} x copy bandwidth")
    print(f"nano: {result['nano_tok_s']:.0f} tok/s in {result['nano_seconds']:.2f} s, "
          f"{len(result['steps'])} steps")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
