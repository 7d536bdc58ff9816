"""The gated delta rule's prefill (Qwen3-Next / Qwen3.5 linear attention), its two
evaluations timed on a few step shapes: request by request (the CPU's default) and
every chunk of the step batched (CUDA's). Outputs and states are checked equal first.

    python benchmarks/gated_delta_prefill.py [--device cpu|cuda] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from spindle.layers.mamba.gated_delta import gated_delta_prefill
from spindle.layers.mamba.metadata import MambaMetadata

# (name, prompt lengths of the step's requests)
STEPS = [("one 512-token prompt", [512]), ("16 prompts of 64", [64] * 16),
         ("4 mixed prompts", [300, 17, 5, 900]), ("64 one-token rows", [1] * 64),
         ("a 2048-token prompt", [2048])]
# Qwen3.5-like heads per rank: 4 key heads of 128, 8 value heads of 128.
KEY_HEADS, VALUE_HEADS, DIM = 4, 8, 128


def inputs(lens: list[int], device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lens)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    tensors = dict(q=randn(tokens, KEY_HEADS, DIM), k=randn(tokens, KEY_HEADS, DIM),
                   v=randn(tokens, VALUE_HEADS, DIM), a=randn(tokens, VALUE_HEADS),
                   b=randn(tokens, VALUE_HEADS), dt_bias=randn(VALUE_HEADS),
                   A_log=torch.rand(VALUE_HEADS, generator=g).to(device))
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    md = MambaMetadata(num_reqs=len(lens), num_tokens=tokens, query_start_loc=qsl.to(device),
                       state_indices=torch.arange(len(lens), dtype=torch.int32, device=device),
                       has_initial_state=torch.ones(len(lens), dtype=torch.bool, device=device),
                       max_query_len=max(lens), query_start_loc_cpu=qsl)
    state = randn(len(lens), VALUE_HEADS, DIM, DIM)
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
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for name, lens in STEPS:
        tensors, md, state = inputs(lens, device)
        results = {}
        for batched in (False, True):
            s = state.clone()
            out = gated_delta_prefill(**tensors, state=s, md=md, batched=batched)
            results[batched] = (out, s)
        (o0, s0), (o1, s1) = results[False], results[True]
        if not (torch.allclose(o0, o1, atol=1e-4, rtol=1e-4)
                and torch.allclose(s0, s1, atol=1e-4, rtol=1e-4)):
            raise RuntimeError(f"{name}: the two evaluations disagree")
        by_request, batched = (time_it(lambda b=b: gated_delta_prefill(
            **tensors, state=state.clone(), md=md, batched=b), device, args.reps)
            for b in (False, True))
        rows.append(dict(step=name, tokens=sum(lens), by_request_ms=by_request * 1e3,
                         batched_ms=batched * 1e3))
    result = {"date": time.strftime("%Y-%m-%d"), "device": str(device),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(f"{'step':<24} {'tokens':>7} {'by request ms':>14} {'batched ms':>11}")
    for row in rows:
        print(f"{row['step']:<24} {row['tokens']:>7} {row['by_request_ms']:>14.1f} "
              f"{row['batched_ms']:>11.1f}")


if __name__ == "__main__":
    main()
