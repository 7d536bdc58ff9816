"""The greedy token after the LM head on CUDA: torch's argmax against the Triton one
(runner/sample/argmax_kernel.py), as a decode graph runs them.

Qwen3-0.6B's head shape (1,024 -> 151,936, bf16) at a few rows. One CUDA graph of
--calls steps, each the engine's LM-head GEMM (apply_linear: the one-row GEMV or the skinny
Triton GEMM up to 16 rows, cuBLAS beyond) followed by nothing, by torch's argmax or by the Triton
argmax; microseconds a step (CUDA events, the median of --iters replays). The
difference from the head alone is what the argmax adds to a graph; the eager column
times the argmax alone, launched and timed on its own (as the sampler runs it outside
the graphs), and the host column what launching it costs the host (200 calls queued
without waiting, a mean).

    python benchmarks/greedy_argmax.py [--rows 1 2 4 8 16 64 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from gpu_timing import eager_us, graph_us

HIDDEN, VOCAB = 1024, 151936
HOST_CALLS = 200


def host_us(fn) -> float:
    """Mean host microseconds of one fn() call, HOST_CALLS queued without waiting."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from spindle.layers.linear import apply_linear
    from spindle.runner.sample.argmax_kernel import argmax_rows

    import triton
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16, device="cuda") / HIDDEN ** 0.5
    argmaxes = {"torch": lambda logits: logits.argmax(dim=-1), "triton": argmax_rows}
    results = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; us a step (head, then argmax), median of {args.iters}")
    print(f"{'rows':>4} | {'head':>7} | {'+torch':>7} | {'+triton':>7} | "
          f"{'torch eager':>11} | {'triton eager':>12} | {'torch host':>10} | "
          f"{'triton host':>11} | same")
    for rows in args.rows:
        hidden = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
        logits = apply_linear(hidden, weight)
        same = torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
        row = {"rows": rows, "same": same,
               "head_us": graph_us(lambda i: apply_linear(hidden, weight), args.iters,
                                   args.calls)}
        for name, argmax in argmaxes.items():
            row[f"{name}_graph_us"] = graph_us(
                lambda i, argmax=argmax: argmax(apply_linear(hidden, weight)), args.iters,
                args.calls)
            row[f"{name}_eager_us"] = eager_us(lambda argmax=argmax: argmax(logits), args.iters)
            row[f"{name}_host_us"] = host_us(lambda argmax=argmax: argmax(logits))
        results.append(row)
        print(f"{rows:>4} | {row['head_us']:>7.2f} | {row['torch_graph_us']:>7.2f} | "
              f"{row['triton_graph_us']:>7.2f} | {row['torch_eager_us']:>11.2f} | "
              f"{row['triton_eager_us']:>12.2f} | {row['torch_host_us']:>10.1f} | "
              f"{row['triton_host_us']:>11.1f} | {'yes' if same else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "torch": torch.__version__,
                                         "triton": triton.__version__, "rows": results},
                                        indent=1))


if __name__ == "__main__":
    main()
