"""The multi-process executor's cost on CPU: per-step control overhead and end-to-end
throughput, side by side with the in-process executor.

1. Control overhead: executor.execute_model(empty SchedulerOutput) in a loop: the
   step message goes out through the shared-memory ring, the worker(s) return at once,
   the reply of rank 0 comes back. uni: a plain method call.
2. End-to-end: greedy generation of a batch with ignore_eos, tokens per second, for
   TP=1 (uni, all cores and one thread) and TP=2 (mp, gloo), and TP=2 with each
   worker given all cores (the oversubscription the default thread split avoids);
   the engines take turns, best and median of --repeats runs.

    python benchmarks/multiproc_overhead.py [--steps 3000 --batch 16 --new 64 --hidden 512]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build_model(out: Path, args) -> Path:
    from spindle.tools.tiny_model import make_tiny_model

    return make_tiny_model(out / "bench-llama", arch="llama", hidden_size=args.hidden,
                           num_layers=args.layers, num_heads=8, num_kv_heads=4,
                           intermediate_size=args.hidden * 3, vocab_size=args.vocab)


def control_overhead(path: Path, backend: str, tp: int, steps: int) -> dict:
    from spindle import LLM
    from spindle.step_messages import SchedulerOutput

    llm = LLM(str(path), device="cpu", max_model_len=512, tensor_parallel_size=tp,
              distributed_executor_backend=backend)
    executor = llm.engine.core.executor
    empty = SchedulerOutput()
    try:
        for _ in range(200):  # warm-up
            executor.execute_model(empty)
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            executor.execute_model(empty)
            samples.append(time.perf_counter() - start)
    finally:
        llm.shutdown()
    samples.sort()
    return {"backend": backend, "tp": tp, "median_us": statistics.median(samples) * 1e6,
            "mean_us": statistics.fmean(samples) * 1e6,
            "p99_us": samples[int(0.99 * len(samples))] * 1e6}


def throughput(path: Path, args) -> list[dict]:
    """All engines stay up and take turns, repeats times: on a shared machine, other
    load then hits every engine alike. Reports the best and the median run."""
    from spindle import LLM, SamplingParams
    import spindle.executor.multiproc as multiproc

    rng = random.Random(0)
    prompts = [[rng.randrange(10, args.vocab) for _ in range(args.prompt_len)]
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    cores = len(os.sched_getaffinity(0))

    def mp_engine(threads_per_worker: int | None) -> LLM:
        # The parent computes the workers' thread split and sends it: override it here.
        default = multiproc.worker_threads
        if threads_per_worker is not None:
            multiproc.worker_threads = lambda world_size: threads_per_worker
        try:
            return LLM(str(path), device="cpu", max_model_len=1024, tensor_parallel_size=2,
                       enable_prefix_caching=False)
        finally:
            multiproc.worker_threads = default

    uni = LLM(str(path), device="cpu", max_model_len=1024, enable_prefix_caching=False)
    # name -> (engine, torch threads of this process: the uni engine computes here)
    engines = {f"TP=1 uni, {cores} threads": (uni, cores), "TP=1 uni, 1 thread": (uni, 1),
               "TP=2 mp": (mp_engine(None), 1),
               f"TP=2 mp, {cores} threads/worker": (mp_engine(cores), 1)}
    seconds = {name: [] for name in engines}
    tokens = {}
    try:
        for llm, _ in engines.values():
            llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4),
                         use_tqdm=False)
        for _ in range(args.repeats):
            for name, (llm, threads) in engines.items():
                torch.set_num_threads(threads)
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds[name].append(time.perf_counter() - start)
                tokens[name] = [o.outputs[0].token_ids for o in outs]
    finally:
        for llm in {id(e): e for e, _ in engines.values()}.values():
            llm.shutdown()
    produced = args.batch * args.new
    reference = tokens[next(iter(tokens))]
    return [{"engine": name, "best_tok_s": produced / min(s), "median_tok_s": produced /
             statistics.median(s), "same_tokens_as_tp1": tokens[name] == reference}
            for name, s in seconds.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args)
        load_before = os.getloadavg()
        overhead = [control_overhead(path, "uni", 1, args.steps),
                    control_overhead(path, "mp", 1, args.steps),
                    control_overhead(path, "mp", 2, args.steps)]
        runs = throughput(path, args)
    cores = len(os.sched_getaffinity(0))
    print(json.dumps({
        "machine": f"{platform.machine()}, {cores} cores ({platform.processor() or 'cpu'})",
        "torch": torch.__version__, "python": platform.python_version(),
        "model": f"llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}",
        "load_average_before_after": [load_before, os.getloadavg()],
        "control_overhead": overhead, "throughput": runs, "repeats": args.repeats,
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new},
        indent=2))


if __name__ == "__main__":
    main()
