"""Triton attention over the paged KV cache (the CUDA backend).

Three kernels:

* ``store_kv``: writes this step's keys and values into their cache slots
  (slot < 0 marks a padding token of a CUDA-graph batch: skipped).
* ``prefill``: any number of new tokens per request after any cached context
  (chunked prefill, prefix-cache hits, mixed prefill + decode steps). One program
  per (query tile, request, query head); online softmax over the context, causal
  relative to the context length.
* ``decode`` + ``reduce``: one new token per request (flash-decoding). One program
  per (request, KV head, split): the query heads sharing a KV head are packed into
  one tile (GQA), and the context is split so that small batches still fill the
  GPU. Each program derives its context range from the request's sequence length
  on the device, so the launch grid depends only on the batch size: the kernels
  can be captured in CUDA graphs and replayed for any sequence lengths.

Cache layout: [2, num_blocks, block_size, num_kv_heads, head_dim] (see
AttentionMetadata). Float32 models use IEEE dot products (not TF32), so that a
float32 run stays comparable with transformers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spindle.attention.heads import set_head_geometry
from spindle.attention.metadata import AttentionMetadata

_TARGET_PROGRAMS = 264  # about two waves on a 132-SM H100/H200
_MAX_SPLITS = 32


class TritonAttentionBackend:
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        set_head_geometry(self, num_heads, head_dim, scale, num_kv_heads)
        self.gqa = num_heads // num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None,
                attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        """q [T, H, D], k/v [T, H_kv, D] -> [T, H, D]."""
        if kv_cache is None:
            # The profiling forward runs before the cache exists: attend among the
            # step's new tokens with the plain-torch path (a conservative peak).
            from spindle.attention.backends.torch_sdpa import TorchSDPABackend

            return TorchSDPABackend(self.num_heads, self.head_dim, self.scale,
                                    self.num_kv_heads).forward(q, k, v, None, attn_metadata)
        if attn_metadata is None:
            raise ValueError("attention with a KV cache needs attention metadata")
        store_kv(k, v, kv_cache, attn_metadata.slot_mapping)
        out = torch.empty_like(q)
        if attn_metadata.max_query_len == 1:
            decode_attention(q, kv_cache, attn_metadata.block_tables, attn_metadata.seq_lens,
                             self.scale, out)
        else:
            prefill_attention(q, kv_cache, attn_metadata, self.scale, out)
        return out


# ---------------------------------------------------------------------- store KV
def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, H_kv, D] into the cache slots slot_mapping [T] (negative: skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    row = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HEAD_DIM=head_dim, ROW=row, BLOCK=triton.next_power_of_2(row))


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                     HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    key = tl.load(k_ptr + token * k_stride_t + head * k_stride_h + dim, mask=mask)
    value = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + dim, mask=mask)
    # A cache row (one slot, all KV heads) is contiguous: slot * ROW + head * D + d.
    tl.store(key_cache_ptr + slot * ROW + offs, key, mask=mask)
    tl.store(value_cache_ptr + slot * ROW + offs, value, mask=mask)


# ---------------------------------------------------------------------- prefill
def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    block_m = 64 if meta.max_query_len > 32 else 16
    block_n = 64
    grid = (triton.cdiv(meta.max_query_len, block_m), meta.num_reqs, num_heads)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _prefill_kernel[grid](
        q, key_cache, value_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2),
        GQA=num_heads // num_kv_heads, PAGE=block_size, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)


@triton.jit
def _prefill_kernel(q_ptr, key_cache_ptr, value_cache_ptr, out_ptr, block_tables_ptr,
                    query_start_ptr, seq_lens_ptr, scale,
                    q_stride_t, q_stride_h, o_stride_t, o_stride_h, bt_stride,
                    c_stride_b, c_stride_t, c_stride_h,
                    GQA: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IEEE: tl.constexpr):
    tile = tl.program_id(0)
    req = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GQA
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < q_len
    d_valid = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None].to(tl.int64) * q_stride_t
                + head * q_stride_h + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The last query of this tile sees context positions up to context_len + its index.
    kv_end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    row_limit = context_len + offs_m
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        k, v = _load_kv_tile(key_cache_ptr, value_cache_ptr, block_tables_ptr + req * bt_stride,
                             offs_n, n_valid, offs_d, d_valid, kv_head,
                             c_stride_b, c_stride_t, c_stride_h, PAGE)
        scores = _dot(q, tl.trans(k), IEEE) * scale
        visible = (offs_n[None, :] <= row_limit[:, None]) & n_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None].to(tl.int64) * o_stride_t
             + head * o_stride_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


# ---------------------------------------------------------------------- decode
def num_decode_splits(num_reqs: int, num_kv_heads: int) -> int:
    """Context splits per request: enough programs to fill the GPU, no more."""
    splits = triton.cdiv(_TARGET_PROGRAMS, max(1, num_reqs * num_kv_heads))
    return min(_MAX_SPLITS, triton.next_power_of_2(splits))


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """One query token per request: q [B, H, D] -> out [B, H, D]. The grid depends
    only on B, H and H_kv (never on sequence lengths): CUDA-graph safe."""
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    gqa = num_heads // num_kv_heads
    splits = num_decode_splits(num_reqs, num_kv_heads)
    part_out = torch.empty((splits, num_reqs, num_heads, head_dim), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty((splits, num_reqs, num_heads), dtype=torch.float32, device=q.device)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _decode_kernel[(num_reqs, num_kv_heads, splits)](
        q, key_cache, value_cache, part_out, part_lse, block_tables, seq_lens, scale,
        q.stride(0), q.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_reqs, num_heads,
        GQA=gqa, BLOCK_G=max(16, triton.next_power_of_2(gqa)), PAGE=block_size,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=64,
        SPLITS=splits, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    _reduce_kernel[(num_reqs, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), num_reqs, num_heads,
        SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim))


@triton.jit
def _decode_kernel(q_ptr, key_cache_ptr, value_cache_ptr, part_out_ptr, part_lse_ptr,
                   block_tables_ptr, seq_lens_ptr, scale,
                   q_stride_t, q_stride_h, bt_stride, c_stride_b, c_stride_t, c_stride_h,
                   num_reqs, num_heads,
                   GQA: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLITS: tl.constexpr, IEEE: tl.constexpr):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    # Split the context in BLOCK_N-aligned ranges derived from this request's length.
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_valid = offs_g < GQA
    d_valid = offs_d < HEAD_DIM
    heads = kv_head * GQA + offs_g
    q = tl.load(q_ptr + req.to(tl.int64) * q_stride_t + heads[:, None] * q_stride_h
                + offs_d[None, :], mask=g_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        k, v = _load_kv_tile(key_cache_ptr, value_cache_ptr, block_tables_ptr + req * bt_stride,
                             offs_n, n_valid, offs_d, d_valid, kv_head,
                             c_stride_b, c_stride_t, c_stride_h, PAGE)
        scores = _dot(q, tl.trans(k), IEEE) * scale
        scores = tl.where(n_valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    has_work = end > start
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = tl.where(has_work, acc / safe_l[:, None], 0.0)
    lse = tl.where(has_work, m_i + tl.log(safe_l), float("-inf"))
    base = (split * num_reqs + req).to(tl.int64) * num_heads + heads
    tl.store(part_out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=g_valid[:, None] & d_valid[None, :])
    tl.store(part_lse_ptr + base, lse, mask=g_valid)


@triton.jit
def _reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, o_stride_t, o_stride_h,
                   num_reqs, num_heads,
                   SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    base = (offs_s * num_reqs + req).to(tl.int64) * num_heads + head
    lse = tl.load(part_lse_ptr + base)
    lse_max = tl.max(lse, 0)
    # A padding row of a CUDA-graph batch has no context at all: write zeros.
    safe_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp(lse - safe_max)
    total = tl.sum(weights, 0)
    parts = tl.load(part_out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=d_valid[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + req.to(tl.int64) * o_stride_t + head * o_stride_h + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_valid)


# ---------------------------------------------------------------------- shared
@triton.jit
def _load_kv_tile(key_cache_ptr, value_cache_ptr, block_table_ptr, offs_n, n_valid, offs_d,
                  d_valid, kv_head, c_stride_b, c_stride_t, c_stride_h, PAGE: tl.constexpr):
    """Keys and values [BLOCK_N, BLOCK_D] of context positions offs_n of one request."""
    block = tl.load(block_table_ptr + offs_n // PAGE, mask=n_valid, other=0).to(tl.int64)
    row = block * c_stride_b + (offs_n % PAGE) * c_stride_t + kv_head * c_stride_h
    mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(key_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(value_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)
