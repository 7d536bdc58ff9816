"""Host time per launch of the ops an eager (prefill) step runs, on CUDA.

An eager step launches every op from Python: when the host takes longer to launch a
step than the device takes to run it, the device idles (nano_breakdown.py found the
prefill steps of the nano workload so). This times the host side only: CALLS launches
in a row, without waiting for the device between them, divided by CALLS. A GEMM is
timed with one shape repeated, with the row count changing every call (as the token
count of eager steps does), to see whether a new shape costs the host more, and with a
decoder layer's four projections in turn (Qwen3-0.6B's, 8,192 rows), as a prefill step
calls them: cProfile put 62 us of host time in each such call of the nano workload's
prefill steps (2026-12-06), against about 19 us for one shape repeated. --blas picks
torch's GEMM library (torch.backends.cuda.preferred_blas_library) for the run.

    python benchmarks/host_launch.py [--calls 200] [--blas cublas|cublaslt]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def host_us(fn, calls: int) -> float:
    """Host microseconds per fn(i) call, the device drained before and after."""
    fn(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--blas", choices=["cublas", "cublaslt"],
                        help="torch's GEMM library for the run (default: torch's choice)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_launch.py needs a CUDA device")
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    from spindle.layers.fused_kernels import rms_norm, silu_and_mul

    bf16, dev, calls = torch.bfloat16, "cuda", args.calls
    w = torch.randn(6144, 1024, dtype=bf16, device=dev)
    big = torch.randn(8192, 1024, dtype=bf16, device=dev)
    small = big[:256]
    norm_w = torch.ones(1024, dtype=bf16, device=dev)
    gate_up = torch.randn(8192, 6144, dtype=bf16, device=dev)
    # A layer's projections (out, in): qkv, o_proj, gate_up, down; inputs of 8,192 rows.
    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
    layer_w = [torch.randn(n, k, dtype=bf16, device=dev) for n, k in shapes]
    layer_x = [torch.randn(8192, k, dtype=bf16, device=dev) for _, k in shapes]
    rows = [
        ("F.linear, 8192 x 1024 -> 6144, same shape", lambda i: F.linear(big, w)),
        ("F.linear, 8192 - i rows (a new shape each call)", lambda i: F.linear(big[:8192 - i], w)),
        ("F.linear, 256 rows", lambda i: F.linear(small, w)),
        ("F.linear, a layer's four projections in turn",
         lambda i: F.linear(layer_x[i % 4], layer_w[i % 4])),
        ("torch.add, 8192 x 1024", lambda i: torch.add(big, big)),
        ("Triton RMSNorm + residual, 8192 rows", lambda i: rms_norm(big, norm_w, 1e-6, big)),
        ("Triton SiLU-and-mul, 8192 rows", lambda i: silu_and_mul(gate_up)),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"BLAS {torch.backends.cuda.preferred_blas_library()}")
    print(f"{'op':<52} {'host us/call':>12}")
    for name, fn in rows:
        print(f"{name:<52} {host_us(fn, calls):>12.1f}")


if __name__ == "__main__":
    main()
