"""The dense part of a decode step's layers at a few rows, as the engine runs it, on CUDA;
with --context, decode attention too.

28 Qwen3-0.6B-shaped layers (each with its own weights: 880 MB, far more than L2) of
the engine's own modules, called as LlamaDecoderLayer calls them on a decode step:
input norm, qkv_proj, o_proj (of the first 2,048 qkv columns, standing in for
attention), post-attention norm, gate_up_proj, and the down projection with SiLU in its
loads; the norms and merges deferred where the layer defers them. One CUDA graph of the
28 layers, replayed; microseconds a layer (CUDA events, the median of --iters replays).
Attention is left out, so this is the part the GEMM kernels decide.

--context N: each layer runs the engine's Triton decode attention between qkv_proj and
o_proj (Qwen3's q/k norms and rotary fused in, 16 query heads over 8 KV heads, 16-token
pages), each row a request with N tokens of context before its new one; the difference
from a run without it (context 0, when asked for too) is what attention costs the chain,
and the KV it reads in that time is its bandwidth, to hold against
`decode_attention.py`'s kernel alone. --drawn: each row's context drawn uniformly from
100 to 2N - 100 tokens instead (about N on average; N >= 100), the requests started
longest first as the runner starts them: `--rows 256 --context 0 640 --drawn` is close
to a full-batch decode step of the nano workload (its contexts average about 640).

Switches apply as in the engine (SPINDLE_TMA_GEMV=0: the skinny GEMM at one row, the
norms as their own kernels; SPINDLE_DECODE_PER_HEAD=0; SPINDLE_PDL=0; ...), so runs with
and without one compare the chains:

    python benchmarks/layer_chain.py [--rows 1 2 4] [--layers 28] [--context 0 640 2048]
        [--drawn]
    SPINDLE_TMA_GEMV=0 python benchmarks/layer_chain.py
"""

from __future__ import annotations

import argparse
import os

import torch
from decode_attention import HEAD_DIM, HEADS, KV_HEADS, decode_step, kv_bytes
from gpu_timing import copy_bandwidth, graph_us

HIDDEN, INTERMEDIATE, Q_WIDTH, QKV_WIDTH = 1024, 3072, 2048, 4096  # Qwen3-0.6B
PAGE = 16


def make_layers(count: int, dtype: torch.dtype) -> list[dict]:
    from spindle.distributed.parallel_state import TensorParallelGroup
    from spindle.layers.activation import SiluAndMul
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
                down=RowParallelLinear(INTERMEDIATE, HIDDEN, tp_group=group),
                act=SiluAndMul())
            for module in layer.values():
                module.to(dtype)
                for p in module.parameters():
                    if p.dim() == 2:
                        p.data = torch.randn_like(p) / p.shape[1] ** 0.5
            layers.append(layer)
    return layers


def context_lengths(rows: int, context: int, drawn: bool) -> torch.Tensor:
    """Each row's tokens of context before its new one: context for every row, or (with
    drawn) uniformly from 100 to 2 * context - 100 (a fixed seed)."""
    if not drawn:
        return torch.full((rows,), context, dtype=torch.int32)
    if context < 100:
        raise SystemExit(f"--drawn needs contexts of at least 100 tokens, got {context}")
    gen = torch.Generator().manual_seed(rows)
    return torch.randint(100, 2 * context - 100 + 1, (rows,), generator=gen,
                         dtype=torch.int32)


def add_attention(layers: list[dict], contexts: torch.Tensor, dtype: torch.dtype) -> dict:
    """Give each layer a decode-attention backend, q/k norm weights and a paged cache of
    one request a row with contexts[row] tokens before its new one (pages in order);
    returns the step's attention metadata (requests longest first) and rotary tables."""
    from spindle.attention.backends.triton_attn import TritonAttentionBackend
    from spindle.attention.metadata import decode_order
    from spindle.layers.rotary import RotaryEmbedding

    seq_lens = contexts + 1
    meta, num_pages = decode_step(seq_lens, PAGE)
    meta.decode_order = torch.from_numpy(decode_order(seq_lens.numpy())).cuda()
    for layer in layers:
        layer["attn"] = TritonAttentionBackend(HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS)
        layer["cache"] = torch.randn(2, num_pages, PAGE, KV_HEADS, HEAD_DIM, dtype=dtype,
                                     device="cuda")
        layer["q_norm"], layer["k_norm"] = (
            1 + 0.1 * torch.randn(HEAD_DIM, dtype=dtype, device="cuda") for _ in range(2))
    rope = RotaryEmbedding(HEAD_DIM, int(seq_lens.max()),
                           {"rope_type": "default", "rope_theta": 1e6})
    return dict(meta=meta, cos=rope.cos_cache.to("cuda"), sin=rope.sin_cache.to("cuda"),
                positions=contexts.long().cuda())


def attend(layer: dict, qkv: torch.Tensor, step: dict) -> torch.Tensor:
    """Qwen3's attention of one decode step: qkv [rows, 4096] -> [rows, 2048]."""
    from spindle.layers.rotary import QKNormRope

    rows = qkv.shape[0]
    q = qkv[:, :Q_WIDTH].view(rows, HEADS, HEAD_DIM)
    k = qkv[:, Q_WIDTH:Q_WIDTH + KV_HEADS * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    v = qkv[:, Q_WIDTH + KV_HEADS * HEAD_DIM:].view(rows, KV_HEADS, HEAD_DIM)
    rope = QKNormRope(step["positions"], step["cos"], step["sin"], layer["q_norm"],
                      layer["k_norm"], 1e-6)
    out = layer["attn"].forward(q, k, v, layer["cache"], step["meta"], qk_transform=rope)
    return out.view(rows, Q_WIDTH)


def forward(layers: list[dict], hidden: torch.Tensor, residual: torch.Tensor,
            step: dict | None = None) -> torch.Tensor:
    """LlamaDecoderLayer.forward's calls; attention replaced by a view of qkv unless
    step (add_attention's) is given."""
    for layer in layers:
        normed, residual = layer["input_norm"].pre_norm(hidden, residual, defer=True)
        qkv = layer["qkv"](normed)
        attended = qkv[:, :Q_WIDTH] if step is None else attend(layer, qkv, step)
        out = layer["o"](attended, defer_merge=True)
        normed, residual = layer["post_norm"](out, residual, defer=True)
        gate_up = layer["gate_up"](normed)
        hidden = layer["down"].silu_and_mul_forward(gate_up, defer_merge=True)
        if hidden is None:  # (rows past the skinny GEMM's: LlamaMLP's separate activation)
            hidden = layer["down"](layer["act"](gate_up), defer_merge=True)
    return layers[0]["input_norm"](hidden, residual)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--context", type=int, nargs="+", default=[0],
                        help="tokens of context per row for decode attention (0: none)")
    parser.add_argument("--drawn", action="store_true",
                        help="draw each row's context from 100 to 2N - 100 (mean about N)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    torch.manual_seed(0)
    layers = make_layers(args.layers, torch.bfloat16)
    switches = {k: v for k, v in os.environ.items() if k.startswith("SPINDLE_")}
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {copy_bw / 1e12:.2f} TB/s, "
          f"switches {switches or 'none'}{', contexts drawn' if args.drawn else ''}")
    weights = sum(p.numel() * p.element_size() for layer in layers
                  for module in layer.values() for p in module.parameters()) / args.layers
    print(f"{'rows':>4} | {'context':>7} | {'us a layer':>10} | {'weights GB/s':>12} | "
          f"{'attention us':>12} | {'KV TB/s':>7} | {'x copy':>6}")
    for rows in args.rows:
        without = None  # us a layer with no attention, once measured
        for context in sorted(args.context):  # (0 first: the others subtract it)
            contexts = context_lengths(rows, context, args.drawn) if context else None
            step = add_attention(layers, contexts, torch.bfloat16) if context else None
            hidden = torch.randn(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
            residual = torch.randn_like(hidden)
            us = graph_us(lambda i: forward(layers, hidden, residual, step), args.iters, calls=1)
            us /= args.layers
            line = f"{rows:>4} | {context:>7} | {us:>10.2f} | {weights / us / 1e3:>12.0f}"
            if context == 0:
                without = us
            elif without is not None:
                print(line + attention_columns(us - without, contexts, copy_bw))
                continue
            print(line + f" | {'':>12} | {'':>7} | {'':>6}")


def attention_columns(us: float, contexts: torch.Tensor, copy_bw: float) -> str:
    """What attention adds to a layer (us) and the bandwidth of its KV reads: every
    row's context keys and values, once."""
    rate = kv_bytes(contexts) / (us / 1e6)
    return f" | {us:>12.2f} | {rate / 1e12:>7.2f} | {rate / copy_bw:>6.3f}"


if __name__ == "__main__":
    main()
