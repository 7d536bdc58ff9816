"""The mixture-of-experts feed-forward on CUDA: tokens grouped by expert, two grouped
GEMM launches, no host synchronisation (so it can be captured in CUDA graphs).

1. align_by_expert: every (token, choice) pair of the routing [T, k] is placed in its
   expert's segment of a padded row list, each segment a whole number of BLOCK_M-row
   blocks, and each block labelled with its expert. All torch ops of static shapes
   (the row list has room for T * k + E * (BLOCK_M - 1) rows, the worst case).
2. gate/up: each block's rows of x times its expert's [gate | up] weight, SiLU(gate) *
   up fused into the epilogue -> [rows, I] (experts without a gate: the up weight,
   relu(x)^2 in the epilogue; gpt-oss's: biases, and the clamped SwiGLU).
3. down: those rows times the expert's down weight (plus its bias), each row scaled by
   its routing weight -> one row per (token, choice).
4. A token's k rows are summed (in the order of its choices).

Padding rows point at no pair (-1) and are neither read nor written; blocks past the
last segment exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


def align_by_expert(top_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """top_ids [T, k] -> (rows, block_experts): rows [R] the flat (token * k + choice)
    index each padded row holds (-1: padding), block_experts [R // block_m] the
    expert of each block (num_experts: past the last segment)."""
    flat = top_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    capacity = pairs + num_experts * (block_m - 1)
    capacity = -(-capacity // block_m) * block_m
    # (scatter_add, not bincount: bincount reads its input's maximum back to the host.)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pairs by expert, then token order
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - start[sorted_experts]
    rows = torch.full((capacity,), -1, dtype=torch.int64, device=flat.device)
    rows[padded_start[sorted_experts] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    return rows, block_experts


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  top_ids: torch.Tensor, top_weights: torch.Tensor,
                  gated: bool = True, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, activation=None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] ([gate | up]), w2 [E, H, I], top_ids / top_weights
    [T, k] -> sum over each token's choices of weight * down(silu(gate) * up), [T, H]
    in x's dtype (the products accumulated in float32). gated=False: w13 [E, I, H] is
    the up projection alone, and the experts compute down(relu(up)^2). w13_bias [E, 2I]
    and w2_bias [E, H]: added to each projection; activation: moe.ClampedSwiGLU's
    alpha and limit in place of SiLU."""
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_experts, first_rows, _ = w13.shape
    inter = first_rows // 2 if gated else first_rows
    k = top_ids.shape[1]
    rows, block_experts = align_by_expert(top_ids, num_experts)
    capacity = rows.numel()
    act = torch.empty((capacity, inter), dtype=x.dtype, device=x.device)
    # (Every (token, choice) row is written whole by the down launch: no zeroing.)
    out_rows = torch.empty((num_tokens * k, hidden), dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    block_n, block_k = (32, 32) if ieee else (64, 64)
    weights = top_weights.reshape(-1)
    clamped = activation is not None
    alpha, limit = (activation.alpha, activation.limit) if clamped else (1.0, 0.0)
    # gate/up: rows -> act (act rows follow the padded row list).
    _grouped_gemm_kernel[(capacity // BLOCK_M, triton.cdiv(inter, block_n))](
        x, w13, act, rows, block_experts, weights, w13 if w13_bias is None else w13_bias,
        inter, hidden, num_experts, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        0 if w13_bias is None else w13_bias.stride(0), alpha, limit,
        K_TOKENS=k, GATED=gated, RELU2=not gated, CLAMPED=clamped, SCALE=False,
        GATHER_A=True, BIAS=w13_bias is not None, IEEE=ieee,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    # down: act rows -> one output row per (token, choice), scaled by its weight.
    _grouped_gemm_kernel[(capacity // BLOCK_M, triton.cdiv(hidden, block_n))](
        act, w2, out_rows, rows, block_experts, weights, w2 if w2_bias is None else w2_bias,
        hidden, inter, num_experts, act.stride(0), w2.stride(0), w2.stride(1),
        out_rows.stride(0), 0 if w2_bias is None else w2_bias.stride(0), 1.0, 0.0,
        K_TOKENS=k, GATED=False, RELU2=False, CLAMPED=False, SCALE=True, GATHER_A=False,
        BIAS=w2_bias is not None, IEEE=ieee,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return out_rows.view(num_tokens, k, hidden).sum(dim=1)


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, rows_ptr, block_experts_ptr, weights_ptr,
                         bias_ptr, N, K, num_experts, stride_a, stride_we, stride_wn,
                         stride_out, stride_be, alpha, limit,
                         K_TOKENS: tl.constexpr, GATED: tl.constexpr, RELU2: tl.constexpr,
                         CLAMPED: tl.constexpr, SCALE: tl.constexpr, GATHER_A: tl.constexpr,
                         BIAS: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """One BLOCK_M block of padded rows (one expert's) x BLOCK_N output columns.

    GATHER_A: row r's input is a_ptr's row rows[r] // K_TOKENS (the token), and the
    output goes to padded row r; else the input is padded row r and the output goes
    to row rows[r] (the pair). GATED: the weight's rows are [gate | up], N columns
    each; the output is silu(gate) * up. RELU2: the output is relu(x)^2. CLAMPED (with
    GATED): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
    limit). BIAS: bias_ptr's row of the expert ([gate | up] when GATED) added to the
    product first. SCALE: the output row is multiplied by weights_ptr[pair] (in
    float32)."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs_m)
    m_valid = pair >= 0
    if GATHER_A:
        a_rows = a_ptr + (pair // K_TOKENS) * stride_a
    else:
        a_rows = a_ptr + offs_m.to(tl.int64) * stride_a
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_valid = kk < K
        a = tl.load(a_rows[:, None] + kk[None, :], mask=m_valid[:, None] & k_valid[None, :],
                    other=0.0)
        w_mask = k_valid[:, None] & n_valid[None, :]
        w = tl.load(w_expert + offs_n[None, :] * stride_wn + kk[:, None], mask=w_mask,
                    other=0.0)
        acc = _dot(a, w, acc, IEEE)
        if GATED:
            w_up = tl.load(w_expert + (N + offs_n)[None, :] * stride_wn + kk[:, None],
                           mask=w_mask, other=0.0)
            acc_up = _dot(a, w_up, acc_up, IEEE)
    dtype = out_ptr.dtype.element_ty
    if BIAS:  # (rounded with the product, as a linear with a bias rounds once)
        b_expert = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(b_expert + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_expert + N + offs_n, mask=n_valid,
                              other=0.0).to(tl.float32)[None, :]
    if GATED and CLAMPED:
        gate = tl.minimum(acc.to(dtype).to(tl.float32), limit)
        up = tl.minimum(tl.maximum(acc_up.to(dtype).to(tl.float32), -limit), limit)
        glu = (gate / (1.0 + tl.exp(-alpha * gate))).to(dtype).to(tl.float32)
        acc = (up + 1.0) * glu
    elif GATED:  # rounded where the torch path rounds: each projection, silu, the product
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    if RELU2:  # (relu is exact in the output dtype; the square rounds once)
        relu = tl.maximum(acc.to(dtype).to(tl.float32), 0.0)
        acc = relu * relu
    if SCALE:
        acc = acc.to(dtype).to(tl.float32) \
            * tl.load(weights_ptr + pair, mask=m_valid, other=0.0).to(tl.float32)[:, None]
    if GATHER_A:
        out_rows = out_ptr + offs_m.to(tl.int64) * stride_out
    else:
        out_rows = out_ptr + pair * stride_out
    tl.store(out_rows[:, None] + offs_n[None, :], acc.to(dtype),
             mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)
