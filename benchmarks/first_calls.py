"""What an engine's eager steps pay the first time, on CUDA, once the engine is ready:

- the host's wait at GEMMs whose row count makes cuBLAS pick a kernel it has not used in
  this process (it loads that kernel itself; CUDA_MODULE_LOADING does not change it):
  the LM head at every row count up to max_num_seqs, and a qkv_proj-shaped GEMM at row
  counts from 1 to max_num_batched_tokens, each call behind a short busy kernel so that
  a wait for the device shows, then the same again;
- a GEMM's host time at a new row count against a seen one (the device idle);
- a lone prompt's time to first token at lengths never seen, then again;
- with --sync-check, torch.cuda.set_sync_debug_mode over a nano-shaped run (outputs
  capped at 48 tokens): every host-device synchronisation inside the engine's steps,
  by where in spindle it happened (the engine's own waits for step results are events,
  which the mode does not flag).

Same Qwen3-0.6B-shaped random checkpoint and engine settings as throughput.py.

    python benchmarks/first_calls.py [--sync-check] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from throughput import QWEN3_06B, nano_workload, write_random_checkpoint

BUSY_CYCLES = 3_000_000  # about 1.5 ms of a device kernel before each timed call
SLOW_MS = 1.0


def host_ms_behind_busy_device(fn) -> float:
    """Host milliseconds of fn() launched behind a kernel that keeps the device busy."""
    torch.cuda._sleep(BUSY_CYCLES)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def slow_first_calls(name: str, rows: range, call) -> list[dict]:
    """Two passes over the row counts: the calls whose host time passed SLOW_MS."""
    out = []
    for pass_number in (1, 2):
        slow = [(m, t) for m in rows
                if (t := host_ms_behind_busy_device(lambda: call(m))) > SLOW_MS]
        torch.cuda.synchronize()
        out.append(dict(op=name, pass_number=pass_number, calls=len(rows), slow=len(slow),
                        slow_ms=round(sum(t for _, t in slow), 2),
                        slow_rows=[m for m, _ in slow]))
    return out


def median_of_two_passes(items, seconds_of) -> list[float]:
    """The median of seconds_of(item) over items, twice: first uses, then repeats."""
    return [statistics.median(seconds_of(item) for item in items) for _ in range(2)]


def new_shape_host_us(hidden: torch.Tensor, weight: torch.Tensor, first: int) -> list[float]:
    """Host us of F.linear at 40 row counts never seen, then at the same again."""
    def seconds(m: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        F.linear(hidden[:m], weight)
        return time.perf_counter() - start
    return [t * 1e6 for t in median_of_two_passes(range(first, first + 40), seconds)]


def first_token_ms(llm, lengths: range) -> list[float]:
    """Ms to one token of a lone prompt at each length: lengths never seen, then again."""
    from spindle import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)

    def seconds(n: int) -> float:
        start = time.perf_counter()
        llm.generate([[5] * n], [one], use_tqdm=False)
        return time.perf_counter() - start
    return [t * 1e3 for t in median_of_two_passes(lengths, seconds)]


def synchronisations(llm) -> dict:
    """set_sync_debug_mode('warn') over a nano-shaped run: count by spindle stack."""
    from spindle import SamplingParams

    prompts, outputs = nano_workload(256)
    params = [SamplingParams(max_tokens=min(o, 48), ignore_eos=True, temperature=0.0)
              for o in outputs]
    stacks: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "spindle" in f.filename]
        stacks[(str(message)[:80],) + tuple(f"{Path(f.filename).name}:{f.lineno}:{f.name}"
                                            for f in frames[-6:])] += 1

    shown, filters = warnings.showwarning, warnings.filters[:]
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning, warnings.filters[:] = shown, filters
    inside = {k: n for k, n in stacks.items() if len(k) > 1}  # (with a spindle frame)
    return dict(messages=sum(stacks.values()),
                in_spindle=[dict(count=n, where=list(k)) for k, n in
                            sorted(inside.items(), key=lambda item: -item[1])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync-check", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("first_calls.py measures CUDA: no GPU here")
    from spindle import LLM

    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "model", QWEN3_06B)
        llm = LLM(str(path), dtype="bfloat16", device="cuda", max_model_len=4096,
                  max_num_seqs=256, max_num_batched_tokens=8192, enable_prefix_caching=False)
        state = llm.engine.core.executor.worker.runner._require_state()
        hidden = torch.randn(8192, QWEN3_06B["hidden_size"], device="cuda",
                             dtype=torch.bfloat16)
        qkv = torch.randn(4096, QWEN3_06B["hidden_size"], device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            rows = (slow_first_calls("LM head", range(1, 257),
                                     lambda m: state.compute_logits(hidden[:m]))
                    + slow_first_calls("qkv_proj shape", range(1, 8193, 37),
                                       lambda m: F.linear(hidden[:m], qkv)))
            new_us, seen_us = new_shape_host_us(hidden, qkv, 3001)
        new_ms, seen_ms = first_token_ms(llm, range(601, 621))
        result.update(first_calls=rows, linear_host_us=dict(new=new_us, seen=seen_us),
                      first_token_ms=dict(new=new_ms, seen=seen_ms))
        if args.sync_check:
            result["synchronisations"] = synchronisations(llm)
    print(f"{'op':16s} {'pass':>4s} {'calls':>5s} {'> 1 ms':>6s} {'their ms':>8s}  rows")
    for r in rows:
        print(f"{r['op']:16s} {r['pass_number']:4d} {r['calls']:5d} {r['slow']:6d} "
              f"{r['slow_ms']:8.1f}  {r['slow_rows'][:12]}")
    print(f"F.linear host us, new row counts {new_us:.0f}, seen {seen_us:.0f}; a lone prompt "
          f"of 601-620 tokens to its first token: new lengths {new_ms:.2f} ms, seen "
          f"{seen_ms:.2f} ms")
    if args.sync_check:
        sync = result["synchronisations"]
        print(f"synchronisations in spindle's steps: {len(sync['in_spindle'])} places "
              f"({sync['messages']} messages in all)")
        for place in sync["in_spindle"][:10]:
            print(f"  {place['count']:5d}  {' <- '.join(reversed(place['where'][1:]))}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
