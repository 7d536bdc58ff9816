"""Where a batch-1 decode step's device time goes, on one GPU: throughput.py's batch-1
case (the Qwen3-0.6B-shaped checkpoint, a 512-token prompt, greedy) with torch.profiler
over the decode steps. Prints, per decode step: each kernel's device time and launches,
the wall time per step, the device's largest idle gaps (named by the kernels on either
side: a gap between one step's graph and the next step's sampler is host or scheduling
time), and the decode graph's replay time alone (the model's forward and its LM head,
which the graphs compute unless SPINDLE_GRAPH_LOGITS=0; no sampling or host work). A run
of one token (the prompt's prefill) is profiled too and subtracted, so the kernel table
holds the decode steps only.

The same two runs without the profiler (first, before any profiler ran in the process)
time how long the engine's host thread waits for each step's tokens (PendingOutput.get's
event): a step's wall time less that wait is the host's own work per step. Near zero
wait means the host, not the device, sets the pace (the device then idles between
replays): the waits' spread and how many were under 20 us tell whether it does so on
some steps only. The engine must run in this process (one GPU: the uni-process
executor).

    python benchmarks/batch1_profile.py [--new-tokens 64] [--context 512] [--json out.json]
                                        [--host-profile 30]

--host-profile N: last, the long run once more under cProfile, and the N functions with
the most own time per decode step (the prefill's run subtracted): where the host's own
work goes.

Environment switches (SPINDLE_PDL, SPINDLE_SKINNY_GEMM, ...) apply as in the engine, so
two runs compare a change kernel by kernel.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nano_breakdown import device_timeline  # noqa: E402
from throughput import QWEN3_06B, graph_replay_ms, write_random_checkpoint  # noqa: E402


def kernel_totals(prof) -> dict[str, tuple[float, int]]:
    """Device microseconds and launches per kernel name over a profiled block."""
    return {e.key: (e.self_device_time_total, e.count) for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0}


class HostWaits:
    """Seconds the host spends waiting in PendingOutput.get for a step's tokens, each
    wait, while installed (a patch of the class for this process)."""

    def __init__(self) -> None:
        from spindle.runner.async_output import PendingOutput
        self.cls, self.original = PendingOutput, PendingOutput.get
        self.each: list[float] = []

    @property
    def seconds(self) -> float:
        return sum(self.each)

    def __enter__(self) -> "HostWaits":
        original, probe = self.original, self

        def timed_get(pending):
            if pending._result is None and pending._event is not None:
                start = time.perf_counter()
                pending._event.synchronize()
                probe.each.append(time.perf_counter() - start)
            return original(pending)

        self.cls.get = timed_get
        return self

    def __exit__(self, *exc) -> None:
        self.cls.get = self.original


def host_pace(llm, prompt, greedy, steps: int) -> dict:
    """Unprofiled: wall time and host wait per decode step (a run of steps + 1 tokens
    less a run of 1), the host's own time per step (wall less wait), and the long run's
    waits: quartiles and how many were under 20 us (steps the host was late for)."""
    runs = {}
    for n in (1, steps + 1):
        with HostWaits() as waits:
            start = time.perf_counter()
            llm.generate([prompt], greedy(n), use_tqdm=False)
            runs[n] = (time.perf_counter() - start, waits.seconds, list(waits.each))
    (short_s, short_wait, short_each), (long_s, long_wait, long_each) = (runs[1],
                                                                         runs[steps + 1])
    wall_us = (long_s - short_s) * 1e6 / steps
    wait_us = (long_wait - short_wait) * 1e6 / steps
    each_us = sorted(w * 1e6 for w in long_each)
    quartiles = ([each_us[len(each_us) * q // 4] for q in (1, 2, 3)] if each_us
                 else [float("nan")] * 3)
    return {"wall_us": wall_us, "host_wait_us": wait_us, "host_work_us": wall_us - wait_us,
            "waits_counted": len(long_each) - len(short_each),
            "wait_quartiles_us": quartiles,
            "waits_under_20us": sum(w < 20 for w in each_us), "waits_in_long_run": len(each_us)}


def host_functions(llm, prompt, greedy, steps: int, top: int) -> list[dict]:
    """cProfile of a run of steps + 1 tokens less one of 1 token: each function's own and
    cumulative microseconds per decode step and calls per step, the top by own time."""
    import cProfile
    import pstats

    totals = {}
    for n in (1, steps + 1):
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate([prompt], greedy(n), use_tqdm=False)
        profiler.disable()
        totals[n] = pstats.Stats(profiler).stats  # {func: (cc, nc, tt, ct, callers)}
    rows = []
    for func, (_, calls, own, cumulative, _) in totals[steps + 1].items():
        _, base_calls, base_own, base_cum, _ = totals[1].get(func, (0, 0, 0.0, 0.0, None))
        filename, line, name = func
        rows.append(dict(name=f"{Path(filename).name}:{line}({name})",
                         own_us=(own - base_own) * 1e6 / steps,
                         cumulative_us=(cumulative - base_cum) * 1e6 / steps,
                         calls=(calls - base_calls) / steps))
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def decode_kernels(long: dict, short: dict, steps: int, top: int = 12) -> list[dict]:
    """Per decode step: the kernels of a run of steps + 1 tokens minus those of a run
    of 1 token (the same prompt's prefill), largest first."""
    rows = []
    for name, (us, count) in long.items():
        base_us, base_count = short.get(name, (0.0, 0))
        if us - base_us > 0:
            rows.append(dict(name=name[:90], us_per_step=(us - base_us) / steps,
                             launches_per_step=(count - base_count) / steps))
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["us_per_step"] / total
    return rows[:top] + [dict(name="(total)", us_per_step=total,
                              launches_per_step=sum(r["launches_per_step"] for r in rows),
                              share=1.0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also the N functions with the most host time per step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("batch1_profile.py needs a CUDA device")
    from spindle import LLM, SamplingParams

    prompt = [random.Random(1).randint(0, 10000) for _ in range(args.context)]
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "qwen3-0.6b-shape", QWEN3_06B)
        llm = LLM(str(path), dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
                  max_num_batched_tokens=8192, enable_prefix_caching=False)
        llm.generate([prompt], greedy(8), use_tqdm=False)  # warm-up
        replay = graph_replay_ms(llm)
        # Unprofiled first: a process that has run torch.profiler may stay slower after.
        pace = host_pace(llm, prompt, greedy, args.new_tokens)
        runs = {}
        for n in (1, args.new_tokens + 1):  # the prefill alone, then with the decode steps
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                out = llm.generate([prompt], greedy(n), use_tqdm=False)
                runs[n] = (time.perf_counter() - start, prof)
        functions = (host_functions(llm, prompt, greedy, args.new_tokens, args.host_profile)
                     if args.host_profile else [])
        llm.shutdown()
    steps = args.new_tokens
    (short_s, short_prof), (long_s, long_prof) = runs[1], runs[args.new_tokens + 1]
    kernels = decode_kernels(kernel_totals(long_prof), kernel_totals(short_prof), steps)
    timeline = device_timeline(long_prof)  # (with the prefill's step)
    step_us = (long_s - short_s) * 1e6 / steps
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(),
              "context": args.context, "decode_steps": steps,
              "profiled_step_us": step_us, "graph_replay_us_b1": replay.get(
                  "graph_replay_ms_b1", float("nan")) * 1e3,
              "tokens_hash": hash(tuple(out[0].outputs[0].token_ids)),
              "kernels": kernels, "timeline": timeline, "host_pace": pace,
              "host_functions": functions}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"{result['device']}, torch {result['torch']}; batch 1, {args.context}-token prompt,"
          f" {steps} decode steps under the profiler")
    print(f"wall per step (profiled, prefill subtracted) {step_us:8.1f} us; decode graph "
          f"replay alone {result['graph_replay_us_b1']:8.1f} us")
    if timeline:
        print(f"device busy {1 - timeline['idle_share']:.0%} of the profiled run's span "
              f"(prefill step included)")
    print(f"{'kernel':<60} {'us/step':>9} {'launches':>9} {'share':>6}")
    for row in kernels:
        print(f"{row['name'][:60]:<60} {row['us_per_step']:>9.1f} "
              f"{row['launches_per_step']:>9.1f} {row['share']:>6.1%}")
    for gap in timeline.get("gaps", []):
        print(f"gap {gap['ms'] * 1e3:8.1f} us in all, x{gap['count']:<4} {gap['between']}")
    if pace["waits_counted"]:
        print(f"unprofiled: {pace['wall_us']:.1f} us a step, the host waiting "
              f"{pace['host_wait_us']:.1f} us of it for the tokens: its own work "
              f"{pace['host_work_us']:.1f} us a step")
        q1, q2, q3 = pace["wait_quartiles_us"]
        print(f"  its waits: quartiles {q1:.1f} / {q2:.1f} / {q3:.1f} us; under 20 us "
              f"(the host late for the step): {pace['waits_under_20us']} of "
              f"{pace['waits_in_long_run']}")
    else:
        print("unprofiled: no waits seen in this process (an executor with workers?)")
    if functions:
        print(f"host under cProfile, per decode step: {'own us':>8} {'cum us':>8} {'calls':>6}")
        for row in functions:
            print(f"{row['name'][:62]:<62} {row['own_us']:>8.1f} {row['cumulative_us']:>8.1f} "
                  f"{row['calls']:>6.1f}")


if __name__ == "__main__":
    main()
