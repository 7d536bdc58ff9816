"""The skinny Triton GEMM against F.linear (cuBLAS) at decode batch sizes, on CUDA.

For M in 1, 2, 4, 8 (or --m, up to 256) and Qwen3-0.6B's four projections plus its LM
head: the time per call and the weight-streaming bandwidth it reaches; at one row on a
GPU with TMA also the TMA GEMV's (tma_gemv.py), which the engine uses there. Each timed graph
replays gpu_timing.CALLS calls that cycle through enough copies of the weight (over 256
MB) that no call finds its weight in L2, as in a decode step; a call's time is the
replay time (CUDA events, median of --iters replays after a warm-up) over those calls,
launch gaps included as in a captured decode step. Outputs are checked against a float32
reference first. The device-to-device copy rate is printed as the bandwidth ceiling.

    python benchmarks/skinny_gemm.py                  # the table
    python benchmarks/skinny_gemm.py --sweep --m 1 8  # also the best tile configs
    python benchmarks/skinny_gemm.py --sweep --tiles 16x1024 32x512  # only these tiles,
                                                      # every config's time printed
    python benchmarks/skinny_gemm.py --sweep --m 256 --block-m 64 256  # also row blocks
                                                      # other than the engine's block_m(M)
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import torch
import torch.nn.functional as F
from gpu_timing import copy_bandwidth, graph_us

SHAPES = {  # name: (N, K) of the weight
    "qkv_proj": (4096, 1024),
    "gate_up_proj": (6144, 1024),
    "o_proj": (1024, 2048),
    "down_proj": (1024, 3072),
    "lm_head": (151936, 1024),
}
ROTATE_BYTES = 256 << 20


SWEEP_TILES = ((32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128))


def sweep_configs(n: int, k: int, num_sms: int, tiles=SWEEP_TILES, m: int = 1,
                  stages=(3, 4), block_ms=(None,)):
    """Tiles x warps x stages (x row blocks: None is the engine's block_m(m)), each with
    its default split for m rows, half and twice that."""
    from spindle.layers.skinny_gemm import SkinnyConfig, pick_config, row_blocks

    for (block_n, block_k), warps, stage, rows_block in itertools.product(
            tiles, (4, 8), stages, block_ms):
        if k % block_k:
            continue
        auto = pick_config(n, k, num_sms,
                           SkinnyConfig(block_n, block_k, 1, warps, stage, rows_block),
                           **row_blocks(m, rows_block))
        for split in sorted({auto.split_k // 2, auto.split_k, auto.split_k * 2} - {0}):
            if k % (split * block_k) == 0:
                yield replace(auto, split_k=split)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--sweep", action="store_true",
                        help="also time every tile config, report the best per shape")
    parser.add_argument("--tiles", nargs="+", metavar="NxK",
                        help="with --sweep: only these (block_n x block_k) tiles, each "
                        "config's time printed (a tile as wide as a split's K loads the "
                        "program's whole weight before waiting for the kernel before)")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4],
                        help="with --sweep: the pipeline depths tried")
    parser.add_argument("--block-m", type=int, nargs="+", metavar="ROWS",
                        help="with --sweep: also these row blocks (rows of x a program "
                        "multiplies; default only the engine's, block_m(M))")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    from spindle.layers.skinny_gemm import (_num_sms, max_rows, new_split_counters,
                                            pick_config, row_blocks, skinny_linear)
    from spindle.layers.tma_gemv import tma_gemv, tma_gemv_applies

    dtype = getattr(torch, args.dtype)
    tiles = SWEEP_TILES
    if args.tiles:
        try:
            tiles = tuple(tuple(int(v) for v in t.lower().split("x")) for t in args.tiles)
        except ValueError:
            raise SystemExit(f"--tiles takes NxK pairs such as 16x1024, got {args.tiles}")
    if max(args.m) > max_rows():
        print(f"(M above {max_rows()} launches without PDL: set SPINDLE_SKINNY_MAX_M to time "
              f"the chain as the engine would run it)")
    num_sms = _num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: {num_sms} SMs, device copy "
          f"{copy_bandwidth() / 1e12:.2f} TB/s (read + write)")
    rows, tma_rows = [], []
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
                   for _ in range(copies)]
        counters = new_split_counters(n, "cuda")  # as a layer's own buffer
        # (Row blocks below the engine's make more output tiles than a layer's counters
        # cover, and skinny_linear would not split K for them.)
        sweep_counters = torch.zeros(max(counters.numel(), 4 * n), dtype=torch.int32,
                                     device="cuda")
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = (x.float() @ weights[0].float().T)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            skinny_linear(x, weights[0], out=out, counters=counters)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:  # (NaN fails too)
                raise SystemExit(f"{name} M={m}: relative error {err:.2e}")
            moved = (n * k + m * k + m * n) * dtype.itemsize
            cublas = graph_us(lambda i: F.linear(x, weights[i % copies]), args.iters)
            auto = pick_config(n, k, num_sms, **row_blocks(m))
            # (A config given: the skinny kernel itself, also where one row would go to
            # the TMA GEMV, timed beside it.)
            skinny = graph_us(lambda i: skinny_linear(x, weights[i % copies], config=auto,
                                                      counters=counters), args.iters)
            tma = (graph_us(lambda i: tma_gemv(x, weights[i % copies]), args.iters)
                   if tma_gemv_applies(x, weights[0]) else None)
            best, best_cfg = skinny, auto
            if args.sweep:
                for cfg in sweep_configs(n, k, num_sms, tiles, m, args.stages,
                                         [None, *(args.block_m or [])]):
                    try:
                        t = graph_us(lambda i: skinny_linear(x, weights[i % copies], config=cfg,
                                                            counters=sweep_counters),
                                    max(50, args.iters // 4))
                    except Exception as exc:  # (a config that does not compile: skip it)
                        print(f"  {name} M={m} {cfg}: {type(exc).__name__}")
                        continue
                    if args.tiles:
                        print(f"  {name} M={m} {cfg}: {t:.2f} us")
                    if t < best:
                        best, best_cfg = t, cfg
            rows.append((name, n, k, m, cublas, moved / cublas / 1e6, skinny,
                         moved / skinny / 1e6, cublas / skinny, err, auto, best, best_cfg))
            tma_rows.append((name, m, tma))
            print(f"  {name} M={m}: F.linear {cublas:.2f} us, skinny {skinny:.2f} us"
                  + (f", TMA GEMV {tma:.2f} us" if tma is not None else ""), flush=True)
    print(f"\n{'shape':>13} {'N':>6} {'K':>5} {'M':>3} | {'F.linear us':>11} {'TB/s':>5} | "
          f"{'skinny us':>9} {'TB/s':>5} | {'speedup':>7} | {'rel err':>7} | "
          f"default tiles (n, k, split, warps, stages)")
    for (name, n, k, m, cublas, cublas_bw, skinny, skinny_bw, speedup, err, auto, best,
         best_cfg) in rows:
        print(f"{name:>13} {n:>6} {k:>5} {m:>3} | {cublas:>11.2f} {cublas_bw:>5.2f} | "
              f"{skinny:>9.2f} {skinny_bw:>5.2f} | {speedup:>7.2f} | {err:>7.1e} | "
              f"{auto.block_n}, {auto.block_k}, {auto.split_k}, {auto.num_warps}, "
              f"{auto.num_stages}")
    if args.sweep:
        print(f"\n{'shape':>13} {'M':>3} | {'default us':>10} | {'best us':>7} {'TB/s':>5} | "
              f"best tiles (n, k, split, warps, stages, rows)")
        for (name, n, k, m, _, _, skinny, _, _, _, _, best, cfg) in rows:
            moved = (n * k + m * k + m * n) * dtype.itemsize
            print(f"{name:>13} {m:>3} | {skinny:>10.2f} | {best:>7.2f} {moved / best / 1e6:>5.2f}"
                  f" | {cfg.block_n}, {cfg.block_k}, {cfg.split_k}, {cfg.num_warps}, "
                  f"{cfg.num_stages}, {cfg.block_m or 'block_m(M)'}")
    if any(t is not None for _, _, t in tma_rows):
        print(f"\n{'shape':>13} {'M':>3} | {'TMA GEMV us':>11} (tma_gemv.py, one row)")
        for name, m, t in tma_rows:
            if t is not None:
                print(f"{name:>13} {m:>3} | {t:>11.2f}")
    per_layer = {m: sum(r[6] for r in rows if r[3] == m and r[0] != "lm_head") for m in args.m}
    per_layer_ref = {m: sum(r[4] for r in rows if r[3] == m and r[0] != "lm_head")
                     for m in args.m}
    for m in args.m:
        print(f"M={m}: one layer's four projections {per_layer_ref[m]:.2f} us (F.linear) -> "
              f"{per_layer[m]:.2f} us (skinny)")


if __name__ == "__main__":
    main()
