"""Can decode attention (bound by memory bandwidth) and a decode layer's small cuBLAS
GEMMs run beside each other on one GPU? The question behind running a decode step's
requests in two halves on two streams (one half's attention beside the other half's
projections; tried in the twenty-first session, docs/benchmarks.md).

Times 28 layers of Qwen3-0.6B-shaped work on each of --requests decode requests with
--context tokens each: the decode-attention kernel alone, the four projections alone
(qkv, o_proj, gate_up, down as cuBLAS GEMMs with each layer's own weights), and both
on two streams with nothing between them (the best any overlap could do), in CUDA
graphs: with equal stream priorities, with the GEMMs' stream of high priority, and
that graph instantiated with node priorities (cudaGraphInstantiateFlagUseNodePriority);
then eagerly. A lower bound is printed beside: attention plus the GEMMs' weight bytes
at the attention's own read rate.

    python benchmarks/stream_overlap.py [--requests 128 256] [--context 640] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from spindle.attention.backends.triton_attn import decode_attention, split_counters
from spindle.attention.metadata import AttentionMetadata

LAYERS, PAGE = 28, 16
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FF = 16, 8, 128, 1024, 3072


class Work:
    """Attention inputs, KV caches and GEMM weights for `requests` decode requests."""

    def __init__(self, requests: int, context: int, device: torch.device) -> None:
        bf16 = dict(device=device, dtype=torch.bfloat16)
        pages = context // PAGE
        blocks = requests * pages
        self.caches = [torch.randn(2, blocks, PAGE, KV_HEADS, HEAD_DIM, **bf16)
                       for _ in range(LAYERS)]
        tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(requests, pages)
        self.meta = AttentionMetadata(
            num_reqs=requests, num_tokens=requests,
            query_start_loc=torch.arange(requests + 1, device=device, dtype=torch.int32),
            seq_lens=torch.full((requests,), context, device=device, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.full((requests,), -1, device=device, dtype=torch.int64),
            max_query_len=1, max_seq_len=context)
        self.q = torch.randn(requests, HEADS, HEAD_DIM, **bf16)
        self.k = torch.randn(requests, KV_HEADS, HEAD_DIM, **bf16)
        self.v = torch.randn(requests, KV_HEADS, HEAD_DIM, **bf16)
        self.out = torch.empty_like(self.q)
        self.counters = split_counters(device)
        shapes = ((4096, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * FF, HIDDEN), (HIDDEN, FF))
        self.weights = [[torch.randn(n, k, **bf16) * 0.02 for n, k in shapes]
                        for _ in range(LAYERS)]
        self.inputs = [torch.randn(requests, k, **bf16) for _, k in shapes]
        self.kv_bytes = sum(c.numel() * c.element_size() for c in self.caches)
        self.weight_bytes = sum(w.numel() * w.element_size() for ws in self.weights for w in ws)

    def attention(self) -> None:
        for cache in self.caches:
            decode_attention(self.q, self.k, self.v, cache, self.meta, HEAD_DIM ** -0.5,
                             self.out, self.counters)

    def gemms(self) -> None:
        for layer in self.weights:
            for x, w in zip(self.inputs, layer):
                torch.mm(x, w.t())


def side_by_side(work: Work, attention_stream, gemm_stream) -> None:
    main = torch.cuda.current_stream()
    for stream in (attention_stream, gemm_stream):
        stream.wait_stream(main)
    with torch.cuda.stream(attention_stream):
        work.attention()
    with torch.cuda.stream(gemm_stream):
        work.gemms()
    for stream in (attention_stream, gemm_stream):
        main.wait_stream(stream)


def graphed(fn, node_priorities: bool = False):
    """fn captured in a CUDA graph; -> a function that launches it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    if not node_priorities:
        graph.instantiate()
        return graph.replay
    from cuda.bindings import runtime

    flag = runtime.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagUseNodePriority
    err, executable = runtime.cudaGraphInstantiateWithFlags(graph.raw_cuda_graph(), flag)
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaGraphInstantiateWithFlags: {err}")

    def launch():
        (err,) = runtime.cudaGraphLaunch(executable, torch.cuda.current_stream().cuda_stream)
        if err != runtime.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaGraphLaunch: {err}")
    launch.keep = (graph, executable)
    return launch


def best_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps * 1000)
    return best


def measure(requests: int, context: int, device: torch.device) -> dict[str, float]:
    work = Work(requests, context, device)
    _, highest = torch.cuda.Stream.priority_range()
    low = torch.cuda.Stream(device=device)
    high = torch.cuda.Stream(device=device, priority=highest)
    same = torch.cuda.Stream(device=device)
    rows = {"attention alone": best_us(graphed(work.attention)),
            "GEMMs alone": best_us(graphed(work.gemms)),
            "both, equal priorities": best_us(graphed(lambda: side_by_side(work, low, same))),
            "both, GEMMs high priority": best_us(graphed(lambda: side_by_side(work, low, high))),
            "both, GEMMs high, node priorities": best_us(
                graphed(lambda: side_by_side(work, low, high), node_priorities=True)),
            "both, GEMMs high priority, eager": best_us(lambda: side_by_side(work, low, high),
                                                        reps=5)}
    attention_rate = work.kv_bytes / rows["attention alone"]  # bytes per us
    rows["lower bound: attention + weight bytes"] = (
        rows["attention alone"] + work.weight_bytes / attention_rate)
    rows["one after the other (sum)"] = rows["attention alone"] + rows["GEMMs alone"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    results = {n: measure(n, args.context, device) for n in args.requests}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {LAYERS} layers, "
          f"{args.context}-token contexts; us")
    names = list(next(iter(results.values())))
    print(f"{'':40s}" + "".join(f"{n:>10d} req" for n in args.requests))
    for name in names:
        print(f"{name:40s}" + "".join(f"{results[n][name]:14.1f}" for n in args.requests))
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "torch": torch.__version__, "context": args.context,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
