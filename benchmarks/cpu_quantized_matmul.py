"""The matmuls a CPU decode step could use, on SmolLM2-135M's linear layers: torch's
float32 and bf16 F.linear, its int8 weight-only matmul (one scale per output channel)
and its int4 one (groups of 32 along K, a scale and a zero per group: the layout of
GGUF's Q4_0 / Q4_1, w = (q - 8) * scale + zero), with bf16 and float32 activations.

Each layer of the model gets its own weights (30 layers x qkv, o, gate_up, down), so
the weights stream from memory as in a real decode step, not from cache. Prints the
milliseconds of one pass over all of them at 1 and 8 rows; the timings are for
planning the CPU path (the issue on CPU speed), not a measurement of the engine.

    python benchmarks/cpu_quantized_matmul.py [--layers 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, intermediate 1536.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
GROUP = 32


def time_pass(calls, repeats: int = 5) -> float:
    """Milliseconds of one pass over calls (after a warm-up pass)."""
    for call in calls:
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            call()
    return (time.perf_counter() - start) / repeats * 1e3


def int4_weight(n: int, k: int, dtype: torch.dtype):
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_and_zeros = (torch.rand(k // GROUP, n, 2) * 0.01).to(dtype)
    return packed, scales_and_zeros


def measure(rows: int, layers: int) -> dict[str, float]:
    x32 = {k: torch.randn(rows, k) for _, k in SHAPES}
    x16 = {k: v.bfloat16() for k, v in x32.items()}
    shapes = SHAPES * layers
    result = {}
    weights = [torch.randn(n, k) / k ** 0.5 for n, k in shapes]
    result["fp32 F.linear"] = time_pass([lambda w=w: F.linear(x32[w.shape[1]], w)
                                         for w in weights])
    weights = [w.bfloat16() for w in weights]
    result["bf16 F.linear"] = time_pass([lambda w=w: F.linear(x16[w.shape[1]], w)
                                         for w in weights])
    del weights
    int8 = [(torch.randint(-127, 128, (n, k), dtype=torch.int8),
             torch.rand(n).bfloat16() * 0.01) for n, k in shapes]
    result["int8 per channel, bf16 x"] = time_pass(
        [lambda q=q, s=s: torch._weight_int8pack_mm(x16[q.shape[1]], q, s) for q, s in int8])
    del int8
    for label, dtype, x in (("bf16", torch.bfloat16, x16), ("fp32", torch.float32, x32)):
        int4 = [(k, *int4_weight(n, k, dtype)) for n, k in shapes]
        result[f"int4 group {GROUP}, {label} x"] = time_pass(
            [lambda k=k, p=p, sz=sz, x=x: torch._weight_int4pack_mm_for_cpu(x[k], p, GROUP, sz)
             for k, p, sz in int4])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs = {rows: measure(rows, args.layers) for rows in (1, 8)}
    result = {"date": time.strftime("%Y-%m-%d"),
              "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "layers": args.layers, "ms_per_pass": runs}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(f"{'matmul':<28}{'1 row ms':>10}{'8 rows ms':>11}")
    for name in runs[1]:
        print(f"{name:<28}{runs[1][name]:>10.1f}{runs[8][name]:>11.1f}")


if __name__ == "__main__":
    main()
