"""The batch-invariant GEMM (spindle/layers/invariant_gemm.py) against cuBLAS on the
Qwen3-0.6B layer shapes, by batch rows; and whether other tile configurations give the
same bits as the default one (if they do, a configuration could follow the batch
without breaking invariance).

    python benchmarks/invariant_gemm.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from spindle.layers.invariant_gemm import gemm_config, invariant_matmul

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024),
          "down": (1024, 3072), "lm_head": (151936, 1024)}
ROWS = [1, 8, 64, 256, 1024, 8192]
CANDIDATES = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=64, num_warps=w, num_stages=s)
              for m, n, w, s in [(16, 64, 4, 4), (32, 64, 4, 4), (64, 128, 4, 4),
                                 (128, 128, 8, 3), (128, 64, 4, 4), (64, 32, 4, 4)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "rows": []}
    print(f"{'layer':<8}{'M':>6}{'cuBLAS us':>11}{'invariant us':>14}{'ratio':>7}"
          f"{'best cand. us':>15}  configs with equal bits")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for m in ROWS:
            if name == "lm_head" and m > 256:
                continue  # (logits are computed for sampled rows only)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = invariant_matmul(x, w)
            t_cublas = do_bench(lambda: F.linear(x, w)) * 1e3
            t_inv = do_bench(lambda: invariant_matmul(x, w)) * 1e3
            same, cand_times = [], []
            for cfg in CANDIDATES:
                out = invariant_matmul(x, w, config=cfg)
                same.append(bool(torch.equal(out, base)))
                cand_times.append(do_bench(lambda: invariant_matmul(x, w, config=cfg)) * 1e3)
            best = min(range(len(CANDIDATES)), key=lambda i: cand_times[i])
            row = dict(layer=name, m=m, n=n, k=k, cublas_us=t_cublas, invariant_us=t_inv,
                       default_config=gemm_config(m, n, k, torch.bfloat16),
                       candidates=[dict(config=c, us=t, same_bits=s)
                                   for c, t, s in zip(CANDIDATES, cand_times, same)])
            result["rows"].append(row)
            equal = sum(same)
            print(f"{name:<8}{m:>6}{t_cublas:>11.1f}{t_inv:>14.1f}{t_inv / t_cublas:>7.2f}"
                  f"{cand_times[best]:>15.1f}  {equal}/{len(same)}"
                  f" (best: {CANDIDATES[best]['BLOCK_M']}x{CANDIDATES[best]['BLOCK_N']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
