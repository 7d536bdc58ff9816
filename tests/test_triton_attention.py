"""Triton paged attention and store-KV against a float64 torch reference, on fresh
random inputs: GQA ratios, head dims 64/128, block sizes, ragged lengths, prefix
hits, and outputs poisoned with NaN before every run."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

import os

# TRITON_INTERPRET=1 runs the kernels on the CPU (slow; for developing without a GPU).
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# Relative error bounds (METHOD.md): IEEE float32 far under 1e-3; bf16 operands 1e-3..1e-2.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 5e-3}


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


def reference(case, scale):
    """float64 attention of each request's queries over its (cache + new) context."""
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
        visible = pos[None, :] <= (cl + torch.arange(ql, device=DEVICE))[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        outs.append(torch.einsum("hqs,shd->qhd", scores.softmax(-1), values))
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


def run_backend(case, num_heads, num_kv_heads, head_dim):
    from spindle.attention.backends.triton_attn import (decode_attention, prefill_attention,
                                                        store_kv)

    scale = head_dim ** -0.5
    meta = meta_for(case)
    store_kv(case["k"], case["v"], case["kv_cache"], case["slot_mapping"])
    out = torch.full_like(case["q"], float("nan"))  # poisoned: every row must be written
    if meta.max_query_len == 1:
        decode_attention(case["q"], case["kv_cache"], meta.block_tables, meta.seq_lens, scale, out)
    else:
        prefill_attention(case["q"], case["kv_cache"], meta, scale, out)
    return out, scale


SHAPES = [  # (num_heads, num_kv_heads, head_dim)
    (8, 8, 64), (16, 8, 128), (16, 4, 128), (32, 4, 64), (8, 1, 128)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_prefix_hits_and_ragged_lengths(num_heads, num_kv_heads, head_dim,
                                                     block_size, dtype):
    seed = hash((num_heads, num_kv_heads, head_dim, block_size, str(dtype))) % 10_000
    query_lens = [1, 7, 64, 130, 33, 1, 250]
    context_lens = [0, 40, 0, 17, 300, 5, 64]  # prefix hits / earlier chunks
    case = make_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed)
    out, scale = run_backend(case, num_heads, num_kv_heads, head_dim)
    ref, flat_k, flat_v = reference(case, scale)
    assert not out.isnan().any(), "some output rows were never written"
    assert rel_err(out, ref) < REL_TOL[dtype]
    # store_kv wrote exactly this step's slots.
    cache_k = case["kv_cache"][0].reshape(-1, num_kv_heads, head_dim)
    assert torch.equal(cache_k[case["slot_mapping"]], case["k"])


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_decode_split_context(num_heads, num_kv_heads, head_dim, block_size, dtype, batch):
    gen = torch.Generator().manual_seed(batch * 31 + head_dim + block_size)
    context_lens = torch.randint(0, 2000, (batch,), generator=gen).tolist()
    context_lens[0] = 0  # a context of just the new token
    case = make_case([1] * batch, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                     dtype, seed=batch + head_dim)
    out, scale = run_backend(case, num_heads, num_kv_heads, head_dim)
    ref, _, _ = reference(case, scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]


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


def test_decode_padding_rows_are_zero():
    """CUDA-graph padding rows have seq_len 0: finite zeros, never NaN."""
    case = make_case([1, 1], [10, 0], 8, 2, 64, 16, torch.bfloat16, seed=3)
    case["seq_lens"][1] = 0
    from spindle.attention.backends.triton_attn import decode_attention

    out = torch.full_like(case["q"], float("nan"))
    decode_attention(case["q"], case["kv_cache"], case["block_tables"], case["seq_lens"],
                     0.125, out)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert not out[0].isnan().any()
