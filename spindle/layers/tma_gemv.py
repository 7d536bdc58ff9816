"""A one-row GEMV for decode steps of one request on Hopper and later: y = x W^T (+ b).

The skinny GEMM (skinny_gemm.py) loads its first weight tile before the PDL wait and
the rest after it. At one row a layer's GEMMs are then a chain of short kernels, each
of which starts streaming its weight only once the kernel before has finished: with
every weight in L2 the four GEMMs of a Qwen3-0.6B layer still took 18 us (H200, against
some 7.5 us of bytes; docs/benchmarks.md).

Here every program copies its whole share of W (BLOCK_N rows, all of K) into shared
memory by TMA before it waits for the kernel before (pdl.release, then the copies, then
pdl.wait). The programs are small (16-106 KB of shared memory), so under PDL the next
GEMM's programs become resident beside the running ones and their weights stream in
while the chain's earlier kernels still work: the weight stream hardly stops at a
launch boundary. After the wait a program reads x once (all of K at once, into shared
memory, with the SwiGLU activation applied where the down projection's input is [gate |
up]), multiplies chunk by chunk as each chunk's copy lands, and stores its BLOCK_N
outputs; K is never split, so there are no partials to merge. (Measured on an H100: a
Qwen3-0.6B layer's four GEMMs and two norms 22.6 -> 17.4 us, docs/benchmarks.md.)

It is written in Gluon (Triton's lower-level language: explicit shared memory, TMA and
mbarriers), which has no interpreter, so it runs on CUDA devices of compute capability
9.0 and later only. skinny_gemm.skinny_linear hands it the one-row calls it applies to;
SPINDLE_TMA_GEMV=0 keeps them on the skinny GEMM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from spindle.layers import pdl
from spindle.layers.fused_kernels import PendingNorm, silu_mul
from spindle.switches import on_off

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                                  mbarrier, tma)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
    # One CTA's barrier: thread_barrier in Triton 3.6, barrier from 3.7.
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
except ImportError:  # (a Triton before Gluon: the skinny GEMM serves every call)
    HAVE_GLUON = False

SWITCH_ENV = "SPINDLE_TMA_GEMV"
# A program's shared memory at most: its weight share, x and the barriers. Two GEMMs'
# programs side by side must fit an SM's 227 KB, or the next one cannot start early.
MAX_SHARED_BYTES = 112 << 10
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemvConfig:
    """block_n: rows of W (outputs) a program owns; block_k: the K chunk of one TMA
    copy and one barrier; num_warps."""
    block_n: int
    block_k: int
    num_warps: int

    def shared_bytes(self, k: int, itemsize: int) -> int:
        chunks = triton.cdiv(k, self.block_k)
        x_rows = triton.next_power_of_2(chunks)
        return (chunks * self.block_n + x_rows) * self.block_k * itemsize + 8 * chunks


@functools.lru_cache(maxsize=None)  # (asked at every one-row call)
def pick_config(k: int, itemsize: int, silu_and_mul: bool = False) -> GemvConfig | None:
    """The tiles for a weight of K columns, or None where even the narrowest program's
    share of W does not fit MAX_SHARED_BYTES. K chunks of 256 (fewer where K is small);
    16 rows a program where that fits, else 8. 8 warps where the program applies SiLU to
    x, which is the longest part of its work after the wait (the down projection),
    else 4. (The best of a sweep of 8-32 rows, chunks of 128 and 256, 4 and 8 warps for
    Qwen3-0.6B's four projections on an H100, docs/benchmarks.md.)"""
    block_k = min(256, max(16, triton.next_power_of_2(k)))
    warps = 8 if silu_and_mul else 4
    for block_n in (16, 8):
        config = GemvConfig(block_n, block_k, warps)
        if config.shared_bytes(k, itemsize) <= MAX_SHARED_BYTES:
            return config
    return None


def tma_gemv_applies(x, weight: torch.Tensor, silu_and_mul: bool = False,
                     weight_scale: torch.Tensor | None = None) -> bool:
    """One row of a half-precision x on a CUDA device with TMA (compute capability 9.0
    on), a contiguous weight of x's dtype (not float8) whose rows are 16-byte aligned,
    a share of W that fits a program's shared memory, Gluon in this Triton, and
    SPINDLE_TMA_GEMV not "0". x may be a PendingNorm (without silu_and_mul) whose
    weight and residual are x's dtype and contiguous."""
    if isinstance(x, PendingNorm):
        if silu_and_mul or not _norm_applies(x):
            return False
        x = x.x
    k = weight.shape[-1]
    return (HAVE_GLUON and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and weight_scale is None and x.dtype in _DTYPES and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.is_contiguous()
            and x.shape[1] == (2 * k if silu_and_mul else k)
            and (k * weight.element_size()) % 16 == 0 and weight.data_ptr() % 16 == 0
            and pdl.capability(x.device) >= (9, 0) and on_off(SWITCH_ENV, True)
            and pick_config(k, weight.element_size(), silu_and_mul) is not None)


def _norm_applies(norm: PendingNorm) -> bool:
    x, k = norm.x, norm.x.shape[-1]
    return (norm.weight.shape == (k,) and norm.weight.dtype == x.dtype
            and norm.weight.is_contiguous()
            and (norm.residual is None
                 or (norm.residual.dtype == x.dtype and norm.residual.is_contiguous()
                     and norm.residual.shape == x.shape and norm.residual_out is not None
                     and norm.residual_out.is_contiguous()
                     and norm.residual_out.shape == x.shape
                     and norm.residual_out.dtype == x.dtype)))


def tma_gemv(x, weight: torch.Tensor, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None, silu_and_mul: bool = False,
             config: GemvConfig | None = None) -> torch.Tensor:
    """x [1, K] (or [1, 2K] = [gate | up] with silu_and_mul) @ weight[N, K]^T (+ bias)
    -> [1, N] in x's dtype, accumulated in float32. Where tma_gemv_applies(x, weight,
    silu_and_mul) only. silu_and_mul: the product is of silu(gate) * up, rounded as
    fused_kernels.silu_mul rounds. out: an optional contiguous [1, N] destination.
    x may be a PendingNorm: the product is then of its normalized rows, rounded as
    fused_kernels.rms_norm rounds them (its reduction order may differ: a last bit now
    and then), and its residual sum is stored into its residual_out."""
    norm = x if isinstance(x, PendingNorm) else None
    if norm is not None:
        x = norm.x
    n, k = weight.shape
    itemsize = weight.element_size()
    config = config or pick_config(k, itemsize, silu_and_mul)
    if config is None:
        raise ValueError(f"tma_gemv: a weight of {k} columns does not fit a program's "
                         f"shared memory ({MAX_SHARED_BYTES} bytes)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    chunks = triton.cdiv(k, config.block_k)
    desc = TensorDescriptor(weight, [n, k], [k, 1], [config.block_n, config.block_k],
                            _shared_layout(config.block_n, config.block_k, weight.dtype))
    residual = norm.residual if norm is not None else None
    _tma_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        desc, x, bias if bias is not None else out, out,
        norm.weight if norm is not None else x, residual if residual is not None else x,
        norm.residual_out if residual is not None else out,
        norm.eps if norm is not None else 0.0, n, k,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, CHUNKS=chunks,
        X_ROWS=triton.next_power_of_2(chunks), HAS_BIAS=bias is not None,
        SILU_MUL=silu_and_mul, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        num_warps=config.num_warps, **pdl.kernel_args(x.device, 1))
    return out


@functools.lru_cache(maxsize=None)
def _shared_layout(block_n: int, block_k: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(
        [block_n, block_k], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


if HAVE_GLUON:
    @gluon.jit
    def _gdc_launch_dependents():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r",
                                  [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit(do_not_specialize=["N", "eps"])
    def _tma_gemv_kernel(w_desc, x_ptr, b_ptr, y_ptr, nw_ptr, r_ptr, new_r_ptr, eps, N,
                         K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         CHUNKS: gl.constexpr, X_ROWS: gl.constexpr, HAS_BIAS: gl.constexpr,
                         SILU_MUL: gl.constexpr, NORM: gl.constexpr,
                         HAS_RESIDUAL: gl.constexpr, PDL: gl.constexpr):
        # The order is the point: let the next kernel launch, ask for every chunk of this
        # program's W (no kernel of the chain writes weights), and only then wait for
        # the kernel before, whose output is x.
        if PDL:
            _gdc_launch_dependents()
        n0 = gl.program_id(0) * BLOCK_N
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [CHUNKS, BLOCK_N, BLOCK_K],
                                           w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [CHUNKS, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(CHUNKS):
            mbarrier.init(bars.index(c), count=1)
        fence_async_shared()
        for c in gl.static_range(CHUNKS):
            mbarrier.expect(bars.index(c), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [n0, c * BLOCK_K], bars.index(c),
                                            w_smem.index(c))
        # Each thread holds 8 contiguous columns of a chunk (16-byte shared loads); x is
        # read as [X_ROWS, BLOCK_K], a chunk a row.
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8],
                                                [gl.num_warps(), 1], [1, 0])
        cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
        offs = gl.arange(0, X_ROWS, layout=gl.SliceLayout(1, layout))[:, None] * BLOCK_K \
            + cols[None, :]
        in_k = offs < K
        if NORM:  # (a weight: no kernel of the chain writes it)
            norm_w = gl.load(nw_ptr + offs, mask=in_k, other=0.0)
        if PDL:
            _gdc_wait()
        # x at once (one wait on memory, not one per chunk), into shared memory.
        xv = gl.load(x_ptr + offs, mask=in_k, other=0.0)
        if SILU_MUL:
            xv = silu_mul(xv, gl.load(x_ptr + K + offs, mask=in_k, other=0.0))
        if NORM:
            xv = _rms_norm(xv, norm_w, r_ptr, new_r_ptr, offs, in_k, eps, K, HAS_RESIDUAL)
        x_smem = gl.allocate_shared_memory(xv.dtype, [X_ROWS, BLOCK_K],
                                           gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        x_smem.store(xv)
        _cta_barrier()
        acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
        for c in gl.static_range(CHUNKS):
            xk = x_smem.slice(c, 1, dim=0).load(layout)  # [1, BLOCK_K]
            mbarrier.wait(bars.index(c), 0)
            acc += w_smem.index(c).load(layout).to(gl.float32) * xk.to(gl.float32)
        y = gl.sum(acc, axis=1)
        rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        if HAS_BIAS:
            y += gl.load(b_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
        gl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)
        for c in gl.static_range(CHUNKS):
            mbarrier.invalidate(bars.index(c))

    @gluon.jit
    def _rms_norm(x, weight, r_ptr, new_r_ptr, offs, in_k, eps, K: gl.constexpr,
                  HAS_RESIDUAL: gl.constexpr):
        """fused_kernels.rms_norm of the row x (zeros past K), rounded where it rounds;
        with a residual, the sum (x + residual, rounded) is stored by the first program."""
        if HAS_RESIDUAL:
            x = (x.to(gl.float32) + gl.load(r_ptr + offs, mask=in_k, other=0.0)
                 .to(gl.float32)).to(x.dtype)
            gl.store(new_r_ptr + offs, x, mask=in_k & (gl.program_id(0) == 0))
        h = x.to(gl.float32)
        variance = gl.sum(gl.sum(h * h, axis=1), axis=0) / K
        normed = (h * gl.rsqrt(variance + eps)).to(x.dtype)
        return (weight.to(gl.float32) * normed.to(gl.float32)).to(x.dtype)
