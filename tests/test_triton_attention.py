"""Triton paged attention and store-KV against a float64 torch reference, on fresh
random inputs: GQA ratios, head dims 64/128, block sizes, ragged lengths, prefix
hits, and outputs poisoned with NaN before every run. On a GPU in float32 and bf16;
under Triton's interpreter (no GPU) in float32 and fp16, with small shapes
(kernel_utils). Sliding windows: the Triton kernels and the torch_sdpa backend against
the reference with an explicit window mask, with the block-table entries of blocks
wholly before each request's window pointing at a NaN-filled block (a cache manager
frees those blocks, so the entries are stale): any read of one would show."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from kernel_utils import DEVICE, HALF, INTERPRETED, KernelStub, pick

pytestmark = [pytest.mark.gpu, pytest.mark.kernel]

# Relative error bounds: IEEE float32 far under 1e-3; bf16 operands 1e-3..1e-2.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 5e-3}
DTYPES = [torch.float32, HALF]
# The longest decode context: a few splits of several 64-key tiles each.
MAX_CONTEXT = pick(2000, 300)


@pytest.fixture(autouse=True)
def _plan_splits_for_a_small_gpu(monkeypatch):
    """Under the interpreter, decode plans its context splits as for a GPU with 16
    SMs (two waves of programs: 32) instead of an H200's 132, so that a handful of
    requests takes every split count from 32 (the most) down to 1 (no merge), in both
    kernels (the per-head one's target too)."""
    if INTERPRETED:
        from spindle.attention.backends import triton_attn

        monkeypatch.setattr(triton_attn, "_TARGET_PROGRAMS", 32)
        monkeypatch.setattr(triton_attn, "_PER_HEAD_PROGRAMS", 32)


KERNELS = ["per_head", "per_kv_head"]
PER_HEAD_MAX_REQS = 4  # (in these tests; the engine's is 2)


def use_decode_kernel(monkeypatch, kernel: str) -> None:
    """Make kernel serve decode steps: the per-head one (_decode_head_kernel, the
    engine's for a request or two) at up to PER_HEAD_MAX_REQS requests, or the
    per-KV-head one at any (SPINDLE_DECODE_PER_HEAD=0)."""
    from spindle.attention.backends import triton_attn

    if kernel == "per_head":
        monkeypatch.setattr(triton_attn, "_PER_HEAD_MAX_REQS", PER_HEAD_MAX_REQS)
    else:
        monkeypatch.setenv(triton_attn.PER_HEAD_ENV, "0")


def with_kernels(cases, batch_at: int = -1):
    """cases (tuples whose item batch_at is a batch size) x KERNELS, leaving out the
    per-head kernel above PER_HEAD_MAX_REQS requests: (kernel, *case)."""
    return [(kernel, *case) for case in cases for kernel in KERNELS
            if kernel != "per_head" or case[batch_at] <= PER_HEAD_MAX_REQS]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
              seed):
    """A paged cache holding each request's context at random blocks, plus queries."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(query_lens, context_lens)]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 7
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_req)), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = perm[used:used + n]
        used += n
    kv_cache = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen)
    total_q = sum(query_lens)
    q = torch.randn((total_q, num_heads, head_dim), generator=gen)
    k = torch.randn((total_q, num_kv_heads, head_dim), generator=gen)
    v = torch.randn((total_q, num_kv_heads, head_dim), generator=gen)
    slots = []
    for i, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        for p in range(cl, cl + ql):
            slots.append(int(block_tables[i, p // block_size]) * block_size + p % block_size)
    qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(query_lens), 0)), dtype=torch.int32)
    to = dict(device=DEVICE)
    return dict(
        q=q.to(dtype).to(**to), k=k.to(dtype).to(**to), v=v.to(dtype).to(**to),
        kv_cache=kv_cache.to(dtype).to(**to), block_tables=block_tables.to(**to),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=qsl.to(**to), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **to),
        query_lens=query_lens, context_lens=context_lens, block_size=block_size)


def reference(case, scale, window=None, soft_cap=None, sinks=None, alibi=None, chunk=None):
    """float64 attention of each request's queries over its (cache + new) context; with
    a window W, query at position p sees keys p - W < k <= p only; with soft_cap C,
    scores become C * tanh(score / C); with sinks [H], each head's softmax has one more
    logit that weighs nothing (transformers' gpt-oss); with alibi slopes [H], head h's
    score of key k for the query at p gets slope_h * k added (transformers' BLOOM: the
    query's own term cancels in the softmax); with chunk C, the query at p sees keys
    floor(p / C) * C <= k <= p only (Llama 4's chunked attention)."""
    q, kv = case["q"].double(), case["kv_cache"].double().clone()
    bs = case["block_size"]
    flat_k = kv[0].reshape(-1, *kv.shape[3:])
    flat_v = kv[1].reshape(-1, *kv.shape[3:])
    flat_k[case["slot_mapping"]] = case["k"].double()
    flat_v[case["slot_mapping"]] = case["v"].double()
    outs, start = [], 0
    gqa = q.shape[1] // flat_k.shape[1]
    for i, (ql, cl) in enumerate(zip(case["query_lens"], case["context_lens"])):
        seq = ql + cl
        pos = torch.arange(seq, device=DEVICE)
        slots = case["block_tables"][i, pos // bs].long() * bs + pos % bs
        keys = flat_k[slots].repeat_interleave(gqa, 1)  # [S, H, D]
        values = flat_v[slots].repeat_interleave(gqa, 1)
        qi = q[start:start + ql]  # [Q, H, D]
        scores = torch.einsum("qhd,shd->hqs", qi, keys) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if alibi is not None:
            scores = scores + alibi.double().view(-1, 1, 1) * pos.double()
        query_pos = (cl + torch.arange(ql, device=DEVICE))[:, None]
        visible = pos[None, :] <= query_pos
        if window is not None:
            visible &= pos[None, :] > query_pos - window
        if chunk is not None:
            visible &= pos[None, :] >= query_pos // chunk * chunk
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is None:
            weights = scores.softmax(-1)
        else:
            sink = sinks.double().view(-1, 1, 1).expand(-1, ql, 1)
            weights = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        outs.append(torch.einsum("hqs,shd->qhd", weights, values))
        start += ql
    return torch.cat(outs), flat_k, flat_v


def meta_for(case):
    from spindle.attention.metadata import AttentionMetadata

    return AttentionMetadata(
        num_reqs=len(case["query_lens"]), num_tokens=case["q"].shape[0],
        query_start_loc=case["query_start_loc"], seq_lens=case["seq_lens"],
        block_tables=case["block_tables"], slot_mapping=case["slot_mapping"],
        max_query_len=max(case["query_lens"]),
        max_seq_len=max(q + c for q, c in zip(case["query_lens"], case["context_lens"])))


def poison_blocks_before_window(case, window, chunk=None) -> int:
    """Point every block-table entry of a block wholly before its request's window (the
    window of the request's first new token; with chunk, the start of its chunk) at an
    added NaN-filled block, as stale entries of freed blocks may point anywhere.
    Returns how many entries were poisoned. Call after reference()."""
    kv = case["kv_cache"]
    nan_block = kv.shape[1]
    case["kv_cache"] = torch.cat([kv, torch.full_like(kv[:, :1], float("nan"))], dim=1)
    poisoned = 0
    for i, context_len in enumerate(case["context_lens"]):
        first = (context_len // chunk * chunk if chunk is not None
                 else max(0, context_len - window + 1))
        stale = first // case["block_size"]
        case["block_tables"][i, :stale] = nan_block
        poisoned += stale
    return poisoned


def run_backend(case, num_heads, num_kv_heads, head_dim, window=None, ordered=False,
                sinks=None, chunked=False):
    """What the backend does for one step without a q/k transform: decode (one launch
    that stores k/v and attends) or store + prefill. ordered: decode starts the
    requests longest first (meta.decode_order), as the runner has it on a GPU."""
    from spindle.attention.backends.triton_attn import (decode_attention, prefill_attention,
                                                        split_counters, store_kv)
    from spindle.attention.metadata import decode_order

    scale = head_dim ** -0.5
    meta = meta_for(case)
    if ordered:
        order = decode_order(case["seq_lens"].cpu().numpy())
        meta.decode_order = torch.from_numpy(order).to(DEVICE)
    out = torch.full_like(case["q"], float("nan"))  # poisoned: every row must be written
    if meta.max_query_len == 1:
        counters = split_counters(DEVICE)
        decode_attention(case["q"], case["k"], case["v"], case["kv_cache"], meta, scale, out,
                         counters, sliding_window=window, sinks=sinks, chunked=chunked)
        assert not counters.any(), "the last split must leave its counter at zero"
    else:
        store_kv(case["k"], case["v"], case["kv_cache"], case["slot_mapping"])
        prefill_attention(case["q"], case["kv_cache"], meta, scale, out, sliding_window=window,
                          sinks=sinks, chunked=chunked)
    return out, scale


SHAPES = pick(  # (num_heads, num_kv_heads, head_dim): GQA 1, 2, 4, 8
    [(8, 8, 64), (16, 8, 128), (16, 4, 128), (32, 4, 64), (8, 1, 128)],
    [(4, 4, 64), (4, 1, 128)])
# (query_lens, context_lens): context = prefix hits / earlier chunks. Prefill tiles
# hold 64 queries when a request has more than 32, else 16.
PREFILL_LENGTHS = pick(
    [([1, 7, 64, 130, 33, 1, 250], [0, 40, 0, 17, 300, 5, 64])],
    [([1, 7, 70, 20], [0, 40, 17, 100]),  # 64-query tiles, the 70's second one part-full
     ([1, 20, 3], [30, 0, 90])])  # 16-query tiles


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lens,context_lens", PREFILL_LENGTHS)
def test_prefill_with_prefix_hits_and_ragged_lengths(num_heads, num_kv_heads, head_dim,
                                                     block_size, dtype, query_lens,
                                                     context_lens):
    seed = hash((num_heads, num_kv_heads, head_dim, block_size, str(dtype))) % 10_000
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed)
    out, scale = run_backend(case, num_heads, num_kv_heads, head_dim)
    ref, flat_k, flat_v = reference(case, scale)
    assert not out.isnan().any(), "some output rows were never written"
    assert rel_err(out, ref) < REL_TOL[dtype]
    # store_kv wrote exactly this step's slots.
    cache_k = case["kv_cache"][0].reshape(-1, num_kv_heads, head_dim)
    assert torch.equal(cache_k[case["slot_mapping"]], case["k"])


# (num_heads, num_kv_heads, head_dim, block_size, batch). On a GPU every combination;
# under the interpreter (32 programs planned) each split count from 32 down to 1, and
# each GQA ratio and block size. Both: heads of 16 and 32 features (the per-head
# kernel's narrowest halves).
NARROW_HEAD_CASES = [(4, 2, 16, 16, 2), (4, 2, 32, 8, 1)]
DECODE_CASES = pick(
    [(*shape, block_size, batch) for shape, block_size, batch
     in itertools.product(SHAPES, [16, 32], [1, 3, 64])],
    [(8, 1, 64, 16, 1),  # 32 splits
     (8, 2, 128, 32, 1),  # 16
     (4, 4, 64, 16, 1), (8, 2, 128, 16, 3),  # 8
     (8, 1, 64, 32, 8),  # 4
     (8, 2, 128, 16, 9),  # 2
     (4, 4, 64, 32, 9)]) + NARROW_HEAD_CASES  # 1: no merge


@pytest.mark.parametrize("kernel,num_heads,num_kv_heads,head_dim,block_size,batch",
                         with_kernels(DECODE_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ordered", [False, True], ids=["batch_order", "longest_first"])
def test_decode_split_context(monkeypatch, kernel, num_heads, num_kv_heads, head_dim,
                              block_size, dtype, batch, ordered):
    use_decode_kernel(monkeypatch, kernel)
    gen = torch.Generator().manual_seed(batch * 31 + head_dim + block_size)
    context_lens = torch.randint(0, MAX_CONTEXT, (batch,), generator=gen).tolist()
    context_lens[0] = 0  # a context of just the new token
    case = make_case([1] * batch, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=batch + head_dim)
    out, scale = run_backend(case, num_heads, num_kv_heads, head_dim, ordered=ordered)
    ref, _, _ = reference(case, scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]


# Mixed steps: single-token requests (decodes, and a prompt's last token after a
# prefix hit) among prompt chunks, in batch order; the longest context past 32 splits'
# reach. (Four single-token requests or fewer take the per-head kernel in these tests.)
MIXED_STEPS = pick(
    [([1, 40, 1, 1, 7, 1], [300, 0, 1500, 64, 20, 2000]), ([70, 1], [0, 900]),
     ([1, 1, 3, 1, 1, 1, 1, 1, 1, 1], [5, 800, 30, 0, 77, 1200, 16, 300, 2, 640])],
    [([1, 30, 1, 1, 7, 1], [120, 0, 250, 64, 20, 9]), ([20, 1], [0, 100]),
     ([1, 1, 3, 1, 1, 1, 1, 1, 1, 1], [5, 90, 30, 0, 77, 150, 16, 40, 2, 64])])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lens,context_lens", MIXED_STEPS)
@pytest.mark.parametrize("window", [None, 37])
def test_mixed_step_single_token_requests_by_the_decode_kernel(monkeypatch, kernel, dtype,
                                                               query_lens, context_lens,
                                                               window):
    """A mixed step split between the kernels: the prefill kernel given the requests of
    more than one token writes their rows and leaves the single-token requests' rows
    alone; decode_attention given those (longest first) writes theirs, each at its query
    start, and leaves its split counters at zero. Both against the reference."""
    from spindle.attention.backends.triton_attn import (decode_attention, prefill_attention,
                                                        split_counters, store_kv)

    use_decode_kernel(monkeypatch, kernel)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=len(query_lens) + (window or 0))
    scale = head_dim ** -0.5
    ref, _, _ = reference(case, scale, window)
    meta = meta_for(case)
    starts = case["query_start_loc"].tolist()
    singles = sorted((i for i, n in enumerate(query_lens) if n == 1),
                     key=lambda i: -(query_lens[i] + context_lens[i]))
    single_rows = [starts[i] for i in singles]
    multi = [i for i, n in enumerate(query_lens) if n > 1]
    store_kv(case["k"], case["v"], case["kv_cache"], case["slot_mapping"])
    out = torch.full_like(case["q"], float("nan"))
    prefill_attention(case["q"], case["kv_cache"], meta, scale, out, sliding_window=window,
                      requests=torch.tensor(multi, dtype=torch.int32, device=DEVICE))
    assert out[single_rows].isnan().all(), "the prefill kernel wrote a single token's row"
    others = [r for r in range(out.shape[0]) if r not in single_rows]
    assert rel_err(out[others], ref[others]) < REL_TOL[dtype]
    counters = split_counters(DEVICE)
    decode_attention(case["q"], case["k"], case["v"], case["kv_cache"], meta, scale, out,
                     counters, sliding_window=window,
                     requests=torch.tensor(singles, dtype=torch.int32, device=DEVICE))
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert not counters.any(), "the last split must leave its counter at zero"


def test_store_kv_skips_negative_slots():
    from spindle.attention.backends.triton_attn import store_kv

    cache = torch.randn((2, 4, 16, 2, 64), device=DEVICE)
    before = cache.clone()
    k = torch.randn((3, 2, 64), device=DEVICE)
    slots = torch.tensor([5, -1, 17], device=DEVICE)
    store_kv(k, k, cache, slots)
    flat = cache[0].reshape(-1, 2, 64)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[17], k[2])
    flat[5], flat[17] = before[0].reshape(-1, 2, 64)[5], before[0].reshape(-1, 2, 64)[17]
    assert torch.equal(cache[0], before[0])


@pytest.mark.parametrize("source", ["argument", "environment"])
@pytest.mark.parametrize("tiles", [(16, 4, 1), (32, 2, 3), (128, 8, 2)])
def test_decode_tiles_knob_keeps_the_result(monkeypatch, tiles, source):
    """decode_attention's tiles (the per-KV-head kernel's BLOCK_N, warps, stages; a
    measuring knob for benchmarks/decode_attention.py, or SPINDLE_DECODE_TILES for the
    engine's launches) change how the context is walked, not the result."""
    from spindle.attention.backends import triton_attn
    from spindle.attention.backends.triton_attn import decode_attention, split_counters

    use_decode_kernel(monkeypatch, "per_kv_head")
    if source == "environment":
        monkeypatch.setattr(triton_attn, "_ENV_TILES", tiles)
    gen = torch.Generator().manual_seed(sum(tiles))
    context_lens = torch.randint(1, MAX_CONTEXT, (6,), generator=gen).tolist()
    case = make_case([1] * 6, context_lens, 8, 2, 64, 16, torch.float32, seed=sum(tiles))
    out, counters = torch.full_like(case["q"], float("nan")), split_counters(DEVICE)
    decode_attention(case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case), 0.125,
                     out, counters, tiles=tiles if source == "argument" else None)
    ref, _, _ = reference(case, 0.125)
    assert rel_err(out, ref) < REL_TOL[torch.float32]
    assert not counters.any()


@pytest.mark.parametrize("tiles", [(48, 4, 2), (8, 4, 2), (64, 3, 2), (64, 4, 0)])
def test_decode_tiles_knob_rejects_what_cannot_launch(monkeypatch, tiles):
    from spindle.attention.backends.triton_attn import decode_attention, split_counters

    use_decode_kernel(monkeypatch, "per_kv_head")
    case = make_case([1] * 6, [5] * 6, 8, 2, 64, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="decode tiles"):
        decode_attention(case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case),
                         0.125, torch.empty_like(case["q"]), split_counters(DEVICE),
                         tiles=tiles)


def test_decode_tiles_from_the_environment_reach_the_per_kv_head_kernel(monkeypatch):
    """SPINDLE_DECODE_TILES: unset or empty is the tuned tiles; BLOCK_NxWARPSxSTAGES is
    parsed and checked, naming the variable; the engine's per-KV-head launches take it
    (tiles that cannot launch then fail there), per-head launches do not."""
    from spindle.attention.backends import triton_attn
    from spindle.attention.backends.triton_attn import (TILES_ENV, decode_attention,
                                                        env_tiles, split_counters)

    assert env_tiles({}) is None and env_tiles({TILES_ENV: ""}) is None
    assert env_tiles({TILES_ENV: "64x4x3"}) == (64, 4, 3)
    for bad in ("64x4", "big", "48x4x2", "64x3x2", "64x4x0", "-64x4x2"):
        with pytest.raises(ValueError, match=f"{TILES_ENV}: decode tiles"):
            env_tiles({TILES_ENV: bad})
    monkeypatch.setattr(triton_attn, "_ENV_TILES", (48, 4, 2))  # (as if unchecked)
    for kernel, lens in (("per_head", [5, 9]), ("per_kv_head", [5] * 6)):
        use_decode_kernel(monkeypatch, kernel)
        case = make_case([1] * len(lens), lens, 8, 2, 64, 16, torch.float32, seed=1)
        args = (case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case), 0.125,
                torch.empty_like(case["q"]), split_counters(DEVICE))
        if kernel == "per_kv_head":
            with pytest.raises(ValueError, match="BLOCK_N must be a power of two"):
                decode_attention(*args)
        else:
            decode_attention(*args)


def test_default_decode_tiles_by_programs_and_heads(monkeypatch):
    """The per-KV-head kernel's tiles: 32 keys in two warps from 1,025 (request, KV
    head) pairs, 64 keys in four below and for a mixed step's requests, three stages
    for heads of up to 128 dims; wider heads keep 64x4x2. decode_attention launches
    with them unless told other tiles."""
    from spindle.attention.backends import triton_attn
    from spindle.attention.backends.triton_attn import (decode_attention,
                                                        default_decode_tiles, split_counters)

    assert default_decode_tiles(129, 8, 128) == (32, 2, 3)
    assert default_decode_tiles(1025, 1, 64) == (32, 2, 3)
    assert default_decode_tiles(128, 8, 128) == (64, 4, 3)
    assert default_decode_tiles(256, 8, 128, mixed=True) == (64, 4, 3)
    assert default_decode_tiles(256, 8, 256) == (64, 4, 2)
    use_decode_kernel(monkeypatch, "per_kv_head")
    monkeypatch.setattr(triton_attn, "_ENV_TILES", None)
    seen = []

    def fake_tiles(*args, **kwargs):
        seen.append((args, kwargs))
        return (48, 4, 3)  # (cannot launch: shows the launch took these)

    monkeypatch.setattr(triton_attn, "default_decode_tiles", fake_tiles)
    case = make_case([1] * 6, [5] * 6, 8, 2, 64, 16, torch.float32, seed=1)
    # (A mixed step's single-token requests: here every row of the decode case.)
    for requests in (None, torch.arange(6, dtype=torch.int32, device=DEVICE)):
        with pytest.raises(ValueError, match="BLOCK_N must be a power of two"):
            decode_attention(case["q"], case["k"], case["v"], case["kv_cache"],
                             meta_for(case), 0.125, torch.empty_like(case["q"]),
                             split_counters(DEVICE), requests=requests)
    assert seen == [((6, 2, 64), {"mixed": False}), ((6, 2, 64), {"mixed": True})]


def test_default_prefill_tiles_by_query_tile_and_heads(monkeypatch):
    """The prefill kernel's tiles: 32 keys, 4 warps, 3 stages for 64-query tiles of
    heads up to 128 dims; 64 keys at 2 stages for 16-query tiles and heads of 129-256
    dims; 16 keys past 256. prefill_attention launches with them where not told others."""
    from spindle.attention.backends import triton_attn
    from spindle.attention.backends.triton_attn import default_prefill_tiles, prefill_attention

    assert default_prefill_tiles(64, 128) == (32, 4, 3)
    assert default_prefill_tiles(64, 64) == (32, 4, 3)
    assert default_prefill_tiles(16, 128) == (64, 4, 2)
    assert default_prefill_tiles(64, 256) == (64, 4, 2)
    assert default_prefill_tiles(16, 576) == (16, 4, 2)
    stub = KernelStub()  # (records each launch's tiles instead of running it)
    monkeypatch.setattr(triton_attn, "_prefill_kernel", stub)
    case = make_case([40, 3], [5, 9], 8, 2, 64, 16, torch.float32, seed=1)
    out = torch.empty_like(case["q"])
    prefill_attention(case["q"], case["kv_cache"], meta_for(case), 0.125, out)
    prefill_attention(case["q"], case["kv_cache"], meta_for(case), 0.125, out, block_m=16)
    prefill_attention(case["q"], case["kv_cache"], meta_for(case), 0.125, out, block_n=64,
                      num_stages=2)
    tiles = [tuple(kw[name] for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
             for _, kw in stub.launches]
    assert tiles == [(64, 32, 4, 3), (16, 64, 4, 2), (64, 64, 4, 2)]


@pytest.mark.parametrize("value, expected", [("64x4x3", "(64, 4, 3)"),
                                             ("64x4", "SPINDLE_DECODE_TILES: decode tiles")])
def test_decode_tiles_are_read_when_the_backend_is_imported(value, expected):
    """The variable as a user sets it, before the process imports the backend: its
    tiles, or its error naming it."""
    script = ("from spindle.attention.backends import triton_attn\n"
              "print(triton_attn._ENV_TILES)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "SPINDLE_DECODE_TILES": value}, timeout=120)
    assert expected in (done.stdout if done.returncode == 0 else done.stderr), done.stderr


def test_decode_tiles_knob_refuses_the_per_head_kernel(monkeypatch):
    """Tiles that the step's kernel would not use are an error, not a silent no-op."""
    from spindle.attention.backends.triton_attn import decode_attention, split_counters

    use_decode_kernel(monkeypatch, "per_head")
    case = make_case([1, 1], [5, 9], 8, 2, 64, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="per-head kernel"):
        decode_attention(case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case),
                         0.125, torch.empty_like(case["q"]), split_counters(DEVICE),
                         tiles=(64, 4, 2))


def test_decode_padding_rows_are_zero():
    """CUDA-graph padding rows have seq_len 0 and slot -1: finite zeros, never NaN,
    and the cache is not touched for them."""
    from spindle.attention.backends.triton_attn import decode_attention, split_counters

    case = make_case([1, 1, 1], [10, 0, 300], 8, 2, 64, 16, torch.float32, seed=3)
    case["seq_lens"][1] = 0
    case["slot_mapping"][1] = -1
    before = case["kv_cache"].clone()
    out = torch.full_like(case["q"], float("nan"))
    decode_attention(case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case), 0.125,
                     out, split_counters(DEVICE))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert not out.isnan().any()
    flat = case["kv_cache"].reshape(2, -1, 2, 64)
    real = case["slot_mapping"][[0, 2]]
    flat_before = before.reshape(2, -1, 2, 64)
    flat_before[0, real], flat_before[1, real] = case["k"][[0, 2]], case["v"][[0, 2]]
    assert torch.equal(flat, flat_before), "only the real tokens' slots may change"


def _qwen3_like_transform(positions, head_dim, with_norm, gen):
    from spindle.layers.rotary import QKNormRope
    from spindle.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    weights = [torch.randn(head_dim, generator=gen) for _ in range(2)] if with_norm else [None] * 2
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return QKNormRope(positions.to(DEVICE), to(rope.cos_cache), to(rope.sin_cache),
                      to(weights[0]), to(weights[1]), 1e-6), rope


def _transformed_reference_case(case, transform, rope, dtype):
    """The case with q and k normalised and rotated by the plain-torch layers."""
    from spindle.layers.rotary import apply_rotary

    def norm(x, w):
        if w is None:
            return x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + transform.eps)
        return w.to(dtype) * h.to(dtype)

    cos, sin = rope(transform.positions.cpu(), dtype)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    ref = dict(case)
    ref["q"] = apply_rotary(norm(case["q"].cpu(), cpu(transform.q_weight)), cos, sin).to(DEVICE)
    ref["k"] = apply_rotary(norm(case["k"].cpu(), cpu(transform.k_weight)), cos, sin).to(DEVICE)
    return ref


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         pick([(16, 8, 128), (8, 2, 64)], [(8, 2, 64)]))
@pytest.mark.parametrize("kernel,block_size,batch", with_kernels(pick(
    list(itertools.product([16, 32], [1, 2, 8, 40])),
    [(16, 1), (16, 2), (32, 8), (16, 17)])))  # 16 splits, 8, 2, 1 (see DECODE_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_fused_decode_with_qk_norm_rope(monkeypatch, kernel, num_heads, num_kv_heads, head_dim,
                                        block_size, dtype, batch, with_norm):
    """The backend's decode path with a QKNormRope: one launch normalises and rotates q
    and k, stores k and v (padding slots skipped), attends and merges the splits."""
    from spindle.attention.backends.triton_attn import TritonAttentionBackend

    use_decode_kernel(monkeypatch, kernel)

    gen = torch.Generator().manual_seed(batch * 7 + head_dim + block_size + with_norm)
    context_lens = torch.randint(100, MAX_CONTEXT, (batch,), generator=gen).tolist()
    context_lens[0] = 0  # a context of just the new token
    if batch > 2:
        context_lens[1] = 64  # the new token is alone in its split (at batch 8)
    case = make_case([1] * batch, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=batch + head_dim + block_size)
    positions = torch.tensor(context_lens)
    transform, rope = _qwen3_like_transform(positions, head_dim, with_norm, gen)
    ref_case = _transformed_reference_case(case, transform, rope, dtype)
    ref, _, _ = reference(ref_case, head_dim ** -0.5)
    ref_k = ref_case["k"].clone()
    padding = batch - 1 if batch > 1 else None
    if padding is not None:  # a CUDA-graph padding row
        case["slot_mapping"][padding] = -1
        case["seq_lens"][padding] = 0
    kv_before = case["kv_cache"].clone()
    backend = TritonAttentionBackend(num_heads, head_dim, head_dim ** -0.5, num_kv_heads)
    q_raw, k_raw = case["q"].clone(), case["k"].clone()
    for _ in range(2):  # twice: the split counters must be ready for the next launch
        case["kv_cache"].copy_(kv_before)
        out = backend.forward(case["q"], case["k"], case["v"], case["kv_cache"],
                              meta_for(case), qk_transform=transform)
    assert torch.equal(case["q"], q_raw) and torch.equal(case["k"], k_raw)

    real = [i for i in range(batch) if i != padding]
    assert not out.isnan().any()
    assert rel_err(out[real], ref[real]) < REL_TOL[dtype]
    if padding is not None:
        assert torch.equal(out[padding], torch.zeros_like(out[padding]))
    # The cache: the real tokens' rotated k and their v at their slots, nothing else.
    cache_k = case["kv_cache"][0].reshape(-1, num_kv_heads, head_dim)
    cache_v = case["kv_cache"][1].reshape(-1, num_kv_heads, head_dim)
    slots = case["slot_mapping"][real]
    assert rel_err(cache_k[slots], ref_k[real].double()) < REL_TOL[dtype]
    assert torch.equal(cache_v[slots], case["v"][real])
    untouched = torch.ones(cache_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    before = kv_before.reshape(2, -1, num_kv_heads, head_dim)
    assert torch.equal(cache_k[untouched], before[0, untouched])
    assert torch.equal(cache_v[untouched], before[1, untouched])


def _qwen3_like_step(query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype,
                     seed, transform_seed):
    """A step's case (16-token pages) with Qwen3's q/k norm and rotary still to apply:
    (case, the QKNormRope, the case with it applied, the float64 reference output)."""
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype,
                     seed=seed)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    transform, rope = _qwen3_like_transform(positions, head_dim, True,
                                            torch.Generator().manual_seed(transform_seed))
    ref_case = _transformed_reference_case(case, transform, rope, dtype)
    ref, _, _ = reference(ref_case, head_dim ** -0.5)
    return case, transform, ref_case, ref


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         pick([(16, 8, 128), (8, 1, 64)], [(8, 4, 128), (8, 1, 64)]))
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_fused_qk_norm_rope_store(num_heads, num_kv_heads, head_dim, dtype):
    """Prefill through the backend with a QKNormRope: the rotary kernel stores k/v."""
    from spindle.attention.backends.triton_attn import TritonAttentionBackend

    query_lens, context_lens = pick([5, 1, 70], [5, 1, 40]), [0, 33, 16]
    case, transform, ref_case, ref = _qwen3_like_step(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype, seed=11,
        transform_seed=head_dim + num_kv_heads)
    backend = TritonAttentionBackend(num_heads, head_dim, head_dim ** -0.5, num_kv_heads)
    out = backend.forward(case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case),
                          qk_transform=transform)
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]
    cache_k = case["kv_cache"][0].reshape(-1, num_kv_heads, head_dim)
    assert rel_err(cache_k[case["slot_mapping"]], ref_case["k"].double()) < REL_TOL[dtype]


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same cache values in pages that keep each KV head's tokens together, as the
    engine allocates and views them (AttentionCacheSpec with head_major): [2, blocks,
    kv heads, block_size, D], seen as [2, blocks, block_size, kv heads, D]."""
    from spindle.cache.spec import AttentionCacheSpec

    _, _, _, kv_heads, head_dim = cache.shape
    spec = AttentionCacheSpec(kv_heads, head_dim, cache.dtype, head_major=True)
    view = spec.pages_holding(cache)
    assert view.stride(3) == view.shape[2] * view.shape[4] and view.stride(2) == view.shape[4]
    return view


def _both_layouts(case):
    """(the case, a copy whose cache holds the same values in head-major pages)."""
    return case, {**case, "kv_cache": head_major(case["kv_cache"]),
                  "q": case["q"].clone(), "k": case["k"].clone()}


# (kernel, num_heads, num_kv_heads, head_dim, block_size, batch, lengths or None); more
# than one KV head each (with one, both layouts are the same).
HEAD_MAJOR_CASES = [("prefill", 8, 2, 64, 16, None, ([1, 7, 70, 20], [0, 40, 17, 100])),
                    ("prefill", 4, 2, 128, 32, None, ([1, 20, 3], [30, 0, 90])),
                    ("per_head", 8, 2, 128, 16, 3, None),
                    ("per_kv_head", 8, 2, 128, 16, 3, None),
                    ("per_kv_head", 8, 4, 64, 32, 9, None)]


@pytest.mark.parametrize("kernel,num_heads,num_kv_heads,head_dim,block_size,batch,lengths",
                         HEAD_MAJOR_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_major_pages(monkeypatch, kernel, num_heads, num_kv_heads, head_dim, block_size,
                          batch, lengths, dtype):
    """Pages allocated heads first (SPINDLE_KV_HEAD_MAJOR=1), seen through their
    strides: store + prefill, and decode in both kernels, give the reference's output,
    the very output and cache of token-major pages, and write the new keys and values
    in the head-major pages (their strides unchanged)."""
    if kernel == "prefill":
        query_lens, context_lens = lengths
    else:
        use_decode_kernel(monkeypatch, kernel)
        query_lens = [1] * batch
        gen = torch.Generator().manual_seed(batch + head_dim)
        context_lens = torch.randint(0, MAX_CONTEXT, (batch,), generator=gen).tolist()
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=block_size + head_dim)
    token_case, head_case = _both_layouts(case)
    strides = head_case["kv_cache"].stride()
    out, scale = run_backend(head_case, num_heads, num_kv_heads, head_dim)
    ref, flat_k, flat_v = reference(head_case, scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]
    token_out, _ = run_backend(token_case, num_heads, num_kv_heads, head_dim)
    assert torch.equal(out, token_out)
    assert head_case["kv_cache"].stride() == strides
    assert torch.equal(head_case["kv_cache"], token_case["kv_cache"])
    assert torch.equal(head_case["kv_cache"][0].reshape(flat_k.shape)[case["slot_mapping"]],
                       case["k"])


@pytest.mark.parametrize("query_lens,context_lens", [([5, 1, 40], [0, 33, 16]),
                                                    ([1, 1, 1], [0, 150, 64])])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_major_pages_with_the_fused_qk_norm_rope(query_lens, context_lens, dtype):
    """The backend with Qwen3's q/k norm + rotary, on head-major pages: the prefill
    path's rotary kernel and the decode kernel store the rotated keys where token-major
    pages would hold them, and attend as the reference does."""
    from spindle.attention.backends.triton_attn import TritonAttentionBackend

    num_heads, num_kv_heads, head_dim = 8, 2, 128
    case, transform, ref_case, ref = _qwen3_like_step(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype, seed=5,
        transform_seed=3)
    backend = TritonAttentionBackend(num_heads, head_dim, head_dim ** -0.5, num_kv_heads)
    token_case, head_case = _both_layouts(case)
    outs = [backend.forward(c["q"], c["k"], c["v"], c["kv_cache"], meta_for(c),
                            qk_transform=transform) for c in (head_case, token_case)]
    assert not outs[0].isnan().any()
    assert rel_err(outs[0], ref) < REL_TOL[dtype]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(head_case["kv_cache"], token_case["kv_cache"])
    cache_k = head_case["kv_cache"][0].reshape(-1, num_kv_heads, head_dim)
    assert rel_err(cache_k[case["slot_mapping"]], ref_case["k"].double()) < REL_TOL[dtype]


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU: test_cuda_e2e.py's head-major case")
@pytest.mark.parametrize("arch,block_size", [("qwen3", 16), ("bloom", 16), ("gemma2", 16),
                                             ("qwen3", 32)])
def test_engine_on_head_major_pages_matches_transformers(tiny_model, monkeypatch, arch,
                                                         block_size):
    """The engine on the Triton backend (interpreted) with SPINDLE_KV_HEAD_MAJOR=1
    allocates head-major pages, and its float32 greedy tokens and logprobs equal
    transformers' through chunked prefill and decode (Qwen3's fused q/k norm + rotary,
    BLOOM's ALiBi with the separate KV store, Gemma 2's soft cap and window), on 16-
    and 32-token pages."""
    from spindle import LLM, SamplingParams
    from test_generate_vs_hf import hf_greedy

    monkeypatch.setenv("SPINDLE_KV_HEAD_MAJOR", "1")
    path = tiny_model(arch=arch)
    prompts = [[(7 * i + 3) % 500 for i in range(n)] for n in (1, 9, 40)]
    expected = hf_greedy(path, prompts, 6, attn_implementation="eager")
    with LLM(str(path), dtype="float32", device="cpu", attention_backend="triton",
             max_model_len=128, max_num_batched_tokens=16, block_size=block_size) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6,
                                                    ignore_eos=True, logprobs=0),
                            use_tqdm=False)
        runner = llm.engine.core.executor.worker.runner
        assert runner.cache_layout.attention_page.head_major
        assert runner.kv_caches[0].shape[2:4] == (runner.cache_layout.attention_page.num_kv_heads,
                                                  block_size)
    for out, (tokens, logprobs) in zip(outs, expected):
        assert out.outputs[0].token_ids == tokens
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < 1e-4


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("batch", [1, 8])
def test_fused_decode_graph_replays_with_new_lengths(batch):
    """One captured decode launch, replayed with new sequence lengths, slots and caches:
    the split counters must be back at zero after every replay, or later replays go
    wrong. (A race in the last-split merge would show as a moving error here.)"""
    from spindle.attention.backends.triton_attn import TritonAttentionBackend

    num_heads, num_kv_heads, head_dim, block_size = 16, 8, 128, 16
    dtype, scale = torch.bfloat16, head_dim ** -0.5
    gen = torch.Generator().manual_seed(batch)
    backend = TritonAttentionBackend(num_heads, head_dim, scale, num_kv_heads)
    # Static buffers, as the CUDA-graph runner keeps them, sized for the longest context.
    static = make_case([1] * batch, [2000] * batch, num_heads, num_kv_heads, head_dim,
                       block_size, dtype, seed=0)
    positions = torch.zeros(batch, dtype=torch.int64, device=DEVICE)
    transform, rope = _qwen3_like_transform(positions, head_dim, True, gen)
    meta = meta_for(static)
    run = lambda: backend.forward(static["q"], static["k"], static["v"],  # noqa: E731
                                  static["kv_cache"], meta, qk_transform=transform)
    run()  # eager first: compiles, allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for replay in range(6):
        context_lens = torch.randint(0, 2000, (batch,), generator=gen).tolist()
        case = make_case([1] * batch, context_lens, num_heads, num_kv_heads, head_dim,
                         block_size, dtype, seed=100 + replay)
        positions.copy_(torch.tensor(context_lens))
        ref, _, _ = reference(_transformed_reference_case(case, transform, rope, dtype), scale)
        for name in ("q", "k", "v", "slot_mapping", "seq_lens"):
            static[name].copy_(case[name])
        static["kv_cache"][:, :case["kv_cache"].shape[1]].copy_(case["kv_cache"])
        static["block_tables"].zero_()
        static["block_tables"][:, :case["block_tables"].shape[1]].copy_(case["block_tables"])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert rel_err(out, ref) < REL_TOL[dtype], f"replay {replay}"
    assert not backend._counters.any()


# ---------------------------------------------------------------------- sliding window
# (query_lens, context_lens, window): windows below one key tile, across tiles, of 1
# (a token sees itself only), and longer than some contexts. Prefill query tiles hold
# 64 queries when a request has more than 32 (the 70's second tile starts its keys
# 64 positions later than its first), else 16.
WINDOW_PREFILL = pick(
    [([1, 7, 64, 130, 33, 1, 250], [0, 40, 0, 17, 300, 5, 64], w) for w in (1, 13, 100, 260)],
    [([1, 7, 70, 20], [0, 40, 17, 100], 8),
     ([1, 7, 70, 20], [0, 40, 17, 100], 37),
     ([3, 20, 1], [90, 0, 64], 1)])


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lens,context_lens,window", WINDOW_PREFILL)
def test_prefill_sliding_window_reads_only_the_window(num_heads, num_kv_heads, head_dim,
                                                      block_size, dtype, query_lens,
                                                      context_lens, window):
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=window + block_size + head_dim)
    ref, _, _ = reference(case, head_dim ** -0.5, window)
    assert poison_blocks_before_window(case, window) > 0
    out, _ = run_backend(case, num_heads, num_kv_heads, head_dim, window)
    assert not out.isnan().any(), "a block before the window was read, or a row not written"
    assert rel_err(out, ref) < REL_TOL[dtype]


# (num_heads, num_kv_heads, head_dim, block_size, batch): split counts 32, 8 and 1 under
# the interpreter (see DECODE_CASES); windows shorter and longer than one split.
WINDOW_DECODE = pick(
    [(*shape, block_size, batch) for shape, block_size, batch
     in itertools.product(SHAPES, [8, 16], [1, 3, 64])],
    [(8, 1, 64, 16, 1), (8, 2, 128, 8, 3), (4, 4, 64, 16, 9)])


@pytest.mark.parametrize("kernel,num_heads,num_kv_heads,head_dim,block_size,batch",
                         with_kernels(WINDOW_DECODE))
@pytest.mark.parametrize("window", [1, 37, 150])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_sliding_window_reads_only_the_window(monkeypatch, kernel, num_heads,
                                                     num_kv_heads, head_dim, block_size, batch,
                                                     window, dtype):
    use_decode_kernel(monkeypatch, kernel)
    gen = torch.Generator().manual_seed(batch * 31 + window + block_size)
    context_lens = torch.randint(window, MAX_CONTEXT, (batch,), generator=gen).tolist()
    context_lens[0] = MAX_CONTEXT - 1  # the longest context: the most stale blocks
    if batch > 1:
        context_lens[1] = 0  # a context of just the new token
    case = make_case([1] * batch, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=batch + window)
    ref, _, _ = reference(case, head_dim ** -0.5, window)
    assert poison_blocks_before_window(case, window) > 0
    out, _ = run_backend(case, num_heads, num_kv_heads, head_dim, window)
    assert not out.isnan().any(), "a block before the window was read, or a row not written"
    assert rel_err(out, ref) < REL_TOL[dtype]


# A mixed step (decodes, a prefill after a long context, a first chunk longer than the
# window) and a pure decode step, through each backend's forward.
BACKEND_STEPS = [([1, 7, 70, 1, 20], [50, 40, 17, 0, 100]), ([1, 1, 1], [60, 5, 33])]


@pytest.mark.parametrize("query_lens,context_lens", pick(
    [([1, 7, 64, 130, 33, 1, 250], [0, 40, 0, 17, 300, 5, 64]), ([1] * 5, [0, 7, 64, 300, 999])],
    [([1, 7, 70, 20], [0, 40, 17, 100]), ([1] * 4, [0, 7, 64, 250])]))
@pytest.mark.parametrize("chunk", [1, 16, 37])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_attention_reads_only_the_chunk(query_lens, context_lens, chunk, dtype):
    """Llama 4's chunked attention in both kernels (prefill tiles across chunk starts,
    decode with and without context splits): each query sees its own chunk up to
    itself, and no block wholly before its request's first chunk start is read."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 8
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=chunk + len(query_lens))
    ref, _, _ = reference(case, head_dim ** -0.5, chunk=chunk)
    plain, _, _ = reference(case, head_dim ** -0.5)
    assert poison_blocks_before_window(case, chunk, chunk=chunk) > 0
    out, _ = run_backend(case, num_heads, num_kv_heads, head_dim, chunk, chunked=True)
    assert not out.isnan().any(), "a block before the chunk was read, or a row not written"
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert rel_err(out, plain) > 10 * REL_TOL[dtype]


@pytest.mark.parametrize("backend_name", ["triton", "torch_sdpa"])
@pytest.mark.parametrize("query_lens,context_lens", BACKEND_STEPS)
@pytest.mark.parametrize("chunk", [4, 16])
def test_backend_chunked_attention_step(monkeypatch, backend_name, query_lens, context_lens,
                                        chunk):
    """Backend.forward with attention_chunk_size (store + attend), blocks before each
    request's chunk poisoned; torch_sdpa's windowed prefill in small query chunks."""
    from spindle.attention.backends import torch_sdpa
    from spindle.attention.backends.registry import get_backend

    monkeypatch.setattr(torch_sdpa, "WINDOW_QUERY_CHUNK", 16)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 4
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     torch.float32, seed=chunk + len(query_lens))
    ref, _, _ = reference(case, head_dim ** -0.5, chunk=chunk)
    assert poison_blocks_before_window(case, chunk, chunk=chunk) > 0
    backend = get_backend(backend_name)(num_heads, head_dim, head_dim ** -0.5, num_kv_heads,
                                        attention_chunk_size=chunk)
    out = backend.forward(case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case))
    assert not out.isnan().any(), "a block before the chunk was read"
    assert rel_err(out, ref) < REL_TOL[torch.float32]


@pytest.mark.parametrize("backend_name", ["triton", "torch_sdpa"])
def test_backend_chunked_attention_without_cache(backend_name):
    """The cache-less forward (memory profiling) keeps to each query's chunk too."""
    from spindle.attention.backends.registry import get_backend

    num_heads, num_kv_heads, head_dim = 4, 2, 64
    case = make_case([30, 1, 50], [0, 0, 0], num_heads, num_kv_heads, head_dim, 16,
                     torch.float32, seed=5)
    ref, _, _ = reference(case, head_dim ** -0.5, chunk=8)
    backend = get_backend(backend_name)(num_heads, head_dim, head_dim ** -0.5, num_kv_heads,
                                        attention_chunk_size=8)
    out = backend.forward(case["q"], case["k"], case["v"], None, meta_for(case))
    assert rel_err(out, ref) < REL_TOL[torch.float32]


@pytest.mark.parametrize("backend_name", ["triton", "torch_sdpa"])
@pytest.mark.parametrize("query_lens,context_lens", BACKEND_STEPS)
@pytest.mark.parametrize("window", [1, 12])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_sliding_window_step(monkeypatch, backend_name, query_lens, context_lens,
                                     window, dtype):
    """Backend.forward with sliding_window (store + attend), stale blocks poisoned.
    torch_sdpa attends windowed prefill in query chunks: made small here, so that the
    70- and 20-token prefills cross several."""
    from spindle.attention.backends import torch_sdpa
    from spindle.attention.backends.registry import get_backend

    monkeypatch.setattr(torch_sdpa, "WINDOW_QUERY_CHUNK", 16)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 8
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=window + len(query_lens))
    ref, _, _ = reference(case, head_dim ** -0.5, window)
    assert poison_blocks_before_window(case, window) > 0
    backend = get_backend(backend_name)(num_heads, head_dim, head_dim ** -0.5, num_kv_heads,
                                        sliding_window=window)
    out = backend.forward(case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case))
    assert not out.isnan().any(), "a block before the window was read"
    assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("backend_name", ["triton", "torch_sdpa"])
@pytest.mark.parametrize("query_lens,context_lens", BACKEND_STEPS)
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_soft_cap_step(backend_name, query_lens, context_lens, window, dtype):
    """Backend.forward with Gemma 2's attention soft cap (prefill, split decode, with
    and without a window) against the capped reference; the uncapped one is further
    off than the tolerance, so the cap is seen to act."""
    from spindle.attention.backends.registry import get_backend

    num_heads, num_kv_heads, head_dim, block_size, cap = 8, 2, 64, 8, 5.0
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=len(query_lens) + (window or 0))
    case["q"] = case["q"] * 3  # scores of several times the cap
    ref, _, _ = reference(case, head_dim ** -0.5, window, soft_cap=cap)
    uncapped, _, _ = reference(case, head_dim ** -0.5, window)
    backend = get_backend(backend_name)(num_heads, head_dim, head_dim ** -0.5, num_kv_heads,
                                        sliding_window=window, logits_soft_cap=cap)
    out = backend.forward(case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case))
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert rel_err(out, uncapped) > 10 * REL_TOL[dtype]


@pytest.mark.parametrize("backend_name", ["triton", "torch_sdpa"])
@pytest.mark.parametrize("query_lens,context_lens", BACKEND_STEPS)
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_alibi_step(backend_name, query_lens, context_lens, window, dtype):
    """Backend.forward with ALiBi (BLOOM's slopes for 8 heads over 2 KV heads, so each
    KV head's query heads have different slopes; prefill after a context, split
    decode, with and without a window) against the reference; without the bias the
    reference is further off than the tolerance, so the slopes are seen to act."""
    from spindle.attention.alibi import bloom_slopes
    from spindle.attention.backends.registry import get_backend

    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 8
    slopes = bloom_slopes(num_heads).to(DEVICE)
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=len(query_lens) + (window or 0))
    ref, _, _ = reference(case, head_dim ** -0.5, window, alibi=slopes)
    plain, _, _ = reference(case, head_dim ** -0.5, window)
    backend = get_backend(backend_name)(num_heads, head_dim, head_dim ** -0.5, num_kv_heads,
                                        sliding_window=window, alibi_slopes=slopes)
    out = backend.forward(case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case))
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert rel_err(out, plain) > 10 * REL_TOL[dtype]


@pytest.mark.parametrize("backend_name", ["triton", "torch_sdpa"])
def test_backend_alibi_without_cache(backend_name):
    """The cache-less forward (memory profiling) adds ALiBi's bias too."""
    from spindle.attention.alibi import mpt_slopes
    from spindle.attention.backends.registry import get_backend

    num_heads, num_kv_heads, head_dim = 6, 6, 64
    slopes = mpt_slopes(num_heads).to(DEVICE)
    case = make_case([30, 1, 50], [0, 0, 0], num_heads, num_kv_heads, head_dim, 16,
                     torch.float32, seed=3)
    ref, _, _ = reference(case, head_dim ** -0.5, alibi=slopes)
    backend = get_backend(backend_name)(num_heads, head_dim, head_dim ** -0.5, num_kv_heads,
                                        alibi_slopes=slopes)
    out = backend.forward(case["q"], case["k"], case["v"], None, meta_for(case))
    assert rel_err(out, ref) < REL_TOL[torch.float32]


def test_batch_invariant_backend_refuses_alibi():
    from spindle.attention.alibi import bloom_slopes
    from spindle.attention.backends.batch_invariant import BatchInvariantBackend

    with pytest.raises(ValueError, match="ALiBi"):
        BatchInvariantBackend(4, 64, 0.125, 4, alibi_slopes=bloom_slopes(4))


@pytest.mark.parametrize("backend_name", ["triton", "torch_sdpa"])
@pytest.mark.parametrize("window", [1, 12, 100])
def test_backend_sliding_window_without_cache(monkeypatch, backend_name, window):
    """The cache-less forward (memory profiling) honours the window too: prompts
    attending among themselves equal the reference over an empty context."""
    from spindle.attention.backends import torch_sdpa
    from spindle.attention.backends.registry import get_backend

    monkeypatch.setattr(torch_sdpa, "WINDOW_QUERY_CHUNK", 16)
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    case = make_case([30, 1, 50], [0, 0, 0], num_heads, num_kv_heads, head_dim, 16,
                     torch.float32, seed=window)
    ref, _, _ = reference(case, head_dim ** -0.5, window)
    backend = get_backend(backend_name)(num_heads, head_dim, head_dim ** -0.5, num_kv_heads,
                                        sliding_window=window)
    out = backend.forward(case["q"], case["k"], case["v"], None, meta_for(case))
    assert rel_err(out, ref) < REL_TOL[torch.float32]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant_backend_equals_the_reference_and_decode_equals_prefill(
        num_heads, num_kv_heads, head_dim, dtype):
    """The batch-invariant backend (on a GPU the prefill kernel with (token, head) rows
    packed per KV head, for every step; without one its CPU path, which the
    interpreter cannot stand in for): a prefill step against the reference; then
    the same request's last query recomputed as a decode step (one token after its
    context) and inside another batch: the same bits as in the prefill."""
    from spindle.attention.backends.batch_invariant import BatchInvariantBackend

    backend = BatchInvariantBackend(num_heads, head_dim, head_dim ** -0.5, num_kv_heads)
    query_lens, context_lens = pick(([1, 40, 130, 7], [0, 17, 64, 300]),
                                    ([1, 20, 9], [0, 17, 40]))
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype,
                     seed=num_heads + head_dim)
    ref, _, _ = reference(case, head_dim ** -0.5)
    prefill = backend.forward(case["q"].clone(), case["k"], case["v"], case["kv_cache"],
                              meta_for(case))
    assert rel_err(prefill, ref) < REL_TOL[dtype]

    # Request 2's last query alone, as a decode step over the prefilled cache; then
    # inside a batch with request 1's last query in front of it.
    last = sum(query_lens[:3]) - 1
    for rows, reqs in (([last], [2]), ([sum(query_lens[:2]) - 1, last], [1, 2])):
        decode = dict(case, q=case["q"][rows], k=case["k"][rows], v=case["v"][rows],
                      kv_cache=case["kv_cache"], slot_mapping=case["slot_mapping"][rows],
                      block_tables=case["block_tables"][reqs],
                      query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32,
                                                   device=DEVICE),
                      seq_lens=case["seq_lens"][reqs], query_lens=[1] * len(rows),
                      context_lens=[query_lens[r] + context_lens[r] - 1 for r in reqs])
        out = backend.forward(decode["q"].clone(), decode["k"], decode["v"],
                              decode["kv_cache"], meta_for(decode))
        assert torch.equal(out[-1], prefill[last])


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_gqa_packed_rows(num_heads, num_kv_heads, head_dim, dtype):
    """prefill_attention(pack_gqa=True): tiles of (token, query head) rows of one KV
    head, against the reference, with ragged lengths and prefix hits."""
    from spindle.attention.backends.triton_attn import prefill_attention, store_kv

    query_lens, context_lens = PREFILL_LENGTHS[0]
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype,
                     seed=head_dim + num_kv_heads)
    ref, _, _ = reference(case, head_dim ** -0.5)
    out = torch.full_like(case["q"], float("nan"))
    store_kv(case["k"], case["v"], case["kv_cache"], case["slot_mapping"])
    prefill_attention(case["q"], case["kv_cache"], meta_for(case), head_dim ** -0.5, out,
                      block_m=16, pack_gqa=True)
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]


def test_the_planner_target_is_264_unless_the_variable_says_otherwise():
    from spindle.attention.backends.triton_attn import TARGET_PROGRAMS_ENV, target_programs

    assert target_programs({}) == 264
    assert target_programs({TARGET_PROGRAMS_ENV: "1056"}) == 1056
    for bad in ("0", "-4", "many", ""):
        with pytest.raises(ValueError, match=f"{TARGET_PROGRAMS_ENV} must be a positive"):
            target_programs({TARGET_PROGRAMS_ENV: bad})


def test_decode_order_is_longest_first_with_ties_and_padding_in_batch_order():
    import numpy as np

    from spindle.attention.metadata import (LONGEST_FIRST_ENV, decode_order,
                                            longest_first_enabled)

    order = decode_order(np.array([5, 900, 5, 0, 37, 900, 0]))
    assert order.dtype == np.int32
    assert order.tolist() == [1, 5, 4, 0, 2, 3, 6]
    assert longest_first_enabled({LONGEST_FIRST_ENV: "1"}) and longest_first_enabled({})
    assert not longest_first_enabled({LONGEST_FIRST_ENV: "0"})
    with pytest.raises(ValueError, match=f"{LONGEST_FIRST_ENV} must be 0 or 1"):
        longest_first_enabled({LONGEST_FIRST_ENV: "yes"})


def test_mixed_step_requests_single_tokens_longest_first_then_the_rest():
    import numpy as np

    from spindle.attention.metadata import (MIXED_SPLIT_ENV, mixed_split_enabled,
                                            mixed_step_requests)

    order, num_single = mixed_step_requests(np.array([1, 40, 1, 1, 7, 1]),
                                            np.array([5, 40, 900, 5, 30, 37]))
    assert order.dtype == np.int32 and num_single == 4
    assert order.tolist() == [2, 5, 0, 3, 1, 4]
    assert mixed_step_requests(np.array([1, 1]), np.array([3, 9])) is None  # (a decode step)
    assert mixed_step_requests(np.array([4, 9]), np.array([4, 9])) is None  # (prompts only)
    assert mixed_split_enabled({}) and not mixed_split_enabled({MIXED_SPLIT_ENV: "0"})


@pytest.mark.parametrize("bound,split", [(16, True), (264, False)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_step_splits_at_its_bound(monkeypatch, bound, split, dtype):
    """TritonAttentionBackend.forward on a mixed step whose metadata names its
    single-token requests (as DefaultModelState's does on a GPU), with Qwen3's q/k norm
    and rotary: those requests go to the decode kernel when they give bound programs
    without splitting (8 requests x 2 KV heads >= 16), and stay in the prefill kernel
    below it; the output equals the reference either way."""
    import numpy as np

    from spindle.attention.backends import triton_attn
    from spindle.attention.metadata import mixed_step_requests

    monkeypatch.setattr(triton_attn, "_TARGET_PROGRAMS", bound)
    taken = []
    decode = triton_attn.decode_attention
    monkeypatch.setattr(triton_attn, "decode_attention",
                        lambda *a, **kw: (taken.append(kw["requests"]), decode(*a, **kw)))
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    query_lens = [1, 1, 12, 1, 1, 1, 30, 1, 1, 1]
    context_lens = [pick(900, 120), 5, 0, 64, 0, 33, 16, 2, 250, 40]
    case, transform, _, ref = _qwen3_like_step(query_lens, context_lens, num_heads,
                                               num_kv_heads, head_dim, dtype, seed=17,
                                               transform_seed=5)
    meta = meta_for(case)
    order, num_single = mixed_step_requests(np.array(query_lens),
                                            case["seq_lens"].cpu().numpy())
    order = torch.from_numpy(order).to(DEVICE)
    meta.single_token_reqs, meta.multi_token_reqs = order[:num_single], order[num_single:]
    backend = triton_attn.TritonAttentionBackend(num_heads, head_dim, head_dim ** -0.5,
                                                 num_kv_heads)
    out = backend.forward(case["q"], case["k"], case["v"], case["kv_cache"], meta,
                          qk_transform=transform)
    assert len(taken) == split
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("num_heads,head_dim", [(4, 40), (16, 576)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_attention_heads(num_heads, head_dim, dtype):
    """Multi-head latent attention's shape (models/deepseek_v3.py): one KV head of
    kv_lora_rank + qk_rope_head_dim features for every query head (576: DeepSeek-V3's),
    a width no power of two; prefill with earlier context and decode."""
    for query_lens, context_lens in (([1, 7, 20], [0, 40, 17]), ([1, 1, 1], [0, 40, 100])):
        case = make_case(query_lens, context_lens, num_heads, 1, head_dim, 16, dtype,
                         seed=head_dim + len(query_lens))
        out, scale = run_backend(case, num_heads, 1, head_dim)
        ref, _, _ = reference(case, scale)
        assert not out.isnan().any()
        assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
@pytest.mark.parametrize("batch", [1, 17], ids=["split-context", "one-split"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_sinks(window, batch, dtype):
    """gpt-oss's sinks: a logit per query head in each softmax's denominator, in prefill,
    in a decode whose context is split (the merge counts the sink once) and one that is
    not; large sinks, so a wrong share shows."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    gen = torch.Generator().manual_seed(batch)
    sinks = (3.0 * torch.randn(num_heads, generator=gen)).to(DEVICE)
    for query_lens, context_lens in (([1, 7, 30], [0, 40, 17]),
                                     ([1] * batch, [0] + [50 + 13 * i for i in range(batch - 1)])):
        case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype,
                         seed=batch + len(query_lens))
        out, scale = run_backend(case, num_heads, num_kv_heads, head_dim, window=window,
                                 sinks=sinks)
        ref, _, _ = reference(case, scale, window=window, sinks=sinks)
        assert not out.isnan().any()
        assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("option", ["soft_cap", "alibi", "sinks", "chunk", "window"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_options_in_both_kernels(monkeypatch, kernel, option, batch, dtype):
    """Each score option through a decode step of one and of two requests whose
    contexts take several splits of several tiles, in both decode kernels, against the
    reference; the reference without the option is further off than the tolerance, so
    the option is seen to act."""
    from spindle.attention.alibi import bloom_slopes
    from spindle.attention.backends.triton_attn import decode_attention, split_counters

    use_decode_kernel(monkeypatch, kernel)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    gen = torch.Generator().manual_seed(batch)
    case = make_case([1] * batch, [MAX_CONTEXT - 1, 40][:batch], num_heads, num_kv_heads,
                     head_dim, block_size, dtype, seed=batch)
    scale = head_dim ** -0.5
    if option == "soft_cap":
        case["q"] = case["q"] * 3  # scores of several times the cap
        kwargs, ref_kwargs = dict(soft_cap=5.0), dict(soft_cap=5.0)
    elif option == "alibi":
        slopes = bloom_slopes(num_heads).to(DEVICE)
        kwargs, ref_kwargs = dict(alibi_slopes=slopes), dict(alibi=slopes)
    elif option == "sinks":
        # (logits about as heavy as all the keys together: every head's output shrinks)
        sinks = (6.0 + 2.0 * torch.randn(num_heads, generator=gen)).to(DEVICE)
        kwargs, ref_kwargs = dict(sinks=sinks), dict(sinks=sinks)
    elif option == "chunk":
        kwargs, ref_kwargs = dict(sliding_window=16, chunked=True), dict(chunk=16)
    else:
        kwargs, ref_kwargs = dict(sliding_window=12), dict(window=12)
    ref, _, _ = reference(case, scale, **ref_kwargs)
    plain, _, _ = reference(case, scale)
    out = torch.full_like(case["q"], float("nan"))
    counters = split_counters(DEVICE)
    decode_attention(case["q"], case["k"], case["v"], case["kv_cache"], meta_for(case), scale,
                     out, counters, **kwargs)
    assert not counters.any(), "the last split must leave its counter at zero"
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert rel_err(out, plain) > 10 * REL_TOL[dtype]


def test_small_batches_take_the_per_head_kernel(monkeypatch):
    """One or two requests with a head dim of 16, 32, 64 or 128 take the per-head
    kernel unless SPINDLE_DECODE_PER_HEAD=0; three requests, or other head dims, the
    per-KV-head one."""
    from spindle.attention.backends.triton_attn import PER_HEAD_ENV, per_head_applies

    assert per_head_applies(1, 128) and per_head_applies(2, 64) and per_head_applies(1, 16)
    assert not per_head_applies(3, 128)
    assert not per_head_applies(1, 40) and not per_head_applies(1, 256)
    monkeypatch.setenv(PER_HEAD_ENV, "0")
    assert not per_head_applies(1, 128)
