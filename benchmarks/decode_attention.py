"""The CUDA decode-attention kernel alone, at nano-like batches: how close its KV reads
come to the device's copy bandwidth.

Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head dim 128, bf16, 16-token
pages); context lengths drawn uniformly from 100-2048 tokens (the nano workload's range
during decode); block tables either in order (a fresh cache) or shuffled (a cache after
churn). The bytes counted are the keys and values of every context token, read once.

    python benchmarks/decode_attention.py [--batches 256 128 32] [--json out.json]
        [--target-programs 264 528 1056] [--tiles 64x4x2 128x4x2 64x4x3]
        [--pages token head] [--page-sizes 16 32] [--longest 1200 2048] [--rope off on]
        [--uniform]

Each case runs with the requests started in batch order and longest context first
(meta.decode_order, what the runner hands the kernel on a GPU).

--target-programs: rerun every case with the split planner aiming at each number of
programs (triton_attn._TARGET_PROGRAMS, set for the run), and report each output's
largest difference from the first setting's.

--tiles: the same for the per-KV-head kernel's BLOCK_N x num_warps x num_stages (rows
marked "default" use the engine's own), each against every target.

--pages: the same for the cache's page layout: "token" (a page [block_size, kv heads,
head dim], the default) and "head" (heads first, SPINDLE_KV_HEAD_MAJOR=1's layout: the
same values, read through the strides of a transposed view).

--page-sizes: tokens per page (the engine's --block-size; default 16). Each size draws
its own cache, so outputs are compared only within a size.

--longest: the longest context of a case (default 2048; contexts are drawn from 100 to
it). Inside the engine nano's full-batch steps average about 640 tokens: 1200 is
closer to them. --uniform: every context exactly --longest tokens instead, so that a
sweep of --longest shows how the read rate falls with the tiles a program reads (what
a program pays before its first tile weighs more the fewer it reads).

--rope: "on" calls the kernel as the engine calls it for Qwen3: q, k and v views of one
qkv projection's rows, with the q/k RMSNorms and the rotary embedding fused into the
kernel (a program's work before its first tile grows). Outputs are compared only within
a setting.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from gpu_timing import copy_bandwidth, graph_us, write_rows

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def decode_case(num_reqs: int, shuffled: bool, page: int, longest: int = 2048,
                seed: int = 0, uniform: bool = False):
    """(q, k, v, kv_cache, metadata, bytes of context K/V) for one decode step on
    pages of `page` tokens, contexts drawn from 100 to `longest` tokens (uniform:
    all `longest`)."""
    gen = torch.Generator().manual_seed(seed)
    if uniform:
        lens = torch.full((num_reqs,), longest)
    else:
        lens = torch.randint(100, longest + 1, (num_reqs,), generator=gen)
    meta, num_pages = decode_step(lens, page, shuffle=gen if shuffled else None)
    cache = torch.randn(2, num_pages, page, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                        device="cuda")
    q = torch.randn(num_reqs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(num_reqs, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    return q, k, v, cache, meta, kv_bytes(lens)


def kv_bytes(tokens: torch.Tensor) -> int:
    """Bytes of the bf16 keys and values of sum(tokens) positions, every KV head: what
    a decode step reads of its contexts. Shared with layer_chain.py."""
    return int(tokens.sum()) * KV_HEADS * HEAD_DIM * 2 * 2


def decode_step(seq_lens: torch.Tensor, page: int, shuffle: torch.Generator | None = None):
    """(metadata on CUDA, pages in all) of a decode step: request i has seq_lens[i]
    tokens, its new one last, on pages of `page` tokens that follow one another in the
    cache, or with shuffle lie in an order drawn from it (a cache after churn).
    Shared with layer_chain.py."""
    from spindle.attention.metadata import AttentionMetadata

    num_reqs = seq_lens.numel()
    blocks = [(int(n) + page - 1) // page for n in seq_lens]
    total = sum(blocks)
    order = (torch.randperm(total, generator=shuffle) if shuffle is not None
             else torch.arange(total))
    tables = torch.zeros(num_reqs, max(blocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[start:start + n]
        start += n
    last = seq_lens - 1
    slots = tables[torch.arange(num_reqs), last // page].long() * page + last % page
    meta = AttentionMetadata(
        num_reqs=num_reqs, num_tokens=num_reqs,
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32, device="cuda"),
        seq_lens=seq_lens.to(torch.int32).cuda(), block_tables=tables.cuda(),
        slot_mapping=slots.cuda(), max_query_len=1, max_seq_len=int(seq_lens.max()))
    return meta, total


def engine_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
                  longest: int):
    """(q, k, v, qk_transform) as Qwen3's attention hands them to the kernel: views of
    one [B, (H + 2 H_kv) D] qkv row each, the new token at position seq_len - 1 with
    its q/k norms and rotary to apply."""
    from spindle.layers.rotary import QKNormRope, RotaryEmbedding

    qkv = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    views = (qkv[:, :q_width].view_as(q), qkv[:, q_width:q_width + kv_width].view_as(k),
             qkv[:, q_width + kv_width:].view_as(v))
    rope = RotaryEmbedding(HEAD_DIM, longest + 1, {"rope_type": "default", "rope_theta": 1e6})
    gen = torch.Generator().manual_seed(1)
    q_norm, k_norm = (1 + 0.1 * torch.randn(HEAD_DIM, generator=gen) for _ in range(2))
    transform = QKNormRope((seq_lens - 1).long(), rope.cos_cache.cuda(), rope.sin_cache.cuda(),
                           q_norm.to(q.dtype).cuda(), k_norm.to(q.dtype).cuda(), 1e-6)
    return (*views, transform)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values in pages allocated heads first, as the engine allocates and
    views them under SPINDLE_KV_HEAD_MAJOR=1 (AttentionCacheSpec with head_major)."""
    from spindle.cache.spec import AttentionCacheSpec

    kv_heads, head_dim = cache.shape[3:]
    return AttentionCacheSpec(kv_heads, head_dim, cache.dtype,
                              head_major=True).pages_holding(cache)


def parse_tiles(text: str) -> tuple[int, int, int]:
    """"64x4x2" -> (64, 4, 2): BLOCK_N, num_warps, num_stages (triton_attn's parser)."""
    from spindle.attention.backends.triton_attn import parse_tiles as parse

    try:
        return parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 128, 32])
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--target-programs", type=int, nargs="+",
                        help="split-planner targets to compare (default: the module's)")
    parser.add_argument("--tiles", type=parse_tiles, nargs="+", default=[None],
                        help="BLOCKNxWARPSxSTAGES of the per-KV-head kernel (default: its own)")
    parser.add_argument("--pages", nargs="+", choices=("token", "head"), default=["token"],
                        help="cache page layouts to compare (head: heads first)")
    parser.add_argument("--longest", type=int, nargs="+", default=[2048],
                        help="longest context of a case (drawn from 100 to this)")
    parser.add_argument("--uniform", action="store_true",
                        help="every context exactly --longest tokens")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16],
                        help="tokens per page (the engine's --block-size) to compare")
    parser.add_argument("--rope", nargs="+", choices=("off", "on"), default=["off"],
                        help="on: q/k norms and rotary fused in, q/k/v views of qkv rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention.py needs a CUDA device")
    from spindle.attention.backends import triton_attn
    from spindle.attention.backends.triton_attn import (decode_attention, num_decode_splits,
                                                        split_counters)
    from spindle.attention.metadata import decode_order

    targets = args.target_programs or [triton_attn._TARGET_PROGRAMS]

    copy_bw = copy_bandwidth()
    rows = []
    default_target = triton_attn._TARGET_PROGRAMS
    try:
        for page, longest, num_reqs, shuffled in itertools.product(
                args.page_sizes, args.longest, args.batches, (False, True)):
            q, k, v, token_cache, meta, nbytes = decode_case(num_reqs, shuffled, page,
                                                             longest, uniform=args.uniform)
            caches = {"token": token_cache,
                      "head": head_major(token_cache) if "head" in args.pages else None}
            longest_first = torch.from_numpy(
                decode_order(meta.seq_lens.cpu().numpy())).cuda()
            inputs = {"off": (q, k, v, None)}
            if "on" in args.rope:
                inputs["on"] = engine_inputs(q, k, v, meta.seq_lens, longest)
            first = {}  # each rope setting's first output
            for rope, pages, tiles, target, ordered in itertools.product(
                    args.rope, args.pages, args.tiles, targets, (False, True)):
                cache = caches[pages]
                q_in, k_in, v_in, transform = inputs[rope]
                triton_attn._TARGET_PROGRAMS = target
                meta.decode_order = longest_first if ordered else None
                out, counters = torch.empty_like(q), split_counters("cuda")
                # In a CUDA graph: launched from Python one at a time, the host's
                # launches take longer than the kernel at 32 requests.
                t = graph_us(lambda _: decode_attention(
                    q_in, k_in, v_in, cache, meta, HEAD_DIM ** -0.5, out, counters,
                    qk_transform=transform, tiles=tiles), 5) / 1e6
                reference = first.setdefault(rope, out.clone())
                name = "x".join(map(str, tiles)) if tiles else "default"
                rows.append({"requests": num_reqs, "target_programs": target,
                             "tiles": name, "pages": pages, "page_size": page,
                             "longest": longest, "uniform": args.uniform, "rope": rope,
                             "order": "longest first" if ordered else "batch",
                             "splits": num_decode_splits(num_reqs, KV_HEADS),
                             "block_tables": "shuffled" if shuffled else "in order",
                             "us": t * 1e6, "tb_s": nbytes / t / 1e12,
                             "of_copy": nbytes / t / copy_bw,
                             "max_diff": (out.float() - reference.float()).abs().max().item()})
    finally:
        triton_attn._TARGET_PROGRAMS = default_target
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(f"{'requests':>8} {'longest':>7} {'rope':>4} {'pages':>5} {'page':>4} {'tiles':>10} "
          f"{'target':>6} {'splits':>6}  {'block tables':<12} {'order':<13} {'us':>8} "
          f"{'TB/s':>6} {'x copy':>7} {'max diff':>9}")
    for r in rows:
        print(f"{r['requests']:>8} {r['longest']:>7} {r['rope']:>4} {r['pages']:>5} "
              f"{r['page_size']:>4} {r['tiles']:>10} {r['target_programs']:>6} {r['splits']:>6}  "
              f"{r['block_tables']:<12} {r['order']:<13} {r['us']:>8.1f} {r['tb_s']:>6.2f} "
              f"{r['of_copy']:>7.3f} {r['max_diff']:>9.2e}")
    if args.json:
        write_rows(args.json, rows, copy_bw)


if __name__ == "__main__":
    main()
