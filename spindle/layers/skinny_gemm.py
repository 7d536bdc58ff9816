"""A Triton GEMM for decode-sized batches: y = x W^T (+ b) with x [M, K], M <= 256.

At decode batch sizes a linear layer is a pass over its weight: cuBLAS reaches about a
quarter of an H200's memory bandwidth at M = 1..16, and from 17 rows on its kernels,
which take no part in programmatic dependent launch (layers/pdl.py), stop the PDL chain
of a decode step. Here each program streams a [BLOCK_N, BLOCK_K] tile of W along K (K
is contiguous: coalesced, pipelined loads), multiplies it by a block of up to 128 rows
of x (padded to 16 at least for the matrix units; x is small and stays in cache) and
accumulates in float32; more than 128 rows take several row blocks, whose programs of
one N tile run side by side so the second reads W from L2. When N alone gives too few
programs to fill the chip (o_proj, down_proj), K is split as well; the program of an
output tile that finishes last sums the splits' partials in a fixed order, so results
do not depend on arrival order and there is no second launch. The grid depends only
on (M, N, K): CUDA graphs can capture it. This module knows nothing of layers or
parallelism.

The engine uses it up to max_rows() rows (SPINDLE_SKINNY_MAX_M); above, F.linear.
One row on a GPU with TMA goes to tma_gemv.py instead (the whole weight share of a
program in shared memory before the PDL wait), where that applies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from spindle.layers import pdl
from spindle.switches import on_off
from spindle.layers.fused_kernels import silu_mul
from spindle.layers.linear import new_split_counters  # noqa: F401 (part of this API)
from spindle.layers.tma_gemv import tma_gemv, tma_gemv_applies

# The most rows the kernel takes; the engine's own limit is max_rows().
MAX_M = 256
_MIN_BLOCK_M = 16  # the smallest dot operand Triton takes; rows >= M are masked
_MAX_BLOCK_M = 128  # rows of x a program multiplies at once; more take several blocks
max_rows = pdl.max_rows  # the engine's limit (SPINDLE_SKINNY_MAX_M), shared with PDL
# With silu_and_mul, x comes as two tiles (gate and up): a block of 128 rows of them
# overflows shared memory beside W (on an H100: 240 KB asked, 227 KB there).
SILU_MAX_M = 64
_DEEP_BLOCK_K = 256  # K tile of an unsplit program with few N tiles (pick_config)
SWITCH_ENV = "SPINDLE_SKINNY_GEMM"  # "0": cuBLAS for every shape (A/B runs)
_DTYPES = (torch.bfloat16, torch.float16)


def use_skinny_gemm(x: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor | None = None) -> bool:
    """Whether skinny_linear should replace F.linear(x, weight): CUDA tensors that
    skinny_gemm_applies to."""
    return x.is_cuda and skinny_gemm_applies(x, weight, weight_scale)


def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor,
                        weight_scale: torch.Tensor | None = None) -> bool:
    """A decode-sized 2-D half-precision input, a contiguous weight of its dtype (or
    float8 e4m3 with a float32 scale per row: weight_scale) with K a multiple of 16 on
    the same device, and SPINDLE_SKINNY_GEMM not "0" (the switch for A/B runs). (The
    device type is use_skinny_gemm's business.)"""
    weight_dtype = x.dtype if weight_scale is None else torch.float8_e4m3fn
    return (x.dim() == 2 and 1 <= x.shape[0] <= max_rows() and x.dtype in _DTYPES
            and weight.dtype == weight_dtype and weight.dim() == 2
            and weight.shape[1] == x.shape[1] and weight.shape[1] % 16 == 0
            and weight.is_contiguous() and weight.device == x.device
            and on_off(SWITCH_ENV, True))


def block_m(m: int) -> int:
    """The rows of x one program multiplies: M rounded up to a power of two, from 16
    (the narrowest dot operand) to 128 (more rows take several blocks). One compiled
    variant per block serves every M it covers (M is not specialized)."""
    return min(_MAX_BLOCK_M, max(_MIN_BLOCK_M, triton.next_power_of_2(m)))


def row_blocks(m: int, rows_block: int | None = None) -> dict[str, int]:
    """pick_config's row arguments for M rows: the block (block_m(), or rows_block
    where given) and how many."""
    if rows_block is None:
        rows_block = block_m(m)
    elif not (_MIN_BLOCK_M <= rows_block <= MAX_M and rows_block & (rows_block - 1) == 0):
        raise ValueError(f"a row block must be a power of two from {_MIN_BLOCK_M} to "
                         f"{MAX_M}, got {rows_block}")
    return {"rows_block": rows_block, "m_tiles": triton.cdiv(m, rows_block)}


@dataclass(frozen=True)
class SkinnyConfig:
    """A launch's tiles. block_m: the rows of x a program multiplies, a power of two
    from 16 to MAX_M (None: block_m(M), which the engine always takes; a measuring
    knob, benchmarks/skinny_gemm.py --block-m)."""
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    block_m: int | None = None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None,
                  counters: torch.Tensor | None = None,
                  weight_scale: torch.Tensor | None = None,
                  silu_and_mul: bool = False,
                  defer_merge: bool = False) -> torch.Tensor | SplitKPartials:
    """x [..., K] @ weight[N, K]^T (+ bias [N]) in float32, returned in x's dtype.

    out: an optional [M, N] contiguous destination. config: block sizes and split-K
    (default: pick_config's choice for the shape; benchmarks sweep it). counters: the
    caller's new_split_counters(N); without them the K dimension is not split.
    weight_scale: a float32 [N] scale per row of a float8 weight (W = weight * scale),
    which is widened to x's dtype tile by tile. silu_and_mul: x is [..., 2K] = [gate |
    up] and the product is of silu(gate) * up, computed as it is loaded, rounded where
    fused_kernels.silu_and_mul rounds (a SwiGLU MLP's down projection without the
    activation's own launch). defer_merge: when K is split, and there is no bias or
    weight_scale, return the split partials (SplitKPartials) unsummed, for the next
    kernel to add up as it loads them (out is then left unwritten); otherwise the
    output as usual."""
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if x.shape[1] != (2 * k if silu_and_mul else k) or not weight.is_contiguous():
        raise ValueError(f"skinny_linear needs a contiguous weight [N, K] with x [M, "
                         f"{'2K' if silu_and_mul else 'K'}], got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)} (contiguous={weight.is_contiguous()})")
    if m > (SILU_MAX_M if silu_and_mul else MAX_M):
        raise ValueError(f"skinny_linear serves at most {MAX_M} rows, and {SILU_MAX_M} with "
                         f"silu_and_mul, got {m}")
    if weight_scale is not None and (weight_scale.shape != (n,)
                                     or weight_scale.dtype != torch.float32):
        raise ValueError(f"weight_scale must be a float32 [{n}] tensor, got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {tuple(bias.shape)}")
    if out is not None and (out.shape != (m, n) or not out.is_contiguous()
                            or out.dtype != x.dtype):
        raise ValueError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor")
    if m == 0 or n == 0 or k == 0:
        out = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
        if k == 0:
            out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
        return out.reshape(*lead, n)
    if config is None and m == 1 and tma_gemv_applies(x, weight, silu_and_mul, weight_scale):
        return tma_gemv(x, weight, bias, out, silu_and_mul).reshape(*lead, n)
    rows = row_blocks(m, config.block_m if config is not None else None)
    rows_block, m_tiles = rows["rows_block"], rows["m_tiles"]
    cfg = config or _default_config(n, k, rows_block, m_tiles, x.device)
    n_tiles = triton.cdiv(n, cfg.block_n)
    if counters is None or n_tiles * m_tiles > counters.numel():
        cfg = replace(cfg, split_k=1)
    split, block_k = cfg.split_k, cfg.block_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    defer = defer_merge and split > 1 and bias is None and weight_scale is None
    if out is None and not defer:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partials = (torch.empty(split, m, n_tiles * cfg.block_n, dtype=torch.float32,
                            device=x.device) if split > 1 else out)
    if defer:
        out = partials  # (not written)
    # Row blocks are the grid's first axis: the blocks of one N tile run side by side,
    # so all but the first find W's tiles in L2.
    _skinny_gemm_kernel[(m_tiles, n_tiles, split)](
        x, weight, bias if bias is not None else weight,
        weight_scale if weight_scale is not None else weight, out, partials,
        counters if counters is not None else out,
        m, n, k, x.stride(0), k_per_split,
        HAS_BIAS=bias is not None, HAS_SCALE=weight_scale is not None, SPLIT_K=split,
        BLOCK_M=rows_block,
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, EVEN_K=k == split * k_per_split,
        # CPU tensors reach a Triton kernel only under Triton's interpreter, which
        # multiplies bf16 dot operands as raw integers: it gets float32 operands (bf16 x
        # bf16 products are exact in float32, as in the matrix units).
        IEEE=x.dtype == torch.float32 or not x.is_cuda, SILU_MUL=silu_and_mul,
        MERGE=not defer,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.kernel_args(x.device, m))
    if defer:
        return SplitKPartials(partials, n, x.dtype, tuple(lead))
    return out.reshape(*lead, n)


@dataclass(frozen=True)
class SplitKPartials:
    """A skinny GEMM's output left as its split-K partial products, float32 [S, M, W]
    (W >= N: whole N tiles), for the kernel that reads the output next to add up as it
    loads them (fused_kernels.rms_norm): the GEMM then ends without one program
    waiting for the others. Summed in split order from zero and rounded to dtype, they
    are the bits the GEMM's own merge stores (merged())."""
    partials: torch.Tensor
    n: int
    dtype: torch.dtype
    lead: tuple = ()

    def merged(self) -> torch.Tensor:
        """The output [..., N] the GEMM would have stored."""
        total = torch.zeros_like(self.partials[0, :, :self.n])
        for part in self.partials[:, :, :self.n]:
            total += part
        return total.to(self.dtype).reshape(*self.lead, self.n)


def base_config(rows_block: int) -> SkinnyConfig:
    """The tiles for a row block of rows_block (block_m()): 64 x 128 everywhere; fewer
    pipeline stages and more warps as the x tile grows, so a stage's W and x tiles stay
    within shared memory and the float32 accumulator within registers."""
    if rows_block <= 16:
        return SkinnyConfig()
    if rows_block <= 64:
        return SkinnyConfig(num_stages=3)
    return SkinnyConfig(num_warps=8, num_stages=3)


def pick_config(n: int, k: int, num_sms: int, base: SkinnyConfig | None = None,
                rows_block: int = 16, m_tiles: int = 1) -> SkinnyConfig:
    """base's tiles (default base_config(rows_block)); K split only when the programs
    (N tiles x m_tiles row blocks) cover less than a third of num_sms.

    From a third of the SMs up, a program runs all of K (in tiles of at least
    _DEEP_BLOCK_K, where K allows and the row block is at most 32 rows): on the H200 that
    beat splitting, whose programs wait for the last split's merge (batch-1 decode graph
    1.02 -> 0.94 ms with the deferred merges, docs/benchmarks.md). Below, the split
    divides K into whole BLOCK_K chunks (no masked tail), keeps at least two chunks per
    program so its loads pipeline, and is the smallest such divisor that reaches num_sms
    programs (else the largest there is). Qwen3-0.6B on 132 SMs, one row block: qkv
    4096x1024 -> 64 tiles, gate_up 6144x1024 -> 96 (both K tiles of 256 up to 32 rows),
    o_proj 1024x2048 -> 16 x 8 splits, down_proj 1024x3072 -> 16 x 12, LM head
    151936x1024 -> 2374."""
    base = base or base_config(rows_block)
    programs = triton.cdiv(n, base.block_n) * m_tiles
    if programs >= num_sms or k % base.block_k:
        return replace(base, split_k=1)
    if 3 * programs >= num_sms:
        deep = max(base.block_k, _DEEP_BLOCK_K) if rows_block <= 32 else base.block_k
        return replace(base, split_k=1, block_k=deep if k % deep == 0 else base.block_k)
    chunks = k // base.block_k
    splits = [d for d in range(1, chunks // 2 + 1) if chunks % d == 0] or [1]
    return replace(base, split_k=next((d for d in splits if programs * d >= num_sms),
                                      splits[-1]))


@functools.lru_cache(maxsize=None)
def _default_config(n: int, k: int, rows_block: int, m_tiles: int,
                    device: torch.device) -> SkinnyConfig:
    return pick_config(n, k, _num_sms(device), rows_block=rows_block, m_tiles=m_tiles)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: plan as for an H200
    return torch.cuda.get_device_properties(device).multi_processor_count




# M is not specialized (Triton would compile M == 1 apart): one variant per shape,
# config and row block serves every decode batch, so nothing compiles after warm-up.
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, part_ptr, counters_ptr,
                        M, N, K, x_stride, k_per_split,
                        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        IEEE: tl.constexpr, SILU_MUL: tl.constexpr, MERGE: tl.constexpr,
                        PDL: tl.constexpr):
    pdl.release(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = split * k_per_split + tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    # The tail tile rereads row N - 1 instead of masking, so W loads stay unmasked.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :] * x_stride + offs_k[:, None]  # x^T: [BLOCK_K, BLOCK_M]
    # The first weight tile is loaded before waiting for the kernel before (no kernel
    # writes weights): under PDL its wait on memory overlaps that kernel's tail.
    w = _weight_tile(w_ptrs, offs_k, K, EVEN_K)
    pdl.wait(PDL)
    # y^T = W x^T: W is the dot's wide operand, so M pads only the narrow one.
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = _add_tile_product(acc, w, x_ptrs, offs_k, K, m_valid, EVEN_K, SILU_MUL, HAS_SCALE,
                            IEEE)
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        w = _weight_tile(w_ptrs + k0, offs_k + k0, K, EVEN_K)
        acc = _add_tile_product(acc, w, x_ptrs + k0, offs_k + k0, K, m_valid, EVEN_K,
                                SILU_MUL, HAS_SCALE, IEEE)
    y_ptrs = y_ptr + offs_m[None, :] * N + offs_n[:, None]
    y_mask = m_valid[None, :] & (offs_n < N)[:, None]
    if SPLIT_K == 1:
        _store_output(acc, b_ptr, s_ptr, rows, y_ptrs, y_mask, HAS_BIAS, HAS_SCALE)
    else:
        # partials [SPLIT_K, M, n_tiles * BLOCK_N]: whole tiles, so no N mask.
        width = tl.num_programs(1) * BLOCK_N
        part = part_ptr + offs_m[None, :] * width + offs_n[:, None]
        tl.store(part + split * M * width, acc, mask=m_valid[None, :])
        if not MERGE:  # the next kernel adds the partials up (SplitKPartials)
            return
        # Every thread's partial is written before the arrival is counted (release);
        # the program that arrives last sees all partials (acquire) and sums them in
        # split order, whichever order the splits finished in. A counter per output
        # tile (row block, N tile).
        tl.debug_barrier()
        counter = counters_ptr + pid_n * tl.num_programs(0) + pid_m
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part + s * M * width, mask=m_valid[None, :], other=0.0,
                                 cache_modifier=".cg")
            _store_output(total, b_ptr, s_ptr, rows, y_ptrs, y_mask, HAS_BIAS, HAS_SCALE)
            tl.store(counter, 0)  # ready for the next launch


@triton.jit
def _weight_tile(w_ptrs, offs_k, K, EVEN_K: tl.constexpr):
    """The W tile [BLOCK_N, BLOCK_K] at columns offs_k (zeros past K)."""
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0.0)


@triton.jit
def _add_tile_product(acc, w, x_ptrs, offs_k, K, m_valid, EVEN_K: tl.constexpr,
                      SILU_MUL: tl.constexpr, HAS_SCALE: tl.constexpr, IEEE: tl.constexpr):
    """acc + w @ x^T for the x^T tile [BLOCK_K, BLOCK_M] at columns offs_k."""
    if EVEN_K:
        x_mask = m_valid[None, :]
    else:
        x_mask = (offs_k < K)[:, None] & m_valid[None, :]
    xt = tl.load(x_ptrs, mask=x_mask, other=0.0)
    if SILU_MUL:  # xt is the gate; the up half starts K columns on
        xt = silu_mul(xt, tl.load(x_ptrs + K, mask=x_mask, other=0.0))
    if HAS_SCALE:
        w = w.to(xt.dtype)  # float8 -> the activations' dtype: exact
    if IEEE:
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, xt, acc)


@triton.jit
def _store_output(acc, b_ptr, s_ptr, rows, y_ptrs, y_mask, HAS_BIAS: tl.constexpr,
                  HAS_SCALE: tl.constexpr):
    if HAS_SCALE:
        acc *= tl.load(s_ptr + rows)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=y_mask)


def merged(x):
    """x as a tensor: a SplitKPartials summed (SplitKPartials.merged), anything else as is."""
    return x.merged() if isinstance(x, SplitKPartials) else x
