"""Does one big prompt stall everyone? A stream's worst gap between chunks while a
huge prompt arrives (AsyncLLM, CPU), and how long until that prompt is refused.

One greedy stream runs; once it has produced some chunks, a prompt far over
max_model_len is added. Reported per scenario (the median and the worst of the
repeats): the time until the big prompt is refused, and the stream's worst gap
between two chunks from the moment it arrived until the stream ends, next to the
stream's median gap and its worst gap before. A control run adds no prompt: its
worst gap over the same stretch is the machine's noise floor.

    python benchmarks/stall_under_big_prompt.py [--model DIR] [--repeats 3]

Run it against two checkouts (PYTHONPATH=...) to compare before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import time
from pathlib import Path

import torch
import transformers

SCENARIOS = {
    # name: (number of characters, how to make the prompt); the control adds none
    "none (control)": (0, None),
    "5 MB ASCII": (5_000_000, lambda n, rng: _words(n, rng, "abcdefghij klmnop qrstuvwxyz.")),
    "100 KB non-ASCII": (100_000, lambda n, rng: _words(n, rng, "é ü 中文 ß ø ñ ça")),
}


def _words(num_chars: int, rng: random.Random, alphabet: str) -> str:
    chunk = "".join(rng.choice(alphabet) for _ in range(10_000))
    return (chunk * (num_chars // len(chunk) + 1))[:num_chars]


async def one_run(engine, make_prompt, num_chars: int, rng: random.Random) -> dict:
    from spindle import SamplingParams

    big = make_prompt(num_chars, rng) if make_prompt is not None else None
    max_len = engine.config.model.max_model_len
    stream_params = SamplingParams(temperature=0.0, max_tokens=max_len - 16, ignore_eos=True)
    arrivals: list[float] = []
    submitted: list[float] = []

    async def read_stream() -> None:
        async for _ in engine.generate("Once upon a time", stream_params):
            arrivals.append(time.perf_counter())

    reader = asyncio.create_task(read_stream())
    while len(arrivals) < 20:
        await asyncio.sleep(0.001)
    submitted.append(time.perf_counter())
    refused = None
    try:
        if big is not None:
            async for _ in engine.generate(big, SamplingParams(max_tokens=1)):
                pass
    except ValueError:
        refused = time.perf_counter() - submitted[0]
    await reader
    before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b <= submitted[0]]
    after = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > submitted[0]]
    return {"refused_s": refused, "worst_gap_ms": 1000 * max(after),
            "median_gap_ms": 1000 * statistics.median(before + after),
            "noise_floor_ms": 1000 * max(before)}


async def main(args) -> None:
    from spindle.config import EngineArgs
    from spindle.engine.async_llm import AsyncLLM

    model = args.model or str(Path(__import__("spindle").__file__).parent / "demo_model")
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model, device="cpu", dtype="float32"))
    rng = random.Random(0)
    rows = []
    try:
        async for _ in engine.generate("warm up", None):
            pass
        for name, (num_chars, make_prompt) in SCENARIOS.items():
            runs = [await one_run(engine, make_prompt, num_chars, rng)
                    for _ in range(args.repeats)]
            rows.append((name, runs))
    finally:
        engine.shutdown()
    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; {args.repeats} runs each; model {model}")
    print("| big prompt | refused after (s) | stream's worst gap (ms) | median gap (ms) "
          "| worst gap before it (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in rows:
        refused = [r["refused_s"] for r in runs if r["refused_s"] is not None]
        print(f"| {name} | {_median_max(refused, '.3f')} "
              f"| {_median_max([r['worst_gap_ms'] for r in runs], '.0f')} "
              f"| {statistics.median(r['median_gap_ms'] for r in runs):.1f} "
              f"| {_median_max([r['noise_floor_ms'] for r in runs], '.0f')} |")


def _median_max(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} (worst {max(values):{fmt}})"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the built-in demo model)")
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
