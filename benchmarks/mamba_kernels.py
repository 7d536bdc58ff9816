"""The Mamba2 Triton kernels against the plain-torch ops, on CUDA, at Bamba-1B-like shapes.

One Mamba2 layer with H heads of P=64, state size N=128, one group, conv width 4,
chunk 256 (H=64: a 2048-wide model with expand 2, as Bamba / Granite-4 1B-class):

* prefill: 8 requests of 1024 new tokens, each continuing from a state: the causal
  conv1d over the conv channels, then the chunked SSD scan on its output (x, B and C
  as views into it, as the mixer passes them);
* decode: one token for each of B requests (B = 1 .. 256), timed as CUDA-graph replays
  of gpu_timing.CALLS calls, as a captured decode step runs them.

Columns: the kernel's time per call (median), the plain-torch ops' time
(spindle/layers/mamba/ops.py, where that module exists) and the speed-up, the bytes
a decode call must move (states read and written, inputs and outputs) over its time,
and the largest difference between the two outputs relative to the largest output
value. The device copy rate is printed as the bandwidth ceiling.

    python benchmarks/mamba_kernels.py
    python benchmarks/mamba_kernels.py --heads 64 --state-dtype bfloat16
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from typing import Callable

import torch
from gpu_timing import copy_bandwidth, eager_us, graph_us

HEAD_DIM, STATE_SIZE, GROUPS, WIDTH, CHUNK = 64, 128, 1, 4, 256
PREFILL_REQS, PREFILL_LEN = 8, 1024
DECODE_BATCHES = (1, 8, 32, 128, 256)
DEVICE = "cuda"


def time_graph_us(fn: Callable[[], object], iters: int) -> float | None:
    """gpu_timing.graph_us of fn; None when fn cannot be captured (a host sync inside)."""
    try:
        return graph_us(lambda _: fn(), iters)
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        return None


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def metadata(lens: list[int], slots: list[int], has_init: bool):
    from spindle.layers.mamba.metadata import MambaMetadata

    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    idx = torch.tensor(slots, dtype=torch.int32)
    init = torch.full((len(lens),), has_init, dtype=torch.bool)
    return MambaMetadata(num_reqs=len(lens), num_tokens=sum(lens),
                         query_start_loc=qsl.to(DEVICE), state_indices=idx.to(DEVICE),
                         has_initial_state=init.to(DEVICE), max_query_len=max(lens),
                         query_start_loc_cpu=qsl, has_initial_state_cpu=init,
                         state_indices_cpu=idx)


class Layer:
    """One layer's parameters and state tensors (num_slots slots)."""

    def __init__(self, heads: int, num_slots: int, state_dtype: torch.dtype) -> None:
        self.heads = heads
        self.inner = heads * HEAD_DIM
        self.channels = self.inner + 2 * GROUPS * STATE_SIZE
        dev = DEVICE
        self.weight = (torch.randn(self.channels, WIDTH, device=dev) / 2).bfloat16()
        self.bias = torch.randn(self.channels, device=dev).bfloat16()
        self.A_log = torch.rand(heads, device=dev) * 2  # A = -exp(A_log), as the ops take it
        self.D = torch.ones(heads, device=dev)
        self.dt_bias = torch.rand(heads, device=dev) - 2
        self.conv_state = torch.randn(num_slots, self.channels, WIDTH - 1,
                                      device=dev).to(state_dtype)
        self.ssm_state = torch.randn(num_slots, heads, HEAD_DIM, STATE_SIZE,
                                     device=dev).to(state_dtype)

    def split(self, xbc: torch.Tensor):
        """x [T, H, P], B and C [T, G, N] as views into the conv output."""
        tokens, gn = xbc.shape[0], GROUPS * STATE_SIZE
        return (xbc[:, :self.inner].view(tokens, self.heads, HEAD_DIM),
                xbc[:, self.inner:self.inner + gn].view(tokens, GROUPS, STATE_SIZE),
                xbc[:, self.inner + gn:].view(tokens, GROUPS, STATE_SIZE))


def prefill_rows(ops, layer: Layer, iters: int) -> list[tuple]:
    tokens = PREFILL_REQS * PREFILL_LEN
    md = metadata([PREFILL_LEN] * PREFILL_REQS, list(range(PREFILL_REQS)), True)
    # conv input and dt as column slices of an in_proj-like output.
    proj = torch.randn(tokens, layer.inner + layer.channels + layer.heads,
                       device=DEVICE).bfloat16()
    xbc_in = proj[:, layer.inner:layer.inner + layer.channels]
    dt = proj[:, layer.inner + layer.channels:]
    limit = (0.0, float("inf"))

    def conv(impl):
        return lambda: impl.causal_conv1d_prefill(xbc_in, layer.weight, layer.bias,
                                                  layer.conv_state, md, "silu")

    def ssd(impl, xbc):
        x, B, C = layer.split(xbc)
        return lambda: impl.ssd_prefill(x, dt, layer.A_log, B, C, layer.D, layer.dt_bias, limit,
                                        CHUNK, layer.ssm_state, md)

    xbc = conv(ops["triton"])()
    rows = []
    for name, make in (("conv1d prefill", lambda impl: conv(impl)),
                       ("ssd prefill", lambda impl: ssd(impl, xbc))):
        rows.append(compare(name, f"{PREFILL_REQS}x{PREFILL_LEN}", ops, make, layer,
                            iters, graph=False, moved=None))
    return rows


def decode_rows(ops, layer: Layer, batch: int, iters: int) -> list[tuple]:
    idx = torch.arange(batch, dtype=torch.int32, device=DEVICE)
    proj = torch.randn(batch, layer.inner + layer.channels + layer.heads,
                       device=DEVICE).bfloat16()
    xbc_in = proj[:, layer.inner:layer.inner + layer.channels]
    dt = proj[:, layer.inner + layer.channels:]
    limit = (0.0, float("inf"))
    xbc = ops["triton"].causal_conv1d_decode(xbc_in, layer.weight, layer.bias,
                                             layer.conv_state, idx)
    x, B, C = layer.split(xbc)
    state_bytes = layer.ssm_state.element_size()
    conv_moved = batch * layer.channels * (2 * (WIDTH - 1) * layer.conv_state.element_size()
                                           + 2 * 2)
    ssd_moved = batch * layer.heads * HEAD_DIM * (2 * STATE_SIZE * state_bytes + 2 * 2) \
        + batch * 2 * GROUPS * STATE_SIZE * 2

    def conv(impl):
        return lambda: impl.causal_conv1d_decode(xbc_in, layer.weight, layer.bias,
                                                 layer.conv_state, idx, "silu")

    def ssd(impl):
        return lambda: impl.ssd_decode(x, dt, layer.A_log, B, C, layer.D, layer.dt_bias, limit,
                                       layer.ssm_state, idx)

    return [compare("conv1d decode", f"B={batch}", ops, conv, layer, iters, True, conv_moved),
            compare("ssd decode", f"B={batch}", ops, ssd, layer, iters, True, ssd_moved)]


def compare(name: str, shape: str, ops, make, layer: Layer, iters: int, graph: bool,
            moved: int | None) -> tuple:
    """(name, shape, triton us, torch us, speed-up, GB/s, rel diff) for one kernel."""
    timer = time_graph_us if graph else eager_us
    torch_us = diff = None
    if "torch" in ops:  # one call of each from the same states, compared
        states = (layer.conv_state.clone(), layer.ssm_state.clone())
        triton_out = make(ops["triton"])()
        after_triton = (layer.conv_state.clone(), layer.ssm_state.clone())
        layer.conv_state.copy_(states[0])
        layer.ssm_state.copy_(states[1])
        torch_out = make(ops["torch"])()
        diff = max(rel_diff(triton_out, torch_out), rel_diff(after_triton[0], layer.conv_state),
                   rel_diff(after_triton[1], layer.ssm_state))
    triton_us = timer(make(ops["triton"]), iters)
    if "torch" in ops:
        # The plain-torch ops sync with the host (they are the CPU path): timed eagerly,
        # launch gaps included. (A failed capture leaves torch's RNG unusable.)
        torch_us = eager_us(make(ops["torch"]), iters)
    speedup = torch_us / triton_us if torch_us else None
    gbs = moved / triton_us / 1e3 if moved else None
    return name, shape, triton_us, torch_us, speedup, gbs, diff


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    state_dtype = getattr(torch, args.state_dtype)

    ops = {"triton": importlib.import_module("spindle.layers.mamba.triton_ops")}
    if importlib.util.find_spec("spindle.layers.mamba.ops") is not None:
        ops["torch"] = importlib.import_module("spindle.layers.mamba.ops")
    print(f"{torch.cuda.get_device_name()}: device copy {copy_bandwidth() / 1e9:.0f} GB/s; "
          f"P={HEAD_DIM} N={STATE_SIZE} G={GROUPS} K={WIDTH} chunk={CHUNK}, bf16 inputs, "
          f"{args.state_dtype} states; plain-torch ops: "
          f"{'spindle.layers.mamba.ops' if 'torch' in ops else 'absent'}")
    header = (f"{'H':>3} {'kernel':>15} {'shape':>8} | {'triton us':>10} | {'torch us':>10} "
              f"{'speed-up':>8} | {'GB/s':>6} | {'rel diff':>8}")
    print(header)
    print("-" * len(header))
    for heads in args.heads:
        layer = Layer(heads, max(max(DECODE_BATCHES), PREFILL_REQS), state_dtype)
        rows = prefill_rows(ops, layer, args.iters)
        for batch in DECODE_BATCHES:
            rows += decode_rows(ops, layer, batch, args.iters)
        for name, shape, triton_us, torch_us, speedup, gbs, diff in rows:
            print(f"{heads:>3} {name:>15} {shape:>8} | {triton_us:>10.1f} | "
                  f"{fmt(torch_us, '10.1f'):>10} {fmt(speedup, '7.1f'):>7}x | "
                  f"{fmt(gbs, '6.0f'):>6} | {fmt(diff, '8.1e'):>8}")


if __name__ == "__main__":
    main()
