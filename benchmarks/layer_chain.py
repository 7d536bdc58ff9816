"""The dense part of a decode step's layers at a few rows, as the engine runs it, on CUDA.

28 Qwen3-0.6B-shaped layers (each with its own weights: 880 MB, far more than L2) of
the engine's own modules, called as LlamaDecoderLayer calls them on a decode step:
input norm, qkv_proj, o_proj (of the first 2,048 qkv columns, standing in for
attention), post-attention norm, gate_up_proj, and the down projection with SiLU in its
loads; the norms and merges deferred where the layer defers them. One CUDA graph of the
28 layers, replayed; microseconds a layer (CUDA events, the median of --iters replays).
Attention is left out, so this is the part the GEMM kernels decide.

Switches apply as in the engine (SPINDLE_TMA_GEMV=0: the skinny GEMM at one row, the
norms as their own kernels; SPINDLE_PDL=0; ...), so runs with and without one compare
the chains:

    python benchmarks/layer_chain.py [--rows 1 2 4] [--layers 28]
    SPINDLE_TMA_GEMV=0 python benchmarks/layer_chain.py
"""

from __future__ import annotations

import argparse
import os

import torch
from gpu_timing import copy_bandwidth, graph_us

HIDDEN, INTERMEDIATE, Q_WIDTH, QKV_WIDTH = 1024, 3072, 2048, 4096  # Qwen3-0.6B


def make_layers(count: int, dtype: torch.dtype) -> list[dict]:
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                       RowParallelLinear)
    from spindle.layers.norm import RMSNorm

    group = TensorParallelGroup(rank=0, size=1)
    layers = []
    with torch.device("cuda"):
        for _ in range(count):
            layer = dict(
                input_norm=RMSNorm(HIDDEN), post_norm=RMSNorm(HIDDEN),
                qkv=ColumnParallelLinear(HIDDEN, QKV_WIDTH, tp_group=group),
                o=RowParallelLinear(Q_WIDTH, HIDDEN, tp_group=group),
                gate_up=MergedColumnParallelLinear(HIDDEN, [INTERMEDIATE] * 2, tp_group=group),
                down=RowParallelLinear(INTERMEDIATE, HIDDEN, tp_group=group))
            for module in layer.values():
                module.to(dtype)
                for p in module.parameters():
                    if p.dim() == 2:
                        p.data = torch.randn_like(p) / p.shape[1] ** 0.5
            layers.append(layer)
    return layers


def forward(layers: list[dict], hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """LlamaDecoderLayer.forward's calls, attention replaced by a view of qkv."""
    for layer in layers:
        normed, residual = layer["input_norm"].pre_norm(hidden, residual, defer=True)
        qkv = layer["qkv"](normed)
        out = layer["o"](qkv[:, :Q_WIDTH], defer_merge=True)
        normed, residual = layer["post_norm"](out, residual, defer=True)
        gate_up = layer["gate_up"](normed)
        hidden = layer["down"].silu_and_mul_forward(gate_up, defer_merge=True)
    return layers[0]["input_norm"](hidden, residual)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    torch.manual_seed(0)
    layers = make_layers(args.layers, torch.bfloat16)
    switches = {k: v for k, v in os.environ.items() if k.startswith("SPINDLE_")}
    print(f"{torch.cuda.get_device_name()}, copy {copy_bandwidth() / 1e12:.2f} TB/s, "
          f"switches {switches or 'none'}")
    weights = sum(p.numel() * p.element_size() for layer in layers
                  for module in layer.values() for p in module.parameters()) / args.layers
    print(f"{'rows':>4} | {'us a layer':>10} | {'weights GB/s':>12}")
    for rows in args.rows:
        hidden = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn_like(hidden)
        us = graph_us(lambda i: forward(layers, hidden, residual), args.iters, calls=1)
        us /= args.layers
        print(f"{rows:>4} | {us:>10.2f} | {weights / us / 1e3:>12.0f}")


if __name__ == "__main__":
    main()
