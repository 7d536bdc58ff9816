"""Sleep mode on the GPU with a Qwen3-0.6B-shaped checkpoint (random bf16 weights).

Measures, with the driver's free memory: what the engine holds awake, what it still
holds asleep at level 1 (and the residue by tag), sleep and wake_up times, identical
greedy output after waking (levels 1 and 2, the latter woken in stages), CUDA graph
captures before and after, and N sleep/wake cycles (memory back to the awake figure,
output checked every 10th cycle). Prints a table; --json writes the figures.

    python benchmarks/sleep_mode.py [--cycles 100] [--backend cumem] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import QWEN3_06B, write_random_checkpoint  # noqa: E402


def driver_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def greedy_outputs(llm) -> list[list[int]]:
    from spindle import SamplingParams

    prompts = [[(7 * i + j) % 10000 for j in range(64 + 37 * i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def run(args) -> dict:
    from spindle import LLM

    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "backend": args.backend}
    torch.cuda.init()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "qwen3-0.6b-shape", QWEN3_06B)
        torch.cuda.empty_cache()
        before_engine = driver_used()
        llm = LLM(str(path), dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
                  enable_sleep_mode=True, sleep_mode_backend=args.backend,
                  gpu_memory_utilization=args.gpu_memory_utilization)
        runner = llm.engine.core.executor.worker.runner
        expected = greedy_outputs(llm)
        awake = driver_used()
        held = awake - before_engine
        captures = runner.num_graph_captures
        result.update(process_baseline_GiB=before_engine / 2**30, engine_held_GiB=held / 2**30,
                      graph_captures_at_start=captures)

        # Level 1.
        result["l1_sleep_s"] = timed(llm.sleep, 1)
        asleep = driver_used()
        state = llm.sleep_state()["workers"][0]
        result["l1_asleep_held_GiB"] = (asleep - before_engine) / 2**30
        result["l1_asleep_fraction"] = (asleep - before_engine) / held
        result["l1_residue_by_tag_MiB"] = {tag: b / 2**20 for tag, b in state["device_bytes"].items()}
        result["l1_residue_other_MiB"] = (asleep - before_engine
                                          - sum(state["device_bytes"].values())) / 2**20
        result["l1_host_copy_GiB"] = state["host_bytes"] / 2**30
        result["l1_wake_s"] = timed(llm.wake_up)
        result["l1_output_identical"] = greedy_outputs(llm) == expected
        result["l1_graph_captures_after"] = runner.num_graph_captures

        # Level 2, woken in stages: weights (reloaded from the checkpoint), then the cache.
        result["l2_sleep_s"] = timed(llm.sleep, 2)
        result["l2_asleep_fraction"] = (driver_used() - before_engine) / held
        result["l2_wake_weights_s"] = timed(llm.wake_up, ["weights"])
        result["l2_wake_kv_cache_s"] = timed(llm.wake_up, ["kv_cache"])
        llm.wake_up(["scheduling"])
        result["l2_output_identical"] = greedy_outputs(llm) == expected
        result["l2_graph_captures_after"] = runner.num_graph_captures

        # Cycles.
        sleeps, wakes, checks = [], [], []
        for cycle in range(1, args.cycles + 1):
            sleeps.append(timed(llm.sleep, 1))
            wakes.append(timed(llm.wake_up))
            if cycle % 10 == 0:
                checks.append(greedy_outputs(llm) == expected)
        after = driver_used()
        result.update(
            cycles=args.cycles, cycle_sleep_median_s=statistics.median(sleeps),
            cycle_sleep_max_s=max(sleeps), cycle_wake_median_s=statistics.median(wakes),
            cycle_wake_max_s=max(wakes), cycle_outputs_identical=f"{sum(checks)}/{len(checks)}",
            memory_after_cycles_vs_awake=(after - before_engine) / held,
            graph_captures_after_cycles=runner.num_graph_captures)
        llm.shutdown()
        torch.cuda.empty_cache()
        result["after_shutdown_held_MiB"] = (driver_used() - before_engine) / 2**20
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--backend", default="cumem", help="sleep_mode_backend")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v:.1f}" for k, v in value.items())
        print(f"{key:<32}{value:.4g}" if isinstance(value, float) else f"{key:<32}{value}")


if __name__ == "__main__":
    main()
