"""Tensor-parallel scaling on one host: the nano workload on a Llama-3-8B-shaped
checkpoint (random bf16 weights) with the mp executor at each --tp size.

Each size runs in a fresh process, so that every engine starts on empty devices.
(Figures of 2026-11-29 in docs/benchmarks.md were taken with the checkpoint written in
per-layer shards; it is one file now, which does not change the engine's speed.)
The workload is the nano workload of benchmarks/throughput.py (same seed and lengths).
Prints tok/s per size and the scaling efficiency, (tok/s at n) / (n x tok/s at 1).
--json writes the figures.

    python benchmarks/tp_scaling.py --tp 1 2 [--num-seqs 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import write_random_checkpoint  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=14336, tie_word_embeddings=False)


_RUN_ONE = """
import json, sys, time
sys.path.insert(0, sys.argv[4])
from throughput import nano_workload
from spindle import LLM, SamplingParams

path, tp, num_seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
start = time.perf_counter()
llm = LLM(path, dtype="bfloat16", tensor_parallel_size=tp, max_model_len=4096,
          max_num_seqs=256, max_num_batched_tokens=8192, enable_prefix_caching=False)
startup = time.perf_counter() - start
prompts, outputs = nano_workload(num_seqs)
params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outputs]
llm.generate(prompts[:16], params[:16], use_tqdm=False)  # warm-up call
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - start
produced = sum(len(o.outputs[0].token_ids) for o in outs)
print("RESULT " + json.dumps(dict(tp=tp, startup_s=startup, seconds=seconds,
                                  output_tokens=produced, tok_s=produced / seconds)))
llm.shutdown()
"""


def run_size(path: Path, tp: int, num_seqs: int, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-c", _RUN_ONE, str(path), str(tp), str(num_seqs),
                           str(Path(__file__).resolve().parent)],
                          capture_output=True, text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"tp": tp, "error": (proc.stdout + proc.stderr)[-3000:]}
    return json.loads(lines[0][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per size")
    parser.add_argument("--checkpoint", type=Path, help="reuse this checkpoint directory")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                    "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                    "shape": "Llama-3-8B", "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None or not (path / "config.json").exists():
            start = time.perf_counter()
            path = write_random_checkpoint(path or Path(tmp) / "llama3-8b-shape", LLAMA3_8B,
                                           model_type="llama")
            result["checkpoint_write_s"] = time.perf_counter() - start
        torch.cuda.empty_cache()
        for tp in args.tp:
            result["runs"].append(run_size(path, tp, args.num_seqs, args.timeout))
            print(json.dumps(result["runs"][-1])[:3000], flush=True)
    base = next((r["tok_s"] for r in result["runs"] if r.get("tp") == 1 and "tok_s" in r), None)
    print(f"\n{'TP':>3} {'tok/s':>10} {'seconds':>9} {'startup s':>10} {'efficiency':>11}")
    for r in result["runs"]:
        if "tok_s" not in r:
            print(f"{r['tp']:>3}  failed (see JSON)")
            continue
        r["efficiency"] = r["tok_s"] / (r["tp"] * base) if base else None
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
        print(f"{r['tp']:>3} {r['tok_s']:>10.0f} {r['seconds']:>9.1f} {r['startup_s']:>10.1f} {eff:>11}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
