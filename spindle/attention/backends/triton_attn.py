"""Triton attention over the paged KV cache (the CUDA backend).

Kernels:

* ``store_kv``: writes this step's keys and values into their cache slots
  (slot < 0 marks a padding token of a CUDA-graph batch: skipped). When the model
  hands over its q/k norm + rotary (a QKNormRope), prefill steps do this store inside
  that kernel instead (fused_kernels.qk_norm_rope_).
* ``prefill``: any number of new tokens per request after any cached context
  (chunked prefill, prefix-cache hits, mixed prefill + decode steps). One program
  per (query tile, request, query head), or with pack_gqa per (tile of (token,
  query head) pairs, request, KV head); online softmax over the context, causal
  relative to the context length.
* ``decode``: one new token per request (flash-decoding), one launch per layer.
  One program per (KV head, request, split), a request's KV heads side by side: the
  query heads sharing a KV head are packed into one tile (GQA), and the context is
  split so that small batches still fill the GPU. Each program applies the q/k norm +
  rotary (when given) to its queries and to the new token's key; the one whose split
  ends at the new token writes the new k and v into the cache and attends to them from
  registers. The last split to finish (a per-(request, KV head) counter) merges the
  splits' partial results, so no separate reduce kernel runs. Each program derives its
  context range from the request's sequence length on the device, so the launch grid
  depends only on the batch size: the kernel can be captured in CUDA graphs and
  replayed for any sequence lengths. Given meta.decode_order (the runner's on a GPU
  with SPINDLE_DECODE_LONGEST_FIRST=1), program row i serves request decode_order[i]:
  the longest contexts start first.
* ``decode``, one or two requests (``_decode_head_kernel``; SPINDLE_DECODE_PER_HEAD=0
  keeps the one above): the same work and arguments, one program per (query head,
  request, split) with multiply-adds instead of tl.dot tiles, the merge counted per
  (request, query head). At these sizes the kernel's time is latency, not arithmetic.
* mixed steps (prompt chunks beside requests of one new token): given the metadata's
  two lists of requests (single_token_reqs, multi_token_reqs), the prefill kernel
  serves the second and the decode kernel the first, each request's token read at its
  query start (TritonAttentionBackend.forward says when).

Sliding window W (the layer's ``sliding_window``; transformers' semantics, see
torch_sdpa): a query at position p sees keys p - W < k <= p. The prefill and decode
kernels start reading a request's context at the window's start (prefill: the window
of the tile's first query; decode: seq_len - W) and never load a position before it,
so block-table entries of blocks wholly before the window may be stale. The window is a launch
argument, the grid unchanged (CUDA-graph safe); without one (SLIDING=False) the
kernels compile exactly as before.

Cache layout: [2, num_blocks, block_size, num_kv_heads, head_dim] (see
AttentionMetadata), read through its strides: with SPINDLE_KV_HEAD_MAJOR=1 (a
measuring knob, off) the pages are allocated heads first ([kv heads, block_size,
head_dim] a page) and the kernels see them as a strided view of that shape, so that a
program reads one head's page as one contiguous run (cache/spec.py). Float32 models
use IEEE dot products (not TF32), so that a float32 run stays comparable with
transformers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from spindle.attention.heads import set_head_geometry, set_score_options
from spindle.attention.metadata import AttentionMetadata
from spindle.layers import pdl
from spindle.layers.fused_kernels import cache_row, norm_rope_rows
from spindle.layers.rotary import QKNormRope
from spindle.switches import integer, on_off

TARGET_PROGRAMS_ENV = "SPINDLE_DECODE_TARGET_PROGRAMS"
PER_HEAD_ENV = "SPINDLE_DECODE_PER_HEAD"
TILES_ENV = "SPINDLE_DECODE_TILES"
HEAD_MAJOR_ENV = "SPINDLE_KV_HEAD_MAJOR"
_MAX_SPLITS = 32
# Small decode batches take the per-head kernel (see decode_attention): at most this
# many requests, split to about this many programs.
_PER_HEAD_MAX_REQS = 2
_PER_HEAD_PROGRAMS = 512


def target_programs(environ=os.environ) -> int:
    """The number of decode programs the split planner aims for: 264 (about two waves
    on a 132-SM H100/H200), or SPINDLE_DECODE_TARGET_PROGRAMS, a measuring knob.
    Other targets measured no better on the H200 (docs/benchmarks.md)."""
    return integer(TARGET_PROGRAMS_ENV, environ.get(TARGET_PROGRAMS_ENV, "264"), 1)


_TARGET_PROGRAMS = target_programs()


def head_major_pages(environ=os.environ) -> bool:
    """SPINDLE_KV_HEAD_MAJOR=1: ask for KV pages that keep each head's tokens together
    (AttentionCacheSpec.head_major), a measuring knob, off until measured. On the
    H200 decode attention's reads went from 0.90 to 0.95 of copy bandwidth when a
    request's KV heads became neighbouring programs (docs/benchmarks.md): where their
    reads land in DRAM matters there, and with heads first one program reads a page
    of its head as one run instead of 256-byte pieces 2 KiB apart."""
    return on_off(HEAD_MAJOR_ENV, False, environ)


def _checked_tiles(tiles: tuple[int, int, int]) -> tuple[int, int, int]:
    block_n, warps, stages = tiles
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"decode tiles: BLOCK_N must be a power of two >= 16, got {block_n}")
    if warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise ValueError(f"decode tiles: num_warps must be 1-16 (a power of two) and "
                         f"num_stages >= 1, got {warps} and {stages}")
    return block_n, warps, stages


def parse_tiles(text: str) -> tuple[int, int, int]:
    """"64x4x2" -> (64, 4, 2): the per-KV-head decode kernel's BLOCK_N, num_warps and
    num_stages, checked as decode_attention checks its tiles argument."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"decode tiles are BLOCK_NxWARPSxSTAGES (e.g. 64x4x2), got {text!r}")
    block_n, warps, stages = map(int, parts)
    return _checked_tiles((block_n, warps, stages))


def env_tiles(environ=os.environ) -> tuple[int, int, int] | None:
    """SPINDLE_DECODE_TILES ("64x4x3"): the per-KV-head decode kernel's tiles for every
    launch whose heads are not wide (a measuring knob, as SPINDLE_DECODE_TARGET_PROGRAMS
    is); unset or empty: the tuned ones."""
    raw = environ.get(TILES_ENV, "")
    if not raw:
        return None
    try:
        return parse_tiles(raw)
    except ValueError as err:
        raise ValueError(f"{TILES_ENV}: {err}") from None


_ENV_TILES = env_tiles()


class TritonAttentionBackend:
    # forward() takes q/k un-normalised and un-rotated plus a QKNormRope, and fuses it.
    fuses_qk_transform = True

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None,
                 alibi_slopes: torch.Tensor | None = None,
                 attention_chunk_size: int | None = None) -> None:
        set_head_geometry(self, num_heads, head_dim, scale, num_kv_heads)
        set_score_options(self, num_heads, sliding_window, logits_soft_cap, sinks,
                          alibi_slopes, attention_chunk_size)
        self.gqa = num_heads // num_kv_heads
        # Its kernels address the cache through its strides, so any page layout serves:
        # this asks for head-major pages (Attention.cache_spec) under the switch.
        self.pages_head_major = head_major_pages()
        self._counters: torch.Tensor | None = None
        # The layer's options, as both kernels' launchers take them.
        self._options = dict(sliding_window=self.sliding_window,
                             soft_cap=self.logits_soft_cap, sinks=self.sinks,
                             alibi_slopes=self.alibi_slopes, chunked=self.chunk is not None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None,
                attn_metadata: AttentionMetadata | None,
                qk_transform: QKNormRope | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, H_kv, D] -> [T, H, D]. With qk_transform, q and k are
        still to be normalised and rotated (q and k may be modified in place)."""
        if kv_cache is None:
            # The profiling forward runs before the cache exists: attend among the
            # step's new tokens with the plain-torch path (a conservative peak).
            from spindle.attention.backends.torch_sdpa import TorchSDPABackend

            if qk_transform is not None:
                qk_transform.apply_(q, k)
            return TorchSDPABackend(self.num_heads, self.head_dim, self.scale,
                                    self.num_kv_heads,
                                    self.sliding_window if self.chunk is None else None,
                                    self.logits_soft_cap, self.sinks, self.alibi_slopes,
                                    self.chunk).forward(q, k, v, None, attn_metadata)
        if attn_metadata is None:
            raise ValueError("attention with a KV cache needs attention metadata")
        out = torch.empty_like(q)
        options = self._options
        if attn_metadata.max_query_len == 1:
            decode_attention(q, k, v, kv_cache, attn_metadata, self.scale, out,
                             self._split_counters(q.device), qk_transform, **options)
            return out
        if qk_transform is None:
            store_kv(k, v, kv_cache, attn_metadata.slot_mapping)
        else:
            qk_transform.apply_(q, k, v, kv_cache, attn_metadata.slot_mapping)
        singles = self._single_token_requests(attn_metadata)
        prefill_attention(q, kv_cache, attn_metadata, self.scale, out,
                          requests=None if singles is None else attn_metadata.multi_token_reqs,
                          **options)
        if singles is not None:  # (q and k rotated, k and v stored above)
            decode_attention(q, k, v, kv_cache, attn_metadata, self.scale, out,
                             self._split_counters(q.device), requests=singles, **options)
        return out

    def _single_token_requests(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """The requests of a mixed step that the decode kernel serves, or None.

        In the prefill kernel a single-token request takes a 64-row tile of one valid
        row for each query head, and reads its context once per query head; the decode
        kernel reads it once per KV head. Only when they fill the GPU without splitting
        their contexts (one variant of the decode kernel, compiled in warm-up), though:
        at 248 decoding requests beside prompts, 8,192 tokens in all, a layer's attention
        took 1,034 us in one kernel and 509 us split (an H100, docs/benchmarks.md)."""
        singles = meta.single_token_reqs
        if singles is None or singles.numel() * self.num_kv_heads < _TARGET_PROGRAMS:
            return None
        return singles

    def _split_counters(self, device: torch.device) -> torch.Tensor:
        """This layer's decode split counters, allocated once and kept: captured CUDA
        graphs hold their address. (The runner's eager warm-up decode allocates them
        before any capture; were the first allocation captured, the graph would just
        zero them on every replay, which is still correct.)"""
        if self._counters is None or self._counters.device != device:
            self._counters = split_counters(device)
        return self._counters


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
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        HEAD_DIM=head_dim, ROW=row, BLOCK=triton.next_power_of_2(row),
        PAGE=key_cache.shape[1])


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                     c_stride_b, c_stride_t, c_stride_h,
                     HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr,
                     PAGE: tl.constexpr):
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
    # (The cache's strides: its pages may hold their heads first, cache/spec.py.)
    dst = cache_row(slot, c_stride_b, c_stride_t, PAGE) + head * c_stride_h + dim
    tl.store(key_cache_ptr + dst, key, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


# ---------------------------------------------------------------------- prefill
# The prefill kernel's (BLOCK_N, num_warps, num_stages) for 64-query tiles of heads up to
# 128 dims: 32 keys at 3 stages (its loop loads block ids ahead, so 3 stages give the
# K/V copies two buffers). On an H100 (docs/benchmarks.md, 2026-12-07) a layer's prompts
# in a mixed step of 8,192 tokens took 140-148 us against 157-167 with the 64 keys at 2
# stages kept for the rest (16-query tiles: short queries, batch-invariant mode; heads
# of 129-256 dims, not measured with these). Heads over 256 dims: 16 keys.
_PREFILL_TILES = (32, 4, 3)
_PREFILL_OTHER_TILES = (64, 4, 2)
_PREFILL_WIDEST_TILES = (16, 4, 2)


def default_prefill_tiles(block_m: int, head_dim: int) -> tuple[int, int, int]:
    """The prefill kernel's key tile, warps and stages for block_m-query tiles of
    head_dim features."""
    if _wide_heads(head_dim):
        return _PREFILL_WIDEST_TILES
    if block_m == 64 and head_dim <= 128:
        return _PREFILL_TILES
    return _PREFILL_OTHER_TILES


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor, sliding_window: int | None = None,
                      block_m: int | None = None, pack_gqa: bool = False,
                      soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None, chunked: bool = False,
                      requests: torch.Tensor | None = None, block_n: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None) -> None:
    """Causal attention of every request's new tokens over its context (the new tokens'
    k/v already stored), within sliding_window positions when given, scores soft-capped
    (cap * tanh(score / cap), Gemma 2) with soft_cap; sinks [H]: a logit per query head
    in every softmax's denominator, attending to nothing (gpt-oss); alibi_slopes [H]
    (float32): slope_h * (key position - query position) added to head h's scores;
    chunked: sliding_window is an attention chunk size (attention/chunked.py), each
    query seeing its own chunk up to itself. block_m: rows
    per tile (default: by the step's longest query); a request with no context (a
    CUDA-graph padding row) gets zeros.

    A tile's rows are one query head's tokens, or with pack_gqa the (token, query
    head) pairs of one KV head, so its keys and values are read once for all the
    query heads that share them (a decode step's tile is then one token's heads).

    requests [R] int32: attend for those requests alone (a mixed step's with more than
    one new token; the other rows of out are left alone): see
    TritonAttentionBackend.forward. block_n, num_warps, num_stages: the key tile and
    the launch's instead of default_prefill_tiles' (a sweep:
    benchmarks/mixed_attention.py)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    block_m = block_m or (64 if meta.max_query_len > 32 and not _wide_heads(head_dim) else 16)
    tiles = default_prefill_tiles(block_m, head_dim)
    block_n, num_warps, num_stages = (block_n or tiles[0], num_warps or tiles[1],
                                      num_stages or tiles[2])
    gqa = num_heads // num_kv_heads
    num_reqs = meta.num_reqs if requests is None else requests.numel()
    if pack_gqa:
        grid = (triton.cdiv(meta.max_query_len * gqa, block_m), num_reqs, num_kv_heads)
    else:
        grid = (triton.cdiv(meta.max_query_len, block_m), num_reqs, num_heads)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _prefill_kernel[grid](
        q, key_cache, value_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        meta.seq_lens if requests is None else requests,
        q if sinks is None else sinks, q if alibi_slopes is None else alibi_slopes,
        scale, sliding_window or 0, soft_cap or 0.0, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), meta.block_tables.stride(0), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2),
        GQA=gqa, PAGE=block_size, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        SLIDING=sliding_window is not None, CHUNKED=_chunked(sliding_window, chunked),
        SOFT_CAP=soft_cap is not None, SINKS=sinks is not None,
        ALIBI=alibi_slopes is not None, IEEE=q.dtype == torch.float32, PACK_GQA=pack_gqa,
        INDEXED=requests is not None, num_warps=num_warps, num_stages=num_stages)


# bt_stride (the widest block table of the step) varies step by step: not specialized,
# so one compiled variant serves every step (no compiling after warm-up).
@triton.jit(do_not_specialize=["bt_stride"])
def _prefill_kernel(q_ptr, key_cache_ptr, value_cache_ptr, out_ptr, block_tables_ptr,
                    query_start_ptr, seq_lens_ptr, requests_ptr, sinks_ptr, alibi_ptr, scale,
                    window, soft_cap,
                    q_stride_t, q_stride_h, o_stride_t, o_stride_h, bt_stride,
                    c_stride_b, c_stride_t, c_stride_h,
                    GQA: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SLIDING: tl.constexpr, CHUNKED: tl.constexpr, SOFT_CAP: tl.constexpr,
                    SINKS: tl.constexpr, ALIBI: tl.constexpr, IEEE: tl.constexpr,
                    PACK_GQA: tl.constexpr, INDEXED: tl.constexpr):
    tile = tl.program_id(0)
    req = tl.program_id(1)
    if INDEXED:
        req = tl.load(requests_ptr + req)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    if PACK_GQA:  # rows are (token, query head of this KV head) pairs
        kv_head = tl.program_id(2)
        offs_m = rows // GQA
        heads = kv_head * GQA + rows % GQA
        first_token = tile * BLOCK_M // GQA
        last_token = ((tile + 1) * BLOCK_M - 1) // GQA
    else:  # rows are tokens of one query head
        kv_head = tl.program_id(2) // GQA
        offs_m = rows
        heads = tl.program_id(2) + tl.zeros([BLOCK_M], tl.int32)
        first_token = tile * BLOCK_M
        last_token = (tile + 1) * BLOCK_M - 1
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if first_token >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < q_len
    d_valid = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None].to(tl.int64) * q_stride_t
                + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The last query of this tile sees context positions up to context_len + its index.
    kv_end = tl.minimum(seq_len, context_len + last_token + 1)
    row_limit = context_len + offs_m  # (each row's query position)
    if ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=m_valid, other=0.0)
    kv_start = 0
    if SLIDING:  # the first query of this tile sees positions from here on
        if CHUNKED:  # (its chunk's start)
            kv_start = (context_len + first_token) // window * window
        else:
            kv_start = tl.maximum(context_len + first_token - window + 1, 0)
    # Each tile's block ids are loaded an iteration ahead, as in _attend_split's loop:
    # from num_stages 3 the K/V copies get more than one buffer.
    block_table = block_tables_ptr + req * bt_stride
    offs_n = kv_start + tl.arange(0, BLOCK_N)
    ids = _block_ids(block_table, offs_n, offs_n < kv_end, PAGE)
    for start in range(kv_start, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        k, v = _load_kv_blocks(key_cache_ptr, value_cache_ptr, ids, offs_n, n_valid, offs_d,
                               d_valid, kv_head, c_stride_b, c_stride_t, c_stride_h, PAGE)
        ids = _block_ids(block_table, offs_n + BLOCK_N, offs_n + BLOCK_N < kv_end, PAGE)
        scores = _capped(_dot(q, tl.trans(k), IEEE) * scale, soft_cap, SOFT_CAP)
        if ALIBI:
            scores += slopes[:, None] * (offs_n[None, :] - row_limit[:, None]).to(tl.float32)
        visible = (offs_n[None, :] <= row_limit[:, None]) & n_valid[None, :]
        if CHUNKED:
            visible = visible & (offs_n[None, :] >= row_limit[:, None] // window * window)
        elif SLIDING:
            visible = visible & (offs_n[None, :] > row_limit[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # With a window, a row past the request's queries may see no key of a tile.
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, scores, v, IEEE, EMPTY_ROWS=SLIDING)
    # (With a window, rows past the request's queries may have seen no key; a padding
    # request none at all. Neither is stored or read.)
    out = acc / _denominator(l_i, m_i, sinks_ptr, heads, m_valid, SINKS)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None].to(tl.int64) * o_stride_t
             + heads[:, None] * o_stride_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


def _chunked(sliding_window: int | None, chunked: bool) -> bool:
    if chunked and sliding_window is None:
        raise ValueError("chunked attention needs its chunk size as sliding_window")
    return chunked


def _wide_heads(head_dim: int) -> bool:
    """Heads wider than 256 features (latent attention's 576): 16-key tiles (and 16-query
    prefill tiles), so that a stage's K and V tiles of 1,024 padded features stay within
    shared memory (64 keys would take 256 KB a stage in bf16). Narrower heads keep the
    tiles measured on the H200. Not yet run on a GPU at these widths."""
    return head_dim > 256


# ---------------------------------------------------------------------- decode
# The per-KV-head kernel's tiles (BLOCK_N, num_warps, num_stages) by its (request, KV
# head) pairs: from _SMALL_TILES_FROM, 32 keys in two warps (more programs an SM, so
# more tiles in flight); below, 64 keys in four. Three stages: two buffers for the K/V
# copies (_attend_split). On an H200 (docs/benchmarks.md, 2026-12-07) the nano workload
# read 0.676 x roofline with 64x4x2, 0.681 with 64x4x3 and 0.703 with 32x2x3 at every
# size; the kernel alone took 248 us against 263 (64x4x3) at 256 requests x 8 KV heads,
# and 136 against 133 at 128, 83 against 76 at 64 (one nano round on a second H200:
# no difference either way, to be repeated). Heads wider than 128 dims (not
# measured with these) keep the earlier 64x4x2. A mixed step's single-token requests
# take the 64-key tiles whatever their number: one variant, which warm-up compiles.
_LARGE_TILES = (64, 4, 3)
_SMALL_TILES = (32, 2, 3)
_SMALL_TILES_FROM = 1025
_WIDE_TILES = (64, 4, 2)
_WIDEST_TILES = (16, 4, 2)  # (see _wide_heads)


def default_decode_tiles(num_reqs: int, num_kv_heads: int, head_dim: int,
                         mixed: bool = False) -> tuple[int, int, int]:
    """The per-KV-head decode kernel's tiles for num_reqs requests of num_kv_heads KV
    heads of head_dim, those of a mixed step or not (SPINDLE_DECODE_TILES overrides
    them for heads of at most 256 dims)."""
    if _wide_heads(head_dim):
        return _WIDEST_TILES
    if head_dim > 128:
        return _WIDE_TILES
    if not mixed and num_reqs * num_kv_heads >= _SMALL_TILES_FROM:
        return _SMALL_TILES
    return _LARGE_TILES


def num_decode_splits(num_reqs: int, num_kv_heads: int) -> int:
    """Context splits per request: enough programs to fill the GPU, no more."""
    splits = triton.cdiv(_TARGET_PROGRAMS, max(1, num_reqs * num_kv_heads))
    return min(_MAX_SPLITS, triton.next_power_of_2(splits))


def split_counters(device: torch.device | str) -> torch.Tensor:
    """Zeroed arrival counters for decode_attention, one per (request, KV head), or per
    (request, query head) in the per-head kernel. More than one split per request only
    happens below _TARGET_PROGRAMS (request, KV head) pairs, or _PER_HEAD_PROGRAMS
    (request, query head) pairs, so that many counters always suffice. Each launch
    leaves them at zero."""
    return torch.zeros(max(_TARGET_PROGRAMS, _PER_HEAD_PROGRAMS), dtype=torch.int32,
                       device=device)


def per_head_applies(num_reqs: int, head_dim: int, environ=os.environ) -> bool:
    """Whether a decode step of num_reqs requests takes the per-head kernel: at most
    _PER_HEAD_MAX_REQS requests, a head dim of 16, 32, 64 or 128 (a program holds a
    64-key tile of its KV head in two warps' registers), and SPINDLE_DECODE_PER_HEAD
    not "0". (On an H100, four requests at 2,048 tokens of context and eight at 640 or
    2,048 were faster in the per-KV-head kernel: docs/benchmarks.md.)"""
    return (num_reqs <= _PER_HEAD_MAX_REQS and head_dim in (16, 32, 64, 128)
            and on_off(PER_HEAD_ENV, True, environ))


def num_per_head_splits(num_reqs: int, num_heads: int) -> int:
    """Context splits per (request, query head) for the per-head kernel."""
    splits = triton.cdiv(_PER_HEAD_PROGRAMS, max(1, num_reqs * num_heads))
    return min(_MAX_SPLITS, triton.next_power_of_2(splits))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     out: torch.Tensor, counters: torch.Tensor,
                     qk_transform: QKNormRope | None = None,
                     sliding_window: int | None = None, soft_cap: float | None = None,
                     sinks: torch.Tensor | None = None,
                     alibi_slopes: torch.Tensor | None = None, chunked: bool = False,
                     requests: torch.Tensor | None = None,
                     tiles: tuple[int, int, int] | None = None) -> None:
    """One query token per request: q [B, H, D], this step's k/v [B, H_kv, D] -> out
    [B, H, D], in one launch. Stores k/v into the cache slots meta.slot_mapping
    (negative: padding, skipped); applies qk_transform to q and k first when given
    (q and k themselves are left as they are). counters: see split_counters. With
    sliding_window W, each request attends to (and reads) only its last W positions;
    soft_cap, sinks, alibi_slopes, chunked: as in prefill_attention (chunked: the last
    positions of its chunk).

    Up to _PER_HEAD_MAX_REQS requests (per_head_applies) take _decode_head_kernel, a
    program per query head; more take _decode_kernel, a program per KV head. tiles:
    _decode_kernel's (BLOCK_N, num_warps, num_stages) instead of default_decode_tiles'
    (or SPINDLE_DECODE_TILES'), a measuring knob (benchmarks/decode_attention.py --tiles);
    the engine never sets it.

    requests [R] int32 (a mixed step's requests with one new token, in the order to
    start them): attend for those alone, each request r's token being row
    meta.query_start_loc[r] of q, k, v, out, the positions and meta.slot_mapping (the
    other rows are left alone).

    The grid depends only on B, H and H_kv (never on sequence lengths): CUDA-graph
    safe. A padding row (sequence length 0) gets zeros."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_reqs = q.shape[0] if requests is None else requests.numel()
    order = meta.decode_order if requests is None else requests
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    gqa = num_heads // num_kv_heads
    per_head = per_head_applies(num_reqs, head_dim)
    if per_head:
        if tiles is not None:
            raise ValueError(f"decode tiles are the per-KV-head kernel's; {num_reqs} "
                             "request(s) take the per-head kernel")
        kernel, heads, block_n, warps, stages = _decode_head_kernel, num_heads, 64, 2, 1
        splits = num_per_head_splits(num_reqs, num_heads)
    else:
        kernel, heads = _decode_kernel, num_kv_heads
        splits = num_decode_splits(num_reqs, num_kv_heads)
        if tiles is None and _ENV_TILES and not _wide_heads(head_dim):
            tiles = _ENV_TILES
        elif tiles is None:
            tiles = default_decode_tiles(num_reqs, num_kv_heads, head_dim,
                                         mixed=requests is not None)
        block_n, warps, stages = _checked_tiles(tiles)
    if splits > 1 and num_reqs * heads > counters.numel():
        raise ValueError(f"decode with {splits} splits needs {num_reqs * heads} "
                         f"split counters, got {counters.numel()}")
    if splits > 1:
        part_out = torch.empty((splits, num_reqs, num_heads, head_dim), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((splits, num_reqs, num_heads), dtype=torch.float32,
                               device=q.device)
    else:
        part_out = part_lse = out  # unused
    rope = qk_transform
    has_norm = rope is not None and rope.q_weight is not None
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    kernel[(heads, num_reqs, splits)](
        q, k, v, key_cache, value_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
        order if order is not None else meta.seq_lens, meta.query_start_loc,
        rope.positions if rope else meta.seq_lens, rope.cos_cache if rope else q,
        rope.sin_cache if rope else q, rope.q_weight if has_norm else q,
        rope.k_weight if has_norm else q, rope.eps if rope else 0.0,
        part_out, part_lse, out, counters, q if sinks is None else sinks,
        q if alibi_slopes is None else alibi_slopes, scale,
        sliding_window or 0, soft_cap or 0.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        rope.cos_cache.stride(0) if rope else 0,
        GQA=gqa, BLOCK_G=max(16, triton.next_power_of_2(gqa)), PAGE=block_size,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n,
        SPLITS=splits, ORDERED=order is not None, MIXED=requests is not None,
        ROPE=rope is not None, HAS_NORM=has_norm, SLIDING=sliding_window is not None,
        CHUNKED=_chunked(sliding_window, chunked), SOFT_CAP=soft_cap is not None,
        SINKS=sinks is not None, ALIBI=alibi_slopes is not None,
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages,
        **pdl.kernel_args(q.device, q.shape[0]))  # (PDL by the step's tokens, as its kernels)


@triton.jit(do_not_specialize=["bt_stride"])  # (as _prefill_kernel's)
def _decode_kernel(q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                   block_tables_ptr, seq_lens_ptr, order_ptr, query_start_ptr, pos_ptr, cos_ptr,
                   sin_ptr, qw_ptr, kw_ptr, eps, part_out_ptr, part_lse_ptr, out_ptr,
                   counters_ptr, sinks_ptr, alibi_ptr, scale, window, soft_cap,
                   q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                   o_stride_t, o_stride_h, bt_stride, c_stride_b, c_stride_t, c_stride_h,
                   cs_stride,
                   GQA: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLITS: tl.constexpr, ORDERED: tl.constexpr, MIXED: tl.constexpr,
                   ROPE: tl.constexpr, HAS_NORM: tl.constexpr, SLIDING: tl.constexpr,
                   CHUNKED: tl.constexpr, SOFT_CAP: tl.constexpr, SINKS: tl.constexpr,
                   ALIBI: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    # Until pdl.wait (in _attend_split, or below for a split with no context), only
    # what no kernel of the step writes is read: the step's inputs and the cache.
    pdl.release(PDL)
    # The KV heads of one request are neighbouring programs: they run together and read
    # the same pages (a token's heads are adjacent in the cache), which kept DRAM reads
    # closer together than request-major order (0.90 -> 0.95 of copy bandwidth at 256
    # requests on the H200).
    # With ORDERED, the requests start in meta.decode_order (longest context first).
    kv_head = tl.program_id(0)
    row = tl.program_id(1)  # (the index of partials and split counters)
    req, token = _request_and_token(row, order_ptr, query_start_ptr, ORDERED, MIXED)
    split = tl.program_id(2)
    num_reqs = tl.num_programs(1)
    num_heads = tl.num_programs(0) * GQA
    seq_len = tl.load(seq_lens_ptr + req)
    span, per_split, start, end = _split_range(seq_len, split, window, SPLITS, BLOCK_N,
                                               SLIDING, CHUNKED)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_valid = offs_g < GQA
    d_valid = offs_d < HEAD_DIM
    heads = kv_head * GQA + offs_g
    out_rows = out_ptr + token * o_stride_t + heads * o_stride_h
    if SPLITS == 1:
        m_i, l_i, acc = _attend_split(
            q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, block_tables_ptr,
            pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, alibi_ptr, eps, scale, soft_cap, req,
            token, kv_head, heads, g_valid, start, end, seq_len, q_stride_t, q_stride_h, k_stride_t,
            k_stride_h, v_stride_t, v_stride_h, bt_stride, c_stride_b, c_stride_t,
            c_stride_h, cs_stride,
            PAGE, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, ROPE, HAS_NORM, SOFT_CAP, ALIBI, IEEE,
            PDL)
        _store_rows(out_rows, g_valid, d_valid, offs_d,
                    acc / _denominator(l_i, m_i, sinks_ptr, heads, g_valid, SINKS)[:, None])
    else:
        part_rows = (split * num_reqs + row).to(tl.int64) * num_heads + heads
        if start < end:  # (splits past the end of a short context only check in)
            m_i, l_i, acc = _attend_split(
                q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                block_tables_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, alibi_ptr, eps,
                scale, soft_cap, req, token, kv_head, heads, g_valid, start, end, seq_len,
                q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                bt_stride, c_stride_b, c_stride_t, c_stride_h, cs_stride,
                PAGE, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, ROPE, HAS_NORM, SOFT_CAP, ALIBI,
                IEEE, PDL)
            # A partial is stored as (log-sum-exp, normalised output).
            _store_rows(part_out_ptr + part_rows * HEAD_DIM, g_valid, d_valid, offs_d,
                        acc / l_i[:, None])
            tl.store(part_lse_ptr + part_rows, m_i + tl.log(l_i), mask=g_valid)
        else:
            pdl.wait(PDL)
        # Every thread's partial is written before the arrival is counted (release);
        # the program that arrives last sees all partials (acquire) and merges them.
        tl.debug_barrier()
        counter = counters_ptr + row * tl.num_programs(0) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            used_splits = tl.cdiv(span, tl.maximum(per_split, 1))
            _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, row, token, kv_head,
                          num_reqs, num_heads, used_splits, o_stride_t, o_stride_h,
                          GQA, HEAD_DIM, BLOCK_D, SPLITS, SINKS)
            tl.store(counter, 0)  # ready for the next launch


@triton.jit
def _attend_split(q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                  block_tables_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, alibi_ptr, eps,
                  scale, soft_cap, req, token, kv_head, heads, g_valid, start, end, seq_len,
                  q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                  bt_stride, c_stride_b, c_stride_t, c_stride_h, cs_stride,
                  PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr,
                  HAS_NORM: tl.constexpr, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr,
                  IEEE: tl.constexpr, PDL: tl.constexpr):
    """Softmax state (m, l, acc) of one request's query heads `heads` over context
    positions [start, end); its new token is row `token` of q, k, v, positions and
    slots. Positions before seq_len - 1 come from the cache; the new token (position
    seq_len - 1, in the last non-empty split) comes from k/v: it is
    rotated, written to its cache slot and attended from registers (at distance 0:
    no ALiBi bias).

    The first cached tile is loaded before pdl.wait: the cache below seq_len - 1 was
    written by earlier steps, so under PDL that wait on memory overlaps the tail of the
    kernel before (the q/k/v projection). Every split loads and rotates the new token's
    k up front, although only one uses it: the loads then overlap those of q instead of
    adding a round trip to memory after the loop of the split that holds the new
    token.

    The loop's K/V copies get num_stages - 1 shared-memory buffers (its block ids are
    loaded an iteration ahead): at num_stages 2, one, so a program alternates between
    loading a tile and computing on it; from 3, the next tiles' copies are in flight
    while it computes. (Loading each next tile into registers instead, with one stage,
    was measured slower on an H100 at 128 and 256 requests and not kept:
    docs/benchmarks.md.)"""
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    cached_end = tl.minimum(end, seq_len - 1)
    block_table = block_tables_ptr + req * bt_stride
    offs_first = start + tl.arange(0, BLOCK_N)
    first_valid = offs_first < cached_end
    k_first, v_first = _load_kv_tile(key_cache_ptr, value_cache_ptr, block_table, offs_first,
                                     first_valid, offs_d, d_valid, kv_head, c_stride_b,
                                     c_stride_t, c_stride_h, PAGE)
    offs_second = offs_first + BLOCK_N
    ids = _block_ids(block_table, offs_second, offs_second < cached_end, PAGE)
    pdl.wait(PDL)
    pos = tl.load(pos_ptr + token)
    slot = tl.load(slot_ptr + token)
    cos_row = cos_ptr + pos * cs_stride
    sin_row = sin_ptr + pos * cs_stride
    q_rows = q_ptr + token * q_stride_t + heads * q_stride_h
    k_row = k_ptr + token * k_stride_t + kv_head * k_stride_h + tl.zeros([1], tl.int64)
    if ROPE:
        q = norm_rope_rows(q_rows, g_valid, qw_ptr, cos_row, sin_row, eps, HEAD_DIM,
                           BLOCK_D, HAS_NORM)
        k_new = norm_rope_rows(k_row, tl.full([1], True, tl.int1), kw_ptr, cos_row, sin_row,
                               eps, HEAD_DIM, BLOCK_D, HAS_NORM)
    else:
        q = tl.load(q_rows[:, None] + offs_d[None, :],
                    mask=g_valid[:, None] & d_valid[None, :], other=0.0)
        k_new = tl.load(k_row[:, None] + offs_d[None, :], mask=d_valid[None, :], other=0.0)
    v_new = tl.load(v_ptr + token * v_stride_t + kv_head * v_stride_h + offs_d[None, :],
                    mask=d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    slopes = tl.zeros([BLOCK_G], tl.float32)
    if ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=g_valid, other=0.0)
    query_pos = seq_len - 1
    if start < cached_end:
        m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_first, v_first, offs_first,
                                     first_valid, scale, soft_cap, slopes, query_pos,
                                     SOFT_CAP, ALIBI, IEEE)
    # Each tile's block ids were loaded an iteration ahead (the second's up front):
    # with the K/V addresses depending on no load of their own iteration, Triton's
    # pipeliner gives their copies num_stages - 1 buffers (ids loaded in the same
    # iteration: one buffer up to num_stages 4, a program waiting for each tile
    # before computing on it).
    for n in range(start + BLOCK_N, cached_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < cached_end
        k, v = _load_kv_blocks(key_cache_ptr, value_cache_ptr, ids, offs_n, n_valid,
                               offs_d, d_valid, kv_head, c_stride_b, c_stride_t,
                               c_stride_h, PAGE)
        ids = _block_ids(block_table, offs_n + BLOCK_N, offs_n + BLOCK_N < cached_end,
                         PAGE)
        m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k, v, offs_n, n_valid, scale,
                                     soft_cap, slopes, query_pos, SOFT_CAP, ALIBI, IEEE)

    if (start < end) & (end == seq_len):  # this split holds the new token
        if slot >= 0:
            dst = cache_row(slot, c_stride_b, c_stride_t, PAGE) + kv_head * c_stride_h \
                + offs_d[None, :]
            tl.store(key_cache_ptr + dst, k_new, mask=d_valid[None, :])
            tl.store(value_cache_ptr + dst, v_new, mask=d_valid[None, :])
        score = _capped(tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale, soft_cap,
                        SOFT_CAP)
        m_i, l_i, acc = _softmax_add_key(m_i, l_i, acc, score, v_new.to(tl.float32))
    return m_i, l_i, acc


@triton.jit
def _attend_tile(m_i, l_i, acc, q, k, v, offs_n, n_valid, scale, soft_cap, slopes, query_pos,
                 SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr, IEEE: tl.constexpr):
    """Fold a tile of cached keys and values (positions offs_n, valid where n_valid, at
    least one) into the softmax state of the query at query_pos (ALiBi: its heads'
    slopes)."""
    scores = _capped(_dot(q, tl.trans(k), IEEE) * scale, soft_cap, SOFT_CAP)
    if ALIBI:
        scores += slopes[:, None] * (offs_n - query_pos)[None, :].to(tl.float32)
    scores = tl.where(n_valid[None, :], scores, float("-inf"))
    return _softmax_step(m_i, l_i, acc, scores, v, IEEE, EMPTY_ROWS=False)


@triton.jit
def _request_and_token(row, order_ptr, query_start_ptr, ORDERED: tl.constexpr,
                       MIXED: tl.constexpr):
    """(request, its new token's row) for decode program row `row`: request row, or
    order[row] with ORDERED; its token is the request's index in a decode step, its
    query start in a mixed step (MIXED)."""
    req = row
    if ORDERED:
        req = tl.load(order_ptr + row)
    token = req.to(tl.int64)
    if MIXED:
        token = tl.load(query_start_ptr + req).to(tl.int64)
    return req, token


@triton.jit
def _split_range(seq_len, split, window, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 SLIDING: tl.constexpr, CHUNKED: tl.constexpr):
    """(span, per_split, start, end): the context positions a decode query sees are
    the span positions before seq_len (all, or its window or chunk's); split `split`
    of SPLITS takes [start, end) of them, in BLOCK_N-sized pieces derived from the
    request's length (empty for splits past a short context)."""
    first = 0  # the first context position the query sees
    if CHUNKED:  # (its chunk's start; a padding row's 0)
        first = tl.maximum(seq_len - 1, 0) // window * window
    elif SLIDING:
        first = tl.maximum(seq_len - window, 0)
    span = seq_len - first
    per_split = tl.cdiv(tl.cdiv(span, SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(seq_len, start + per_split)
    return span, per_split, start, end


@triton.jit(do_not_specialize=["bt_stride"])  # (as _prefill_kernel's)
def _decode_head_kernel(q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                        block_tables_ptr, seq_lens_ptr, order_ptr, query_start_ptr, pos_ptr,
                        cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps, part_out_ptr, part_lse_ptr,
                        out_ptr, counters_ptr, sinks_ptr, alibi_ptr, scale, window, soft_cap,
                        q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
                        o_stride_t, o_stride_h, bt_stride, c_stride_b, c_stride_t, c_stride_h,
                        cs_stride,
                        GQA: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        SPLITS: tl.constexpr, ORDERED: tl.constexpr, MIXED: tl.constexpr,
                        ROPE: tl.constexpr, HAS_NORM: tl.constexpr, SLIDING: tl.constexpr,
                        CHUNKED: tl.constexpr, SOFT_CAP: tl.constexpr, SINKS: tl.constexpr,
                        ALIBI: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """_decode_kernel's work (same arguments; BLOCK_G, BLOCK_D and IEEE unused) for
    one or two requests: one program per (query head, request, split), two warps,
    CUDA-core arithmetic on [BLOCK_N] scores and [HEAD_DIM] rows instead of tl.dot
    tiles padded to 16 query rows. At that size the kernel's time is latency (layout
    conversions through shared memory, reductions across warps, the merge), not
    arithmetic: in a chain of 28 Qwen3-0.6B layers on an H100 it took 0.6-1.9 us a
    layer less at one request and 2.2 us at two (640-2,048 tokens of context;
    docs/benchmarks.md). The query heads of a KV head read the same cache tiles (the
    second read mostly from L2).

    Heads are handled as halves [HEAD_DIM / 2] so that the neox rotation needs no
    partner loads. Everything no kernel of the step writes (positions, slots, rotary
    rows, norm weights, the split's first cache tile) is read before pdl.wait. Splits
    with no context leave at once, before the wait (split 0 always waits, so this
    kernel's completion still implies its predecessor's); a request whose context
    fits one split writes its output directly; otherwise the last split to finish
    merges."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pdl.release(PDL)
    head = tl.program_id(0)
    kv_head = head // GQA
    row = tl.program_id(1)  # (the index of partials and split counters)
    req, token = _request_and_token(row, order_ptr, query_start_ptr, ORDERED, MIXED)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    span, per_split, start, end = _split_range(seq_len, split, window, SPLITS, BLOCK_N,
                                               SLIDING, CHUNKED)
    used = tl.cdiv(span, tl.maximum(per_split, 1))  # (0 for a padding row)
    if split >= tl.maximum(used, 1):
        return  # (it reads and writes nothing)
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = tl.load(pos_ptr + token)
    slot = tl.load(slot_ptr + token)
    dtype = q_ptr.dtype.element_ty
    if ROPE:  # (float32 tables, cast to the activations' dtype as torch does)
        cos_row = cos_ptr + pos * cs_stride
        sin_row = sin_ptr + pos * cs_stride
        cos1 = tl.load(cos_row + offs_h).to(dtype).to(tl.float32)
        cos2 = tl.load(cos_row + HALF + offs_h).to(dtype).to(tl.float32)
        sin1 = tl.load(sin_row + offs_h).to(dtype).to(tl.float32)
        sin2 = tl.load(sin_row + HALF + offs_h).to(dtype).to(tl.float32)
        if HAS_NORM:
            qw1 = tl.load(qw_ptr + offs_h).to(tl.float32)
            qw2 = tl.load(qw_ptr + HALF + offs_h).to(tl.float32)
            kw1 = tl.load(kw_ptr + offs_h).to(tl.float32)
            kw2 = tl.load(kw_ptr + HALF + offs_h).to(tl.float32)
    slope = 0.0
    if ALIBI:
        slope = tl.load(alibi_ptr + head)
    cached_end = tl.minimum(end, seq_len - 1)
    block_table = block_tables_ptr + req * bt_stride
    offs_n = start + tl.arange(0, BLOCK_N)
    k1, k2, v = _load_head_tile(key_cache_ptr, value_cache_ptr, block_table, offs_n,
                                offs_n < cached_end, kv_head, c_stride_b, c_stride_t,
                                c_stride_h, PAGE, HALF)
    pdl.wait(PDL)
    q_row = q_ptr + token * q_stride_t + head * q_stride_h
    k_row = k_ptr + token * k_stride_t + kv_head * k_stride_h
    q1 = tl.load(q_row + offs_h)
    q2 = tl.load(q_row + HALF + offs_h)
    kn1 = tl.load(k_row + offs_h)
    kn2 = tl.load(k_row + HALF + offs_h)
    v_new = tl.load(v_ptr + token * v_stride_t + kv_head * v_stride_h + offs_d)
    if ROPE:
        if HAS_NORM:
            q1, q2 = _rms_norm_halves(q1, q2, qw1, qw2, eps, HEAD_DIM)
            kn1, kn2 = _rms_norm_halves(kn1, kn2, kw1, kw2, eps, HEAD_DIM)
        q1, q2 = _rope_halves(q1, q2, cos1, cos2, sin1, sin2)
        kn1, kn2 = _rope_halves(kn1, kn2, cos1, cos2, sin1, sin2)
    q1 = q1.to(tl.float32)
    q2 = q2.to(tl.float32)

    # The new token first (every split has its q and k by now; a split without it
    # starts from an empty state), then the cached tiles.
    has_new = (start < end) & (end == seq_len)
    score = _capped((tl.sum(q1 * kn1.to(tl.float32), 0)
                     + tl.sum(q2 * kn2.to(tl.float32), 0)) * scale, soft_cap, SOFT_CAP)
    m_i = tl.where(has_new, score, float("-inf"))
    l_i = tl.where(has_new, 1.0, 0.0)
    acc = tl.where(has_new, v_new.to(tl.float32), 0.0)
    query_pos = seq_len - 1
    m_i, l_i, acc = _head_tile(m_i, l_i, acc, q1, q2, k1, k2, v, offs_n, offs_n < cached_end,
                               scale, soft_cap, slope, query_pos, SOFT_CAP, ALIBI)
    for n in range(start + BLOCK_N, cached_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < cached_end
        k1, k2, v = _load_head_tile(key_cache_ptr, value_cache_ptr, block_table, offs_n,
                                    n_valid, kv_head, c_stride_b, c_stride_t, c_stride_h,
                                    PAGE, HALF)
        m_i, l_i, acc = _head_tile(m_i, l_i, acc, q1, q2, k1, k2, v, offs_n, n_valid, scale,
                                   soft_cap, slope, query_pos, SOFT_CAP, ALIBI)
    if has_new & (slot >= 0) & (head % GQA == 0):  # (one writer per KV head)
        dst = cache_row(slot, c_stride_b, c_stride_t, PAGE) + kv_head * c_stride_h
        tl.store(key_cache_ptr + dst + offs_h, kn1)
        tl.store(key_cache_ptr + dst + HALF + offs_h, kn2)
        tl.store(value_cache_ptr + dst + offs_d, v_new)
    out_row = out_ptr + token * o_stride_t + head * o_stride_h
    if used <= 1:  # (one split: no merge; a padding row writes zeros)
        total = _nonzero(l_i)
        if SINKS:
            total = l_i + tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - m_i)
        tl.store(out_row + offs_d, (acc / total).to(out_ptr.dtype.element_ty))
    else:
        part = (split * tl.num_programs(1) + row).to(tl.int64) * tl.num_programs(0) + head
        tl.store(part_out_ptr + part * HEAD_DIM + offs_d, acc / l_i)
        tl.store(part_lse_ptr + part, m_i + tl.log(l_i))
        # (as in _decode_kernel: partials written before the arrival, merged by the last)
        tl.debug_barrier()
        counter = counters_ptr + row * tl.num_programs(0) + head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
            _merge_head(part_out_ptr, part_lse_ptr, out_row, sinks_ptr, row, head,
                        tl.num_programs(1), tl.num_programs(0), used, HEAD_DIM, HEAD_DIM,
                        SPLITS, SINKS)
            tl.store(counter, 0)  # ready for the next launch


@triton.jit
def _load_head_tile(key_cache_ptr, value_cache_ptr, block_table_ptr, offs_n, n_valid, kv_head,
                    c_stride_b, c_stride_t, c_stride_h, PAGE: tl.constexpr, HALF: tl.constexpr):
    """One KV head's keys, as halves [BLOCK_N, HALF] x 2, and values [BLOCK_N, 2 HALF]
    at context positions offs_n."""
    row = _kv_rows(block_table_ptr, offs_n, n_valid, kv_head, c_stride_b, c_stride_t,
                   c_stride_h, PAGE)[:, None]
    offs_h = tl.arange(0, HALF)[None, :]
    k1 = tl.load(key_cache_ptr + row + offs_h, mask=n_valid[:, None], other=0.0)
    k2 = tl.load(key_cache_ptr + row + HALF + offs_h, mask=n_valid[:, None], other=0.0)
    v = tl.load(value_cache_ptr + row + tl.arange(0, 2 * HALF)[None, :], mask=n_valid[:, None],
                other=0.0)
    return k1, k2, v


@triton.jit
def _head_tile(m_i, l_i, acc, q1, q2, k1, k2, v, offs_n, n_valid, scale, soft_cap, slope,
               query_pos, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr):
    """Fold a tile of cached keys (halves) and values into one query head's softmax
    state: scalars m_i, l_i and acc [HEAD_DIM] (float32; q1, q2 float32 halves). A tile
    with no valid key leaves an empty state (-inf, 0, 0) as it was."""
    scores = (tl.sum(k1.to(tl.float32) * q1[None, :], 1)
              + tl.sum(k2.to(tl.float32) * q2[None, :], 1)) * scale
    scores = _capped(scores, soft_cap, SOFT_CAP)
    if ALIBI:
        scores += slope * (offs_n - query_pos).to(tl.float32)
    scores = tl.where(n_valid, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a padding row sees no key)
    p = tl.exp(scores - m_safe)
    alpha = tl.exp(m_i - m_safe)
    return (m_new, l_i * alpha + tl.sum(p, 0),
            acc * alpha + tl.sum(v.to(tl.float32) * p[:, None], 0))


@triton.jit
def _rms_norm_halves(x1, x2, w1, w2, eps, HEAD_DIM: tl.constexpr):
    """RMSNorm(x) * w of a head given as halves, rounded where norm_rope_rows rounds."""
    dtype = x1.dtype
    h1 = x1.to(tl.float32)
    h2 = x2.to(tl.float32)
    inv = tl.math.rsqrt((tl.sum(h1 * h1, 0) + tl.sum(h2 * h2, 0)) / HEAD_DIM + eps)
    return ((w1 * (h1 * inv).to(dtype).to(tl.float32)).to(dtype),
            (w2 * (h2 * inv).to(dtype).to(tl.float32)).to(dtype))


@triton.jit
def _rope_halves(x1, x2, cos1, cos2, sin1, sin2):
    """The neox rotation of a head given as halves (x1 * cos - x2 * sin, x2 * cos + x1 *
    sin), each product rounded as norm_rope_rows rounds it."""
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    return (((a1 * cos1).to(dtype).to(tl.float32) + (-a2 * sin1).to(dtype).to(tl.float32))
            .to(dtype),
            ((a2 * cos2).to(dtype).to(tl.float32) + (a1 * sin2).to(dtype).to(tl.float32))
            .to(dtype))


@triton.jit
def _merge_head(part_out_ptr, part_lse_ptr, out_row, sinks_ptr, row, head, num_rows,
                num_heads, used_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                SPLITS: tl.constexpr, SINKS: tl.constexpr):
    """Write query head `head`'s output row (at out_row) from its partials of splits
    [0, used_splits) (the later ones had no context; none at all, for a padding row,
    gives zeros). All of its partials are loaded at once, so the merge waits on memory
    once, not once per split; the loads bypass L1 (.cg) because other programs wrote
    the partials during this launch."""
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < used_splits
    d_valid = offs_d < HEAD_DIM
    rows = (offs_s * num_rows + row).to(tl.int64) * num_heads + head
    lse = tl.load(part_lse_ptr + rows, mask=s_valid, other=float("-inf"), cache_modifier=".cg")
    parts = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_valid[:, None] & d_valid[None, :], other=0.0, cache_modifier=".cg")
    lse_max = tl.max(lse, 0)
    reference = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp(lse - reference)
    total = tl.sum(weights, 0)
    if SINKS:  # (the sink's share, once, against the same reference)
        total += tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - reference)
    merged = tl.sum(parts * weights[:, None], 0) / _nonzero(total)
    tl.store(out_row + offs_d, merged.to(out_row.dtype.element_ty), mask=d_valid)


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, row, token, kv_head,
                  num_rows, num_heads, used_splits, o_stride_t, o_stride_h, GQA: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                  SINKS: tl.constexpr):
    """_merge_head for each query head of this KV head (program row `row`, whose
    output is row `token`)."""
    for g in tl.static_range(GQA):
        head = kv_head * GQA + g
        _merge_head(part_out_ptr, part_lse_ptr,
                    out_ptr + token * o_stride_t + head * o_stride_h, sinks_ptr,
                    row, head, num_rows, num_heads, used_splits, HEAD_DIM, BLOCK_D, SPLITS,
                    SINKS)


@triton.jit
def _denominator(l_i, m_i, sinks_ptr, heads, valid, SINKS: tl.constexpr):
    """The softmax denominator of rows with state (m_i, l_i): l_i, plus exp(sink - m_i)
    with sinks (a row that saw no key, m_i = -inf, gets 0 / inf = 0)."""
    if SINKS:
        sink = tl.load(sinks_ptr + heads, mask=valid, other=0.0).to(tl.float32)
        return l_i + tl.exp(sink - m_i)
    return _nonzero(l_i)


@triton.jit
def _store_rows(rows, g_valid, d_valid, offs_d, values):
    """values [BLOCK_G, BLOCK_D] (float32) -> the rows starting at pointers rows [BLOCK_G]."""
    tl.store(rows[:, None] + offs_d[None, :], values.to(rows.dtype.element_ty),
             mask=g_valid[:, None] & d_valid[None, :])


# ---------------------------------------------------------------------- shared
@triton.jit
def _load_kv_tile(key_cache_ptr, value_cache_ptr, block_table_ptr, offs_n, n_valid, offs_d,
                  d_valid, kv_head, c_stride_b, c_stride_t, c_stride_h, PAGE: tl.constexpr):
    """Keys and values [BLOCK_N, BLOCK_D] of context positions offs_n of one request."""
    return _load_kv_blocks(key_cache_ptr, value_cache_ptr,
                           _block_ids(block_table_ptr, offs_n, n_valid, PAGE), offs_n, n_valid,
                           offs_d, d_valid, kv_head, c_stride_b, c_stride_t, c_stride_h, PAGE)


@triton.jit
def _block_ids(block_table_ptr, offs_n, n_valid, PAGE: tl.constexpr):
    """The cache blocks of context positions offs_n (block 0 where n_valid is False)."""
    return tl.load(block_table_ptr + offs_n // PAGE, mask=n_valid, other=0)


@triton.jit
def _load_kv_blocks(key_cache_ptr, value_cache_ptr, block_ids, offs_n, n_valid, offs_d,
                    d_valid, kv_head, c_stride_b, c_stride_t, c_stride_h, PAGE: tl.constexpr):
    """Keys and values [BLOCK_N, BLOCK_D] of context positions offs_n, in the cache
    blocks block_ids (their _block_ids)."""
    row = _block_rows(block_ids, offs_n, kv_head, c_stride_b, c_stride_t, c_stride_h, PAGE)
    mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(key_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(value_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _kv_rows(block_table_ptr, offs_n, n_valid, kv_head, c_stride_b, c_stride_t, c_stride_h,
             PAGE: tl.constexpr):
    """Offsets of one KV head's cache rows at context positions offs_n of one request
    (block table block_table_ptr; positions where n_valid is False read block 0)."""
    return _block_rows(_block_ids(block_table_ptr, offs_n, n_valid, PAGE), offs_n, kv_head,
                       c_stride_b, c_stride_t, c_stride_h, PAGE)


@triton.jit
def _block_rows(block_ids, offs_n, kv_head, c_stride_b, c_stride_t, c_stride_h,
                PAGE: tl.constexpr):
    """Offsets of one KV head's cache rows at context positions offs_n, which lie in
    the cache blocks block_ids."""
    return block_ids.to(tl.int64) * c_stride_b + (offs_n % PAGE) * c_stride_t \
        + kv_head * c_stride_h


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _softmax_step(m_i, l_i, acc, scores, v, IEEE: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """Online softmax: fold a tile of scores [M, N] (masked: -inf) and its values [N, D]
    into the running max m_i [M], sum l_i [M] and unnormalised output acc [M, D].
    Unless EMPTY_ROWS, every row's running max or the tile must hold a finite score;
    with it, a row with neither stays (-inf, 0, 0) instead of turning NaN."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    if EMPTY_ROWS:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.exp(scores - m_new_safe[:, None])
    alpha = tl.exp(m_i - m_new_safe)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)


@triton.jit
def _softmax_add_key(m_i, l_i, acc, score, value):
    """Online softmax: fold one key (scores [M], value [1, D] in float32) into the
    running max m_i [M], sum l_i [M] and unnormalised output acc [M, D]."""
    m_new = tl.maximum(m_i, score)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(score - m_new)
    return m_new, l_i * alpha + p, acc * alpha[:, None] + p[:, None] * value


@triton.jit
def _capped(scores, cap, SOFT_CAP: tl.constexpr):
    """cap * tanh(scores / cap) when SOFT_CAP (tanh(x) = 1 - 2 / (exp(2x) + 1), exact at
    both ends: exp overflows to inf, or underflows to 0)."""
    if SOFT_CAP:
        return cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))
    return scores


@triton.jit
def _nonzero(x):
    return tl.where(x > 0, x, 1.0)
