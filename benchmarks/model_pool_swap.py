"""Several models on one GPU taking turns by sleep mode (spindle/engine/model_pool.py).

Two pairs, each model configured to take most of the GPU (gpu_memory_utilization
0.85 each, so only one fits awake): two Qwen3-0.6B-shaped bf16 models, and a
Llama-3-8B-shaped plus a Qwen3-0.6B-shaped one. Random weights drawn on the device
(load_format="dummy"; a swap's cost does not depend on their values), sleep level 1.

Per pair: each model's cold start (its engine built from nothing: worker process,
CUDA context, weights, KV cache, CUDA graphs), then alternating requests that each
force a swap (the other model to sleep, this one awake), timed to the first token
as a client sees it, beside a request to the model already awake; the driver's
free memory and, where nvidia-smi answers, each process's device memory after every
swap (only the awake model's workers should hold more than a CUDA context).

    python benchmarks/model_pool_swap.py [--json out.json] [--swaps 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from throughput import ARCHITECTURES, QWEN3_06B, write_wordlevel_tokenizer  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=14336, tie_word_embeddings=False)
PAIRS = {"0.6B + 0.6B": (("qwen3", QWEN3_06B), ("qwen3", QWEN3_06B)),
         "8B + 0.6B": (("llama", LLAMA3_8B), ("qwen3", QWEN3_06B))}
PROMPT = {"prompt_token_ids": list(range(100, 612))}  # 512 tokens


def write_config_only(out: Path, model_type: str, shape: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = dict(ARCHITECTURES[model_type], hidden_act="silu", attention_bias=False,
                  torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, **shape)
    (out / "config.json").write_text(json.dumps(config))
    write_wordlevel_tokenizer(out, shape["vocab_size"])
    return out


def process_memory() -> dict[int, int] | None:
    """Device memory per process (bytes) from nvidia-smi, or None without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    used = {}
    for line in out.strip().splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        used[int(pid)] = int(mib) * 2**20
    return used


def driver_free() -> int:
    return torch.cuda.mem_get_info()[0]


async def first_token_seconds(pool, name: str) -> float:
    from spindle import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    start = time.perf_counter()
    ttft = None
    async for out in pool.generate(name, PROMPT, params):
        if ttft is None and out.outputs[0].token_ids:
            ttft = time.perf_counter() - start
    return ttft


def run_pair(label: str, models, args, root: Path) -> dict:
    from spindle.config import EngineArgs
    from spindle.engine.model_pool import ModelPool, PoolModel

    names = ["first", "second"]
    specs = []
    for name, (model_type, shape) in zip(names, models):
        path = write_config_only(root / f"{label.replace(' ', '')}-{name}", model_type, shape)
        specs.append(PoolModel(name, EngineArgs(
            model=str(path), load_format="dummy", dtype="bfloat16", max_model_len=4096,
            gpu_memory_utilization=args.gpu_memory_utilization), sleep_level=1))
    pool = ModelPool(specs, max_awake_models=1, time_slice_s=5.0)
    start = time.perf_counter()
    pool.start()
    result: dict = {"pool_start_s": time.perf_counter() - start}
    try:
        for status in pool.status():
            result[f"{status['name']}_cold_start_s"] = status["stats"]["load_seconds"]
            result[f"{status['name']}_device_GiB"] = status["device_bytes"] / 2**30
            result[f"{status['name']}_weights_GiB"] = status["weight_bytes"] / 2**30
        result.update(asyncio.run(swaps(pool, names, args.swaps)))
    finally:
        pool.shutdown()
    return result


async def swaps(pool, names: list[str], count: int) -> dict:
    pids = {name: await pool.engine(name).call(
        lambda engine: engine.core.executor.worker_pids) for name in names}
    # Each model's first request (a swap for the one asleep) also compiles the kernels
    # of its shapes: kept apart from the steady state measured after it.
    first = {name: await first_token_seconds(pool, name) for name in reversed(names)}
    warm = [await first_token_seconds(pool, names[0]) for _ in range(3)]  # awake: no swap
    swap_ttft: dict[str, list[float]] = {name: [] for name in names}
    wake_s: dict[str, list[float]] = {name: [] for name in names}
    sleep_s: dict[str, list[float]] = {name: [] for name in names}
    memory = []
    for i in range(count):
        name, other = names[(i + 1) % 2], names[i % 2]
        slept_before = pool.model_status(other)["stats"]["sleep_seconds"]
        swap_ttft[name].append(await first_token_seconds(pool, name))
        status = {s["name"]: s for s in pool.status()}
        wake_s[name].append(status[name]["stats"]["last_wake_seconds"])
        sleep_s[other].append(status[other]["stats"]["sleep_seconds"] - slept_before)
        per_process = process_memory()
        memory.append({
            "awake": name, "driver_free_GiB": driver_free() / 2**30,
            "workers_GiB": None if per_process is None else {
                n: sum(per_process.get(p, 0) for p in pids[n]) / 2**30 for n in names}})
    return {"first_request_ttft_s": first, "warm_ttft_s": statistics.median(warm),
            "sleep_s": {n: statistics.median(v) for n, v in sleep_s.items()},
            "swap_ttft_s": {n: statistics.median(v) for n, v in swap_ttft.items()},
            "swap_ttft_all_s": swap_ttft,
            "wake_s": {n: statistics.median(v) for n, v in wake_s.items()},
            "memory_after_swaps": memory}


def main() -> None:
    import transformers
    import triton

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swaps", type=int, default=6)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.cuda.init()
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "triton": triton.__version__,
               "transformers": transformers.__version__,
               "gpu_memory_utilization": args.gpu_memory_utilization, "pairs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for label in args.pairs:
            results["pairs"][label] = run_pair(label, PAIRS[label], args, Path(tmp))
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
    print(f"\n{results['device']}, torch {results['torch']}, each model at "
          f"gpu_memory_utilization {args.gpu_memory_utilization}, sleep level 1")
    print(f"{'pair':<12} {'model':<7} {'weights':>8} {'awake':>8} {'cold start':>11} "
          f"{'1st TTFT':>9} {'sleep':>7} {'wake':>7} {'TTFT swap':>10} {'TTFT warm':>10}")
    for label, r in results["pairs"].items():
        for name in ("first", "second"):
            print(f"{label:<12} {name:<7} {r[f'{name}_weights_GiB']:>6.2f} G "
                  f"{r[f'{name}_device_GiB']:>6.1f} G {r[f'{name}_cold_start_s']:>9.2f} s "
                  f"{r['first_request_ttft_s'][name]:>7.3f} s {r['sleep_s'][name]:>5.3f} s "
                  f"{r['wake_s'][name]:>5.3f} s {r['swap_ttft_s'][name]:>8.3f} s "
                  f"{r['warm_ttft_s']:>8.3f} s")
        for m in r["memory_after_swaps"][:2]:
            print(f"{'':<12} {m['awake']} awake: driver free {m['driver_free_GiB']:.1f} GiB; "
                  f"workers {m['workers_GiB']}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "model_pool_swap.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
