"""The batch-invariant GEMM of CUDA (see batch_invariant.py): no split-K and one K step
for every configuration, so each output element is the same float32 sum in the same
order whatever the batch (gemm_config says why the M and N tiles may still vary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The K step of every bf16/fp16 configuration: it fixes the order of the sum.
GEMM_BLOCK_K = 64


def gemm_config(m: int, n: int, k: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes for x [m, k] @ w [n, k]^T. Every configuration here has the same K
    step (BLOCK_K) and walks K in the same order; the M and N tiles only decide which
    program computes an element, not how: each output element is the same float32
    sum of tensor-core dot products whatever the tile (measured on an H200 across six
    tile shapes, all equal bits: benchmarks/invariant_gemm.py; tests/test_invariant_gemm.py
    checks it for these). So the tile may follow the batch: narrow for decode-sized m,
    wide for prefill."""
    if dtype == torch.float32:  # IEEE dot products: smaller tiles fit shared memory
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=GEMM_BLOCK_K, num_warps=4, num_stages=4)
    if m <= 512:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=GEMM_BLOCK_K, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=GEMM_BLOCK_K, num_warps=8, num_stages=3)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None,
                     config: dict[str, int] | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in x's dtype, accumulated in
    float32 over K in one fixed order (config: tests try others)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"invariant_matmul: x has {k} features, weight is "
                         f"{tuple(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = dict(config or gemm_config(m, n, k, x.dtype))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _invariant_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, **cfg)
    return out


@triton.jit(do_not_specialize=["M"])  # (one variant for every number of rows)
def _invariant_matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K,
                             stride_xm, stride_wn, stride_wk, stride_om,
                             HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile over the whole of K, in BLOCK_K steps from 0
    (out-of-range products are zeros, which add nothing)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_valid = kk < K
        a = tl.load(x_rows + kk[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None] * stride_wk, mask=k_valid[:, None] & n_valid[None, :],
                    other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])
