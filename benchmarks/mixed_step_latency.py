"""How long decoding streams wait while new prompts are prefilled beside them, on one GPU.

N streams decode (prompts of --context tokens, greedy, EOS ignored). Once every one of
them is decoding, --steps steps give their time between two tokens. Then --new prompts
of --prompt-len tokens arrive at once: the steps that carry their chunks are mixed
steps (each stream's one token beside prompt chunks), and their times are what every
stream waits between two tokens while the prompts prefill. Reported: the median step
before, the mixed steps (how many, the longest, their sum), each new prompt's time to
its first token, and the median step after. Qwen3-0.6B's shape with random bf16 weights
(benchmarks/throughput.py's checkpoint), max_num_batched_tokens 8,192. Compare the
mixed steps' attention split between the kernels (the default) with one kernel in two
processes:

    python benchmarks/mixed_step_latency.py [--streams 200] [--context 1000] [--json out.json]
    SPINDLE_MIXED_DECODE_KERNEL=0 python benchmarks/mixed_step_latency.py
    python benchmarks/mixed_step_latency.py --smoke   # a tiny model on the CPU: the bookkeeping

(Written in the thirtieth session after its device time was spent: run on the CPU only.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nano_breakdown import TINY  # noqa: E402
from throughput import QWEN3_06B, write_random_checkpoint  # noqa: E402


class Run:
    """An engine driven step by step, each step timed, each request's first token noted."""

    def __init__(self, llm) -> None:
        self.engine = llm.engine
        self.first_token: dict[str, float] = {}

    def step(self) -> float:
        start = time.perf_counter()
        outputs = self.engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids:
                self.first_token.setdefault(out.request_id, now)
        return now - start

    def until_first_tokens(self, request_ids: list[str], limit: int = 10_000) -> list[float]:
        """Steps until every one of request_ids has its first token: their times."""
        times = []
        while not all(r in self.first_token for r in request_ids):
            if len(times) == limit:
                raise RuntimeError(f"no first token for some of {request_ids[:4]}... "
                                   f"after {limit} steps")
            times.append(self.step())
        return times


def measure(args) -> dict:
    from spindle import LLM, SamplingParams

    shape, device = (TINY, "cpu") if args.smoke else (QWEN3_06B, "cuda")
    rng = random.Random(0)
    vocab = min(shape["vocab_size"], 10_000)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(n)]}

    # Streams outlast the run: every step before, during and after the arrival.
    stream_tokens = args.steps * 2 + 2 * args.new * args.prompt_len // args.budget + 64
    max_len = max(args.context + stream_tokens, args.prompt_len + 8)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "model", shape)
        llm = LLM(str(path), dtype="bfloat16", device=device, max_model_len=max_len,
                  max_num_seqs=args.streams + args.new, max_num_batched_tokens=args.budget,
                  enable_prefix_caching=False)
        try:
            run = Run(llm)
            streams = [f"stream-{i}" for i in range(args.streams)]
            stream_params = SamplingParams(temperature=0.0, max_tokens=stream_tokens,
                                           ignore_eos=True)
            for rid in streams:
                llm.engine.add_request(prompt(args.context), stream_params, request_id=rid)
            run.until_first_tokens(streams)
            before = [run.step() for _ in range(args.steps)]
            new = [f"new-{i}" for i in range(args.new)]
            arrival = time.perf_counter()
            for rid in new:
                llm.engine.add_request(prompt(args.prompt_len),
                                       SamplingParams(temperature=0.0, max_tokens=8,
                                                      ignore_eos=True), request_id=rid)
            mixed = run.until_first_tokens(new)
            after = [run.step() for _ in range(args.steps)]
            for rid in streams + new:
                llm.engine.abort_request(rid)
        finally:
            llm.shutdown()
    return dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        torch=torch.__version__, split=os.environ.get("SPINDLE_MIXED_DECODE_KERNEL", "1"),
        streams=args.streams, context=args.context, new=args.new, prompt_len=args.prompt_len,
        budget=args.budget, step_before_ms=statistics.median(before) * 1e3,
        mixed_steps=len(mixed), mixed_ms=[t * 1e3 for t in mixed],
        ttft_ms=[(run.first_token[r] - arrival) * 1e3 for r in new],
        step_after_ms=statistics.median(after) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--context", type=int, default=1000, help="each stream's prompt")
    parser.add_argument("--new", type=int, default=4, help="prompts arriving at once")
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--steps", type=int, default=32, help="steps timed before and after")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model on the CPU, a few requests: checks the bookkeeping")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.streams, args.context, args.new, args.prompt_len = 6, 40, 2, 100
        args.budget, args.steps = 64, 4
    elif not torch.cuda.is_available():
        raise SystemExit("mixed_step_latency.py needs a CUDA device (or --smoke)")
    r = measure(args)
    print(f"{r['device']}, torch {r['torch']}, SPINDLE_MIXED_DECODE_KERNEL={r['split']}: "
          f"{r['streams']} streams of {r['context']} tokens, {r['new']} prompts of "
          f"{r['prompt_len']} arriving, {r['budget']} tokens a step")
    print(f"{'step before':>12} {'mixed steps':>11} {'longest':>9} {'their sum':>10} "
          f"{'TTFT, ms':>20} {'step after':>11}")
    ttft = "/".join(f"{t:.0f}" for t in r["ttft_ms"])
    print(f"{r['step_before_ms']:>9.2f} ms {r['mixed_steps']:>11d} "
          f"{max(r['mixed_ms']):>6.2f} ms {sum(r['mixed_ms']):>7.2f} ms {ttft:>20} "
          f"{r['step_after_ms']:>8.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
