"""The Mamba (version 1) selective scan's Triton kernels on CUDA, by channel block:
decode (one token for each of B requests, timed as CUDA-graph replays, as a captured
decode step runs it) and prefill (8 requests of 1,024 tokens continuing their states),
at a mamba-1.4b-like layer (4,096 channels, state 16, float32 states) or Jamba's
(`--channels 8192`). Decode prints the bytes a call must move (states read and written,
inputs and output) over its time, against the device's copy rate.

    python benchmarks/selective_scan_kernels.py [--channels 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from gpu_timing import copy_bandwidth, eager_us, graph_us

from spindle.layers.mamba import selective_scan_triton as scan
from spindle.layers.mamba.metadata import MambaMetadata

STATE_SIZE = 16
BLOCKS = (16, 32, 64, 128)
DECODE_BATCHES = (1, 8, 32, 128, 256)
PREFILL_REQS, PREFILL_LEN = 8, 1024


def layer_inputs(tokens: int, channels: int, gen: torch.Generator) -> dict:
    """x, dt, z [T, D] and B, C [T, N] (bf16), the layer's float32 parameters."""
    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).cuda()

    return dict(x=randn(tokens, channels).bfloat16(), dt=randn(tokens, channels).bfloat16(),
                A_log=(torch.rand(channels, STATE_SIZE, generator=gen) * 2).cuda(),
                B=randn(tokens, STATE_SIZE).bfloat16(), C=randn(tokens, STATE_SIZE).bfloat16(),
                D=randn(channels), dt_bias=randn(channels, scale=0.5) - 2,
                z=randn(tokens, channels).bfloat16())


def decode_rows(channels: int, iters: int, bandwidth: float) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in DECODE_BATCHES:
        inputs = layer_inputs(batch, channels, gen)
        state = torch.randn(batch, channels, STATE_SIZE, generator=gen).cuda()
        slots = torch.arange(batch, dtype=torch.int32, device="cuda")
        moved = batch * channels * (2 * STATE_SIZE * 4 + 4 * 2) + batch * 2 * STATE_SIZE * 2
        row = dict(batch=batch)
        for block in BLOCKS:
            us = graph_us(lambda _, b=block: scan.selective_scan_decode(
                **inputs, ssm_state=state, state_indices=slots, block_d=b), iters)
            row[f"block {block} us"] = us
            row[f"block {block} x copy"] = moved / (us / 1e6) / bandwidth
        rows.append(row)
    return rows


def prefill_rows(channels: int, iters: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    tokens = PREFILL_REQS * PREFILL_LEN
    inputs = layer_inputs(tokens, channels, gen)
    state = torch.randn(PREFILL_REQS, channels, STATE_SIZE, generator=gen).cuda()
    qsl = torch.arange(PREFILL_REQS + 1, dtype=torch.int32) * PREFILL_LEN
    md = MambaMetadata(num_reqs=PREFILL_REQS, num_tokens=tokens, query_start_loc=qsl.cuda(),
                       state_indices=torch.arange(PREFILL_REQS, dtype=torch.int32).cuda(),
                       has_initial_state=torch.ones(PREFILL_REQS, dtype=torch.bool).cuda(),
                       max_query_len=PREFILL_LEN, query_start_loc_cpu=qsl)
    row = dict(tokens=tokens)
    for block in BLOCKS:
        row[f"block {block} ms"] = eager_us(lambda b=block: scan.selective_scan_prefill(
            **inputs, ssm_state=state, md=md, block_d=b), iters) / 1e3
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    decode = decode_rows(args.channels, args.iters, bandwidth)
    prefill = prefill_rows(args.channels, max(3, args.iters // 4))
    result = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, channels=args.channels, state_size=STATE_SIZE,
                  copy_TBps=bandwidth / 1e12, decode=decode, prefill=prefill)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.channels} channels, state "
          f"{STATE_SIZE}, float32 states")
    print("decode: us per call (x copy bandwidth)")
    print(f"{'batch':>6} " + " ".join(f"{'block ' + str(b):>18}" for b in BLOCKS))
    for row in decode:
        print(f"{row['batch']:>6} " + " ".join(
            f"{row[f'block {b} us']:>9.1f} ({row[f'block {b} x copy']:.2f})" for b in BLOCKS))
    print(f"prefill, {PREFILL_REQS} x {PREFILL_LEN} tokens: ms per call")
    print("       " + " ".join(f"{prefill[f'block {b} ms']:>18.2f}" for b in BLOCKS))


if __name__ == "__main__":
    main()
