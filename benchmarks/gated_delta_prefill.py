"""The gated delta rule's prefill (Qwen3-Next / Qwen3.5 linear attention), its
evaluations timed on a few step shapes: request by request (the CPU's default), every
chunk of the step batched (CUDA's), and on CUDA the Triton kernel in chunks of 16, 32
and 64 tokens with 4 or 8 warps a program (SPINDLE_GDN_TRITON_PREFILL=1). Outputs and
states are checked equal first. --per-key-decay: Kimi delta attention's decay, one per
key feature (a [T, Hv, Dk]; the Triton prefill has none, so torch's two evaluations
only; use as many key heads as value heads, as KimiLinear has).

    python benchmarks/gated_delta_prefill.py [--device cpu|cuda] [--reps 5]
        [--key-heads 4 --value-heads 8] [--per-key-decay] [--chunk-size 64]
        [--json out.json]

--chunk-size: the torch evaluations' chunk (64, Gated DeltaNet's; KimiLinear's layers
use kimi_delta.KDA_CHUNK).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from spindle.layers.mamba.gated_delta import gated_delta_prefill
from spindle.layers.mamba.gated_delta_triton import triton_prefill
from spindle.layers.mamba.metadata import MambaMetadata

# (name, prompt lengths of the step's requests)
STEPS = [("one 512-token prompt", [512]), ("16 prompts of 64", [64] * 16),
         ("4 mixed prompts", [300, 17, 5, 900]), ("64 one-token rows", [1] * 64),
         ("a 2048-token prompt", [2048])]
# Heads of 128 (default: 4 key heads and 8 value heads, a Qwen3.5 layer's share on one
# of four ranks).
DIM = 128
TRITON_CHUNKS = (16, 32, 64)


def inputs(lens: list[int], device: torch.device, key_heads: int, value_heads: int,
           per_key: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lens)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    tensors = dict(q=randn(tokens, key_heads, DIM), k=randn(tokens, key_heads, DIM),
                   v=randn(tokens, value_heads, DIM), a=randn(tokens, value_heads),
                   b=randn(tokens, value_heads), dt_bias=randn(value_heads),
                   A_log=torch.rand(value_heads, generator=g).to(device))
    if per_key:
        tensors.update(a=randn(tokens, value_heads, DIM), dt_bias=randn(value_heads, DIM))
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    md = MambaMetadata(num_reqs=len(lens), num_tokens=tokens, query_start_loc=qsl.to(device),
                       state_indices=torch.arange(len(lens), dtype=torch.int32, device=device),
                       has_initial_state=torch.ones(len(lens), dtype=torch.bool, device=device),
                       max_query_len=max(lens), query_start_loc_cpu=qsl)
    state = randn(len(lens), value_heads, DIM, DIM)
    return tensors, md, state


def time_it(fn, device: torch.device, reps: int) -> float:
    """Median seconds of reps calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--key-heads", type=int, default=4)
    parser.add_argument("--value-heads", type=int, default=8)
    parser.add_argument("--per-key-decay", action="store_true")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    chunk = args.chunk_size
    evaluations = {
        "by request": lambda **kw: gated_delta_prefill(**kw, chunk_size=chunk, batched=False),
        "batched": lambda **kw: gated_delta_prefill(**kw, chunk_size=chunk, batched=True)}
    if device.type == "cuda" and not args.per_key_decay:
        for chunk in TRITON_CHUNKS:
            for warps in (4, 8):
                evaluations[f"triton {chunk}/{warps}w"] = \
                    lambda chunk=chunk, warps=warps, **kw: triton_prefill(
                        **kw, chunk=chunk, num_warps=warps)
    rows = []
    for name, lens in STEPS:
        tensors, md, state = inputs(lens, device, args.key_heads, args.value_heads,
                                    args.per_key_decay)
        results = {}
        for label, run in evaluations.items():
            s = state.clone()
            results[label] = (run(**tensors, state=s, md=md), s)
        o0, s0 = results["by request"]
        for label, (o1, s1) in results.items():
            if not (torch.allclose(o0, o1, atol=1e-4, rtol=1e-4)
                    and torch.allclose(s0, s1, atol=1e-4, rtol=1e-4)):
                raise RuntimeError(f"{name}: {label} disagrees with the request-by-request "
                                   "evaluation")
        row = dict(step=name, tokens=sum(lens))
        for label, run in evaluations.items():
            row[f"{label} ms"] = time_it(lambda run=run: run(**tensors, state=state.clone(),
                                                             md=md), device, args.reps) * 1e3
        rows.append(row)
    result = {"date": time.strftime("%Y-%m-%d"), "device": str(device),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "key_heads": args.key_heads, "value_heads": args.value_heads,
              "decay": "per key feature" if args.per_key_decay else "per head",
              "chunk_size": chunk, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    labels = [f"{label} ms" for label in evaluations]
    print(f"{'step':<24} {'tokens':>7} " + " ".join(f"{label:>15}" for label in labels))
    for row in rows:
        print(f"{row['step']:<24} {row['tokens']:>7} "
              + " ".join(f"{row[label]:>15.2f}" for label in labels))


if __name__ == "__main__":
    main()
