"""A Triton kernel for cross-attention decode: one query per request over the encoder's
keys and values in its state slot, read in place (no gather into a batch tensor first).

At a Whisper-large batch of 64 the cross keys and values are 15 GB a decode step, the
largest read of the step: gathering them into [B, positions, ...] for SDPA would read
them twice and write them once. Here each program (request, query head) streams its
slot's keys and values in tiles of BLOCK_N positions with an online softmax, in
float32. A negative slot (a CUDA-graph padding row) writes zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def cross_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           slots: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D]; key/value_cache [num_slots, L, H_kv, D]; slots [B] -> [B, H, D]."""
    batch, num_heads, head_dim = q.shape
    _, length, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError("the key and value caches must share one layout, contiguous in D")
    q = q.contiguous()
    out = torch.empty_like(q)
    if batch == 0:
        return out
    _cross_decode_kernel[(batch, num_heads)](
        q, key_cache, value_cache, slots, out, scale, length,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=64)
    return out


@triton.jit
def _cross_decode_kernel(q_ptr, key_ptr, value_ptr, slot_ptr, out_ptr, scale, length,
                         stride_slot, stride_pos, stride_head,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    row = (req * num_heads + head) * HEAD_DIM
    slot = tl.load(slot_ptr + req).to(tl.int64)
    if slot < 0:
        tl.store(out_ptr + row + dims, tl.zeros([BLOCK_D], tl.float32).to(
            out_ptr.dtype.element_ty), mask=dim_ok)
        return
    q = tl.load(q_ptr + row + dims, mask=dim_ok, other=0.0).to(tl.float32) * scale
    base = slot * stride_slot + (head // GROUP) * stride_head
    best = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, length, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < length
        offs = base + pos[:, None] * stride_pos + dims[None, :]
        mask = pos_ok[:, None] & dim_ok[None, :]
        keys = tl.load(key_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        scores = tl.sum(keys * q[None, :], axis=1)
        scores = tl.where(pos_ok, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        weights = tl.exp(scores - new_best)
        correction = tl.exp(best - new_best)
        values = tl.load(value_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
        total = total * correction + tl.sum(weights, axis=0)
        best = new_best
    tl.store(out_ptr + row + dims, (acc / total).to(out_ptr.dtype.element_ty), mask=dim_ok)
