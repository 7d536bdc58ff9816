"""Attention of a mixed step (prompt chunks beside decoding requests) on one GPU.

Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head dim 128, bf16, 16-token
pages, shuffled block tables), nano-like steps of 8,192 tokens: D decoding requests with
contexts of 100-2,048 tokens, and prompts of 100-1,024 tokens (no context) filling the
rest, the two kinds interleaved in batch order. Per step, in a CUDA graph (us a call):

- one kernel: the prefill kernel over every request (each single-token request in
  64-row tiles with one valid row, for each query head);
- split: the prefill kernel for the prompts and the decode kernel for the single-token
  requests (longest first), each given its requests, as TritonAttentionBackend.forward
  does;
- each of those two alone, and the prefill kernel on the prompts at other tiles;
- torch SDPA (its flash kernel, one call per prompt) on the same prompts: what the
  device does with a dense causal prompt, as a reference.

    python benchmarks/mixed_attention.py [--decodes 15 62 131 248] [--json out.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_timing import copy_bandwidth, graph_us, write_rows

HEADS, KV_HEADS, HEAD_DIM, PAGE, TOKENS = 16, 8, 128, 16, 8192
# (block_m, block_n, num_warps, num_stages, pack_gqa) of the prefill kernel's sweep
TILES = [(64, 64, 4, 2, False), (64, 64, 4, 3, False), (128, 64, 8, 2, False),
         (128, 64, 8, 3, False), (128, 32, 8, 3, False), (64, 32, 4, 3, False),
         (128, 128, 8, 2, False), (64, 64, 4, 2, True), (128, 64, 8, 3, True)]


def mixed_case(num_decodes: int, seed: int = 0) -> dict:
    """Tensors and metadata of one mixed step (see the module docstring)."""
    from spindle.attention.backends.triton_attn import store_kv
    from spindle.attention.metadata import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    contexts = torch.randint(100, 2049, (num_decodes,), generator=gen).tolist()
    prompts, left = [], TOKENS - num_decodes
    while left > 0:
        prompts.append(min(left, int(torch.randint(100, 1025, (1,), generator=gen))))
        left -= prompts[-1]
    kinds = [("decode", c) for c in contexts] + [("prompt", n) for n in prompts]
    kinds = [kinds[i] for i in torch.randperm(len(kinds), generator=gen).tolist()]
    query_lens = [1 if kind == "decode" else n for kind, n in kinds]
    seq_lens = [n for _, n in kinds]
    blocks = [-(-n // PAGE) for n in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen)
    tables = torch.zeros(len(kinds), max(blocks), dtype=torch.int32)
    slots, start = [], 0
    for i, (n, q_len) in enumerate(zip(blocks, query_lens)):
        tables[i, :n] = order[start:start + n]
        start += n
        for p in range(seq_lens[i] - q_len, seq_lens[i]):
            slots.append(int(tables[i, p // PAGE]) * PAGE + p % PAGE)
    cache = torch.randn(2, sum(blocks), PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                        device="cuda")
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=len(kinds), num_tokens=TOKENS, query_start_loc=qsl.cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).cuda(), block_tables=tables.cuda(),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).cuda(),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    singles = [i for i, q_len in enumerate(query_lens) if q_len == 1]
    singles.sort(key=lambda i: -seq_lens[i])
    multi = [i for i, q_len in enumerate(query_lens) if q_len > 1]
    q = torch.randn(TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    store_kv(k, v, cache, meta.slot_mapping)  # (so that both ways read the same new tokens)
    return dict(q=q, k=k, v=v, cache=cache, meta=meta, prompts=prompts,
                singles=torch.tensor(singles, dtype=torch.int32, device="cuda"),
                multi=torch.tensor(multi, dtype=torch.int32, device="cuda"),
                decode_kv_bytes=sum(contexts) * KV_HEADS * HEAD_DIM * 2 * 2)


def prompt_flops(prompts: list[int]) -> float:
    """Causal attention's multiply-adds of the prompts, x2 (scores and values)."""
    return sum(4.0 * HEADS * HEAD_DIM * n * (n + 1) / 2 for n in prompts)


def sdpa_prompts(case: dict):
    """A call of torch SDPA on every prompt of the case (dense q, k, v)."""
    q_len = torch.diff(case["meta"].query_start_loc).tolist()
    starts = case["meta"].query_start_loc.tolist()
    spans = [(s, n) for s, n in zip(starts, q_len) if n > 1]
    q, k = case["q"], case["k"]

    def run(_):
        for s, n in spans:
            F.scaled_dot_product_attention(
                q[s:s + n].transpose(0, 1)[None], k[s:s + n].transpose(0, 1)[None],
                k[s:s + n].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    return run


def measure(num_decodes: int, iters: int) -> list[dict]:
    from spindle.attention.backends.triton_attn import (decode_attention, prefill_attention,
                                                        split_counters)

    case = mixed_case(num_decodes)
    q, k, v, cache, meta, singles, multi = (
        case[n] for n in ("q", "k", "v", "cache", "meta", "singles", "multi"))
    scale, out, counters = HEAD_DIM ** -0.5, torch.empty_like(q), split_counters("cuda")
    flops = prompt_flops(case["prompts"])

    def decodes(_):
        decode_attention(q, k, v, cache, meta, scale, out, counters, requests=singles)

    def prompts(_, tile=TILES[0]):
        block_m, block_n, warps, stages, pack = tile
        prefill_attention(q, cache, meta, scale, out, block_m=block_m, block_n=block_n,
                          pack_gqa=pack, num_warps=warps, num_stages=stages,
                          requests=multi)

    one = graph_us(lambda _: prefill_attention(q, cache, meta, scale, out), iters, 4)
    reference = out.clone()
    split = graph_us(lambda i: (prompts(i), decodes(i)), iters, 4)
    diff = (out.float() - reference.float()).abs().max().item()
    rows = [dict(decodes=num_decodes, what="one kernel", us=one),
            dict(decodes=num_decodes, what="split", us=split, max_diff=diff),
            dict(decodes=num_decodes, what="decode kernel alone", us=graph_us(decodes, iters, 4),
                 kv_bytes=case["decode_kv_bytes"])]
    for tile in TILES:
        rows.append(dict(decodes=num_decodes, what="prefill kernel alone", tile=tile,
                         us=graph_us(lambda i, t=tile: prompts(i, t), iters, 4), flops=flops))
    rows.append(dict(decodes=num_decodes, what="torch SDPA, prompts", flops=flops,
                     us=graph_us(sdpa_prompts(case), iters, 4)))
    return rows


def describe(row: dict, copy_bw: float) -> str:
    rate = ""
    if "flops" in row:
        rate = f"{row['flops'] / row['us'] / 1e6:7.1f} TFLOP/s"
    elif "kv_bytes" in row:
        rate = f"{row['kv_bytes'] / row['us'] / 1e6 / copy_bw * 1e12:7.2f} x copy"
    tile = ("m{} n{} w{} s{}{}".format(*row["tile"][:4], " gqa" if row["tile"][4] else "")
            if "tile" in row else "")
    diff = f"max diff {row['max_diff']:.1e}" if "max_diff" in row else ""
    return (f"{row['decodes']:>7} {row['what']:<21} {tile:<19} {row['us']:>9.1f} "
            f"{rate:>15} {diff}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decodes", type=int, nargs="+", default=[15, 62, 131, 248])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mixed_attention.py needs a CUDA device")
    copy_bw = copy_bandwidth()
    rows = [row for n in args.decodes for row in measure(n, args.iters)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; us a layer's attention")
    print(f"{'decodes':>7} {'what':<21} {'prefill tile':<19} {'us':>9}")
    for row in rows:
        print(describe(row, copy_bw))
    if args.json:
        write_rows(args.json, rows, copy_bw)


if __name__ == "__main__":
    main()
