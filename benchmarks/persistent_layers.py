"""Batch-1 decoder layers as one persistent kernel, against the engine's kernel chain.

An experiment toward the batch-1 target (1,500 tok/s on the Qwen3-0.6B shape, a decode
step of about 0.67 ms). Each of the engine's kernels at batch 1 starts with an empty
memory pipeline and ends with a tail; measured, a layer's four GEMMs take about 17 us
against 7.5 us of weight bytes (docs/benchmarks.md). Here one kernel runs every layer's
dense part: a grid of co-resident programs passes through the stages of a layer
(RMSNorm + qkv, o_proj, residual + RMSNorm + gate_up, SiLU-and-mul + down), with a
grid-wide barrier (an arrival counter) between stages. The residual stream stays in
every program's registers (each program adds the same partials in the same order, so
all hold the same bits). Variants (`Mode`): the weights loaded after each barrier or
asked of the L2 a stage ahead (`prefetch.global.L2`, no registers held); the barrier
polled with atomics or acquiring loads; the barriers alone (no loads) and the stream
alone (no barriers, wrong results), which split the time into its two parts.

Attention is left out on both sides (o_proj reads the first columns of the qkv output
in its place): this measures what the dense part of a layer costs when its stages do
not each start from a launch. The baseline is the engine's own chain (fused RMSNorm
with residual, the skinny GEMM with deferred split merges, SiLU-and-mul inside the down
projection), all under PDL, captured in a CUDA graph, on the same weights. Measured on
an H100 (docs/benchmarks.md): 20.4-21.5 us a layer at best against the chain's 22.8-22.9;
the barriers alone about 4 us a layer, the stream alone 13-18 us: not the road to
1,500 tok/s as written.

    python benchmarks/persistent_layers.py [--layers 28] [--json out.json]

The grid barrier needs every program resident at once: the grid is at most the SM
count times the programs per SM that fit, which the script checks from the compiled
kernel before it launches. Under Triton's interpreter (no GPU) the programs run one
after another, so there the grid is one program; `--check` runs that on small shapes
against a torch reference.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

EPS = 1e-6


@dataclass(frozen=True)
class StageTiles:
    """How one stage's weight [N, K] is cut: tiles of block_n rows by block_k columns
    (K in `splits` pieces); program p takes tiles p, p + P, ... (at most `per_program`)."""
    block_n: int
    block_k: int
    splits: int
    per_program: int

    @staticmethod
    def plan(n: int, k: int, programs: int, block_n: int, block_k: int) -> "StageTiles":
        if n % block_n or k % block_k:
            raise ValueError(f"[{n}, {k}] does not cut into {block_n} x {block_k} tiles")
        tiles = n // block_n * (k // block_k)
        per = triton.next_power_of_2(-(-tiles // programs))
        return StageTiles(block_n, block_k, k // block_k, per)


@triton.jit
def _arrive(bar_ptr, SYNC: tl.constexpr):
    """This program's stores of the stage are done; count it in (release)."""
    if SYNC:
        tl.debug_barrier()
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _poll(bar_ptr, POLL: tl.constexpr):
    """The barrier's count: an atomic read (POLL 0) or an acquiring load (POLL 1, which
    does not queue behind the arrivals' atomics at the L2)."""
    if POLL == 0:
        return tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    else:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
                                         [bar_ptr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait(bar_ptr, target, SYNC: tl.constexpr, POLL: tl.constexpr):
    """Spin until `target` arrivals are counted (acquire); then every thread goes on.
    A wait that spins too long (programs not all resident: a deadlock) opens every
    barrier of the launch instead of hanging the GPU; its output is then wrong, which
    the script reports."""
    if SYNC:
        seen = _poll(bar_ptr, POLL)
        spins = 0
        while seen < target:
            seen = _poll(bar_ptr, POLL)
            spins += 1
            if spins > 1_000_000:
                tl.atomic_max(bar_ptr, 1 << 30)
        tl.debug_barrier()


@triton.jit
def _prefetch_l2(w_ptr, pid, P, N, K, BN: tl.constexpr, BK: tl.constexpr,
                 SPLITS: tl.constexpr, T: tl.constexpr):
    """Ask the L2 for this program's weight tiles of a stage, a 128-byte line per
    address, without waiting or holding registers (tiles past the end ask for tile 0's
    lines again)."""
    rows, cols, valid, _ = _tile_ids(pid, P, N, BN, BK, SPLITS, T)
    lines = tl.arange(0, BK // 64)[None, None, :] * 64
    cols0 = tl.reshape(tl.min(cols, axis=2), (T, 1, 1))
    rows = tl.where(valid[:, None, None], rows, 0)
    ptrs = w_ptr + rows.to(tl.int64) * K + tl.where(valid[:, None, None], cols0, 0) + lines
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tile_ids(pid, P, N, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr,
              T: tl.constexpr):
    """Rows [T, BN, 1], columns [T, 1, BK], the validity [T] and the split [T] of this
    program's tiles."""
    tile = pid + P * tl.arange(0, T)
    valid = tile < (N // BN) * SPLITS
    row0 = (tile // SPLITS) * BN
    split = tile % SPLITS
    rows = row0[:, None, None] + tl.arange(0, BN)[None, :, None]
    cols = (split * BK)[:, None, None] + tl.arange(0, BK)[None, None, :]
    return rows, cols, valid, split


@triton.jit
def _tile(pid, P, t, N, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr):
    """This program's tile t: its rows [BN], columns [BK], split and validity (a tile
    past the end names tile 0, for an unmasked load whose result is not stored)."""
    tile = pid + P * t
    valid = tile < (N // BN) * SPLITS
    tile = tl.where(valid, tile, 0)
    split = tile % SPLITS
    return (tile // SPLITS) * BN + tl.arange(0, BN), split * BK + tl.arange(0, BK), split, valid


@triton.jit
def _gemv_stage(w_ptr, x, x_ptr, out_ptr, pid, P, N, K, BN: tl.constexpr, BK: tl.constexpr,
                SPLITS: tl.constexpr, T: tl.constexpr, X: tl.constexpr, FF: tl.constexpr):
    """This program's tiles of out[SPLITS, N] = W[N, K] x, one tile after another (the
    loads of later tiles may be issued early; registers hold about one tile). X 0: x is
    the vector given (BK == K); 1: x_ptr[cols] (bf16); 2: silu(x_ptr[cols]) *
    x_ptr[FF + cols] (gate and up)."""
    for t in tl.static_range(T):
        rows, cols, split, valid = _tile(pid, P, t, N, BN, BK, SPLITS)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :])
        if X == 0:
            xv = x.to(tl.float32)
        elif X == 1:
            xv = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
        else:
            gate = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
            up = tl.load(x_ptr + FF + cols, cache_modifier=".cg").to(tl.float32)
            xv = ((gate * tl.sigmoid(gate)).to(tl.bfloat16).to(tl.float32) * up).to(
                tl.bfloat16).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
        tl.store(out_ptr + split * N + rows, y.to(out_ptr.dtype.element_ty),
                 mask=valid & (rows >= 0))


@triton.jit
def _add_parts(h, part_ptr, offs, HID: tl.constexpr, PARTS: tl.constexpr):
    """h + the split partials [PARTS, HID] summed in split order (read from L2: other
    programs wrote them)."""
    total = tl.zeros([HID], tl.float32)
    for s in tl.static_range(PARTS):
        total += tl.load(part_ptr + s * HID + offs, cache_modifier=".cg")
    return h + total


@triton.jit
def _normed(h, w_ptr, offs, HID: tl.constexpr, eps):
    var = tl.sum(h * h, 0) / HID
    return (h * tl.math.rsqrt(var + eps) * tl.load(w_ptr + offs).to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _persistent_layers_kernel(
        h_ptr, out_ptr, bar_ptr, ln1_ptr, ln2_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr,
        qkv_ptr, o_part_ptr, gu_ptr, d_part_ptr, num_layers, eps,
        HID: tl.constexpr, QKV: tl.constexpr, AO: tl.constexpr, FF: tl.constexpr,
        A_BN: tl.constexpr, A_T: tl.constexpr,
        B_BN: tl.constexpr, B_BK: tl.constexpr, B_S: tl.constexpr, B_T: tl.constexpr,
        C_BN: tl.constexpr, C_T: tl.constexpr,
        D_BN: tl.constexpr, D_BK: tl.constexpr, D_S: tl.constexpr, D_T: tl.constexpr,
        PREFETCH: tl.constexpr, POLL: tl.constexpr, SYNC: tl.constexpr, WORK: tl.constexpr):
    """PREFETCH 0: a stage loads its weights after its barrier; 2: the L2 is asked for
    the next stage's weights before this stage's barrier (the stream runs a stage
    ahead, holding no registers). POLL: see _poll. SYNC 0 drops the barriers (wrong
    results: the stream's own time); WORK 0 drops the loads and arithmetic (the
    barriers' own time)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    offs = tl.arange(0, HID)
    h = tl.load(h_ptr + offs).to(tl.float32)
    stage = 0
    if PREFETCH == 2:
        _prefetch_l2(wqkv_ptr, pid, P, QKV, HID, A_BN, HID, 1, A_T)
    for layer in range(num_layers):
        wqkv = wqkv_ptr + layer * QKV * HID
        wo = wo_ptr + layer * HID * AO
        wgu = wgu_ptr + layer * 2 * FF * HID
        wd = wd_ptr + layer * HID * FF
        # A: RMSNorm(h) @ Wqkv^T -> qkv (bf16), after the last layer's down partials.
        if PREFETCH == 2:
            _prefetch_l2(wo, pid, P, HID, AO, B_BN, B_BK, B_S, B_T)
        _wait(bar_ptr, P * stage, SYNC, POLL)
        if WORK:
            if layer > 0:
                h = _add_parts(h, d_part_ptr, offs, HID, D_S)
            x = _normed(h, ln1_ptr + layer * HID, offs, HID, eps)
            _gemv_stage(wqkv, x, qkv_ptr, qkv_ptr, pid, P, QKV, HID, A_BN, HID, 1, A_T, 0, FF)
        _arrive(bar_ptr, SYNC)
        stage += 1
        # B: (attention's place) qkv[:AO] @ Wo^T -> float32 partials [B_S, HID].
        if PREFETCH == 2:
            _prefetch_l2(wgu, pid, P, 2 * FF, HID, C_BN, HID, 1, C_T)
        _wait(bar_ptr, P * stage, SYNC, POLL)
        if WORK:
            _gemv_stage(wo, h, qkv_ptr, o_part_ptr, pid, P, HID, AO, B_BN, B_BK, B_S, B_T,
                        1, FF)
        _arrive(bar_ptr, SYNC)
        stage += 1
        # C: h += o; RMSNorm(h) @ Wgu^T -> [gate | up] (bf16).
        if PREFETCH == 2:
            _prefetch_l2(wd, pid, P, HID, FF, D_BN, D_BK, D_S, D_T)
        _wait(bar_ptr, P * stage, SYNC, POLL)
        if WORK:
            h = _add_parts(h, o_part_ptr, offs, HID, B_S)
            x = _normed(h, ln2_ptr + layer * HID, offs, HID, eps)
            _gemv_stage(wgu, x, gu_ptr, gu_ptr, pid, P, 2 * FF, HID, C_BN, HID, 1, C_T, 0, FF)
        _arrive(bar_ptr, SYNC)
        stage += 1
        # D: silu(gate) * up @ Wd^T -> float32 partials [D_S, HID].
        if PREFETCH == 2:
            if layer + 1 < num_layers:
                _prefetch_l2(wqkv + QKV * HID, pid, P, QKV, HID, A_BN, HID, 1, A_T)
        _wait(bar_ptr, P * stage, SYNC, POLL)
        if WORK:
            _gemv_stage(wd, h, gu_ptr, d_part_ptr, pid, P, HID, FF, D_BN, D_BK, D_S, D_T,
                        2, FF)
        _arrive(bar_ptr, SYNC)
        stage += 1
    _wait(bar_ptr, P * stage, SYNC, POLL)
    if WORK:
        h = _add_parts(h, d_part_ptr, offs, HID, D_S)
    if pid == 0:
        tl.store(out_ptr + offs, h)


@dataclass
class Layers:
    """Stacked weights of `num` layers (bf16 on `device`)."""
    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv: torch.Tensor  # [L, QKV, HID]
    wo: torch.Tensor  # [L, HID, AO]
    wgu: torch.Tensor  # [L, 2 FF, HID]
    wd: torch.Tensor  # [L, HID, FF]

    @staticmethod
    def random(num: int, hid: int, qkv: int, ao: int, ff: int, device, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)

        def w(*shape):
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(
                device=device, dtype=torch.bfloat16)

        return Layers(1 + 0.1 * w(num, hid), 1 + 0.1 * w(num, hid), w(num, qkv, hid),
                      w(num, hid, ao), w(num, 2 * ff, hid), w(num, hid, ff))

    @property
    def shape(self):
        num, qkv, hid = self.wqkv.shape
        return num, hid, qkv, self.wo.shape[2], self.wd.shape[2]


def reference(layers: Layers, h: torch.Tensor) -> torch.Tensor:
    """The same computation in torch (float32 math, bf16 where the kernel rounds)."""
    num, hid, qkv_n, ao, ff = layers.shape
    h = h.float()

    def normed(v, w):
        return (v * torch.rsqrt(v.pow(2).mean() + EPS) * w.float()).bfloat16().float()

    for i in range(num):
        qkv = (layers.wqkv[i].float() @ normed(h, layers.ln1[i])).bfloat16().float()
        h = h + layers.wo[i].float() @ qkv[:ao]
        gu = (layers.wgu[i].float() @ normed(h, layers.ln2[i])).bfloat16().float()
        gate, up = gu[:ff], gu[ff:]
        x = ((gate * torch.sigmoid(gate)).bfloat16().float() * up).bfloat16().float()
        h = h + layers.wd[i].float() @ x
    return h


@dataclass(frozen=True)
class Plan:
    programs: int
    a: StageTiles
    b: StageTiles
    c: StageTiles
    d: StageTiles
    num_warps: int

    @staticmethod
    def make(layers: Layers, programs: int, num_warps: int, block_n: int = 16,
             block_k: int = 1024) -> "Plan":
        _, hid, qkv, ao, ff = layers.shape
        bk_o, bk_d = min(block_k, ao), min(block_k, ff)
        return Plan(programs, StageTiles.plan(qkv, hid, programs, block_n, hid),
                    StageTiles.plan(hid, ao, programs, max(1, block_n // 2), bk_o),
                    StageTiles.plan(2 * ff, hid, programs, block_n, hid),
                    StageTiles.plan(hid, ff, programs, max(1, block_n // 2), bk_d), num_warps)


@dataclass(frozen=True)
class Mode:
    """The kernel's variant (see _persistent_layers_kernel)."""
    prefetch: int = 0
    poll: int = 0
    sync: bool = True
    work: bool = True

    def __str__(self) -> str:
        what = {0: "after the barrier", 2: "L2 a stage ahead"}[self.prefetch]
        poll = "atomic" if self.poll == 0 else "ld.acquire"
        if not self.sync:
            return f"no barriers (stream alone), weights {what}"
        if not self.work:
            return f"barriers alone, {poll} polls"
        return f"weights {what}, {poll} polls"


class Persistent:
    """The persistent kernel's buffers and launch for one Layers, Plan and Mode."""

    def __init__(self, layers: Layers, plan: Plan, mode: Mode = Mode()):
        self.layers, self.plan, self.mode = layers, plan, mode
        _, hid, qkv, _, ff = layers.shape
        dev = layers.wqkv.device
        self.bar = torch.zeros(1, dtype=torch.int32, device=dev)
        self.qkv = torch.empty(qkv, dtype=torch.bfloat16, device=dev)
        self.o_part = torch.empty(plan.b.splits, hid, dtype=torch.float32, device=dev)
        self.gu = torch.empty(2 * ff, dtype=torch.bfloat16, device=dev)
        self.d_part = torch.empty(plan.d.splits, hid, dtype=torch.float32, device=dev)
        self.out = torch.empty(hid, dtype=torch.float32, device=dev)

    def _args(self, h: torch.Tensor) -> tuple[tuple, dict]:
        lay, p, m = self.layers, self.plan, self.mode
        num, hid, qkv, ao, ff = lay.shape
        return ((h, self.out, self.bar, lay.ln1, lay.ln2, lay.wqkv, lay.wo, lay.wgu, lay.wd,
                 self.qkv, self.o_part, self.gu, self.d_part, num, EPS),
                dict(HID=hid, QKV=qkv, AO=ao, FF=ff,
                     A_BN=p.a.block_n, A_T=p.a.per_program,
                     B_BN=p.b.block_n, B_BK=p.b.block_k, B_S=p.b.splits, B_T=p.b.per_program,
                     C_BN=p.c.block_n, C_T=p.c.per_program,
                     D_BN=p.d.block_n, D_BK=p.d.block_k, D_S=p.d.splits, D_T=p.d.per_program,
                     PREFETCH=m.prefetch, POLL=m.poll, SYNC=m.sync, WORK=m.work,
                     num_warps=p.num_warps, num_stages=1))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.bar.zero_()
        args, kwargs = self._args(h)
        _persistent_layers_kernel[(self.plan.programs,)](*args, **kwargs)
        return self.out

    def compile(self, h: torch.Tensor):
        """The compiled kernel of this launch, compiled without launching."""
        args, kwargs = self._args(h)
        return _persistent_layers_kernel.warmup(*args, grid=(self.plan.programs,), **kwargs)


def fits_resident(kernel, programs: int, num_warps: int, device) -> tuple[bool, str]:
    """Whether `programs` programs of the compiled kernel can all be resident at once
    (the driver's occupancy figure where cuda-python is there, else an estimate)."""
    kernel._init_handles()
    props = torch.cuda.get_device_properties(device)
    smem = kernel.metadata.shared
    try:
        from cuda.bindings import driver as cu
        err, per_sm = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            cu.CUfunction(kernel.function), 32 * num_warps, smem)
        if int(err) != 0:
            raise RuntimeError(err)
    except Exception:  # (no cuda-python: registers rounded to 8 a thread)
        regs = -(-kernel.n_regs // 8) * 8 * 32 * num_warps
        per_sm = min(props.regs_per_multiprocessor // max(regs, 1),
                     (props.shared_memory_per_multiprocessor // smem) if smem else 64,
                     props.max_threads_per_multi_processor // (32 * num_warps))
    need = -(-programs // props.multi_processor_count)
    return per_sm >= need, (f"{kernel.n_regs} regs/thread, {smem} B shared, "
                            f"{kernel.n_spills} spills: {per_sm} a SM, {need} needed")


def engine_chain(layers: Layers):
    """The engine's kernels for the same work: fused RMSNorm (+ residual), skinny
    GEMMs (o_proj and down with deferred split merges), SiLU-and-mul in down."""
    from spindle.layers.fused_kernels import rms_norm
    from spindle.layers.skinny_gemm import new_split_counters, skinny_linear

    num, hid, qkv, ao, ff = layers.shape
    dev = layers.wqkv.device
    counters = {n: new_split_counters(n, dev) for n in (qkv, hid, 2 * ff)}

    def run(h: torch.Tensor) -> torch.Tensor:
        residual = h.view(1, hid).bfloat16()
        x = None
        for i in range(num):
            if x is None:
                normed = rms_norm(residual, layers.ln1[i], EPS)
            else:
                normed, residual = rms_norm(x, layers.ln1[i], EPS, residual)
            q = skinny_linear(normed, layers.wqkv[i], counters=counters[qkv])
            o = skinny_linear(q[:, :ao], layers.wo[i], counters=counters[hid],
                              defer_merge=True)
            normed, residual = rms_norm(o, layers.ln2[i], EPS, residual)
            gu = skinny_linear(normed, layers.wgu[i], counters=counters[2 * ff])
            x = skinny_linear(gu, layers.wd[i], counters=counters[hid], silu_and_mul=True,
                              defer_merge=True)
        from spindle.layers.skinny_gemm import merged
        return (merged(x).float() + residual.float()).view(hid)

    return run


def check_interpreted() -> None:
    """Small shapes, one program (the interpreter runs programs one after another)."""
    layers = Layers.random(3, 64, 192, 64, 128, "cpu")
    h = torch.randn(64, generator=torch.Generator().manual_seed(1))
    for block_n, block_k in ((16, 64), (8, 32)):
        plan = Plan.make(layers, programs=1, num_warps=4, block_n=block_n, block_k=block_k)
        for mode in (Mode(prefetch=0),):
            got = Persistent(layers, plan, mode)(h).clone()
            want = reference(layers, h)
            err = ((got - want).norm() / want.norm()).item()
            print(f"interpreted, tiles {block_n} x {block_k}, {mode}: "
                  f"relative error {err:.2e}")
            # (The interpreter rounds float32 to bf16 by truncation, torch to nearest:
            # a percent apart after a few layers. On the GPU both round to nearest.)
            if not err < 3e-2:
                raise SystemExit("the persistent kernel does not match the reference")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--check", action="store_true",
                        help="run the interpreter check on small shapes and stop")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.check:
        check_interpreted()
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --check under TRITON_INTERPRET=1)")
    from gpu_timing import graph_us

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    # Qwen3-0.6B: hidden 1024, q 16 x 128 + k, v 8 x 128, intermediate 3072.
    layers = Layers.random(args.layers, 1024, 4096, 2048, 3072, dev)
    h = torch.randn(1024, device=dev)
    want = reference(layers, h)
    results = []

    def record(name, fn, iters=args.iters):
        got = fn(h).float()
        err = ((got - want).norm() / want.norm()).item()
        us = graph_us(lambda i: fn(h), iters, calls=4)
        results.append(dict(name=name, us=us, us_per_layer=us / args.layers, rel_err=err))
        print(f"  {name}: {us:.1f} us ({us / args.layers:.2f} a layer), rel err {err:.1e}",
              flush=True)

    record("engine chain (PDL)", engine_chain(layers))
    modes = [Mode(prefetch=0), Mode(prefetch=0, poll=1),
             Mode(prefetch=2, poll=0), Mode(prefetch=2, poll=1), Mode(work=False),
             Mode(work=False, poll=1), Mode(sync=False), Mode(prefetch=2, sync=False)]
    for per_sm, warps, block_n in ((1, 16, 16), (2, 4, 16), (1, 8, 16)):
        plan = Plan.make(layers, sms * per_sm, warps, block_n)
        for mode in modes:
            run = Persistent(layers, plan, mode)
            name = (f"{per_sm}/SM x {warps} warps, {block_n}-row tiles "
                    f"(T {plan.a.per_program},{plan.b.per_program},{plan.c.per_program},"
                    f"{plan.d.per_program}), {mode}")
            try:
                ok, why = fits_resident(run.compile(h), plan.programs, warps, dev)
                if not ok:
                    print(f"  {name}: skipped ({why})")
                    continue
                print(f"  {name}: {why}")
                record(name, run)
            except Exception as exc:  # (a variant that does not compile: report, go on)
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:300]}")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; {args.layers} layers of Qwen3-0.6B's dense part, batch 1")
    print(f"{'variant':<100} {'us/layer':>8} {'rel err':>8}")
    for r in results:
        print(f"{r['name']:<100} {r['us_per_layer']:>8.2f} {r['rel_err']:>8.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), torch=torch.__version__,
            triton=triton.__version__, python=platform.python_version(),
            layers=args.layers, results=results), indent=1))


if __name__ == "__main__":
    main()
