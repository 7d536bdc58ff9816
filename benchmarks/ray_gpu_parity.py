"""Greedy parity of the Ray executor with the in-process one, on one CUDA GPU.

Builds a tiny random checkpoint, starts Ray on loopback (no token auth, a small
object store, one GPU), and generates the same greedy batch through
distributed_executor_backend="ray" (TP=1: one actor holding the GPU) and through
the uni executor. Exits non-zero unless the tokens are equal; prints a table.
Needs CUDA and Ray (pip install 'spindle-llm[ray]'); --device cpu checks the script
itself on a machine without a GPU.

    python benchmarks/ray_gpu_parity.py [--arch qwen3 --prompts 16 --new 48]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

# Before Ray is imported: no token auth for a loopback instance.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402


def prompts(n: int) -> list[list[int]]:
    """Token-id prompts of different lengths, some sharing prefixes."""
    base = [(7 * i + 3) % 500 + 5 for i in range(96)]
    return [base[:8 + 11 * (i % 8)] + [(13 * i) % 500 + 5] for i in range(n)]


def generate(path: Path, backend: str, batch: list[list[int]], new: int, device: str) -> dict:
    from spindle import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    llm = LLM(str(path), device=device, distributed_executor_backend=backend,
              max_model_len=512, gpu_memory_utilization=0.3)
    ready = time.perf_counter() - start
    try:
        executor = type(llm.engine.core.executor).__name__
        start = time.perf_counter()
        outputs = llm.generate(batch, greedy, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    return {"backend": backend, "executor": executor, "ready_s": ready, "generate_s": seconds,
            "tokens": [o.outputs[0].token_ids for o in outputs]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3", choices=["llama", "qwen2", "qwen3"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new", type=int, default=48, help="tokens generated per prompt")
    parser.add_argument("--object-store-mib", type=int, default=128)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    import ray

    from spindle.tools.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "ckpt", arch=args.arch, num_layers=4,
                               hidden_size=256, num_heads=8, num_kv_heads=4,
                               intermediate_size=512)
        batch = prompts(args.prompts)
        uni = generate(path, "uni", batch, args.new, args.device)
        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2,
                 num_gpus=1 if cuda else 0,
                 object_store_memory=args.object_store_mib * 2**20, include_dashboard=False,
                 log_to_driver=False)
        try:
            on_ray = generate(path, "ray", batch, args.new, args.device)
        finally:
            ray.shutdown()
    equal = on_ray["tokens"] == uni["tokens"]
    differing = sum(a != b for a, b in zip(on_ray["tokens"], uni["tokens"]))
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"{device}; torch {torch.__version__}, ray {ray.__version__}; "
          f"{args.arch}, {len(batch)} prompts x {args.new} greedy tokens")
    print(f"{'backend':<8} {'executor':<18} {'ready s':>8} {'generate s':>11} {'tokens':>7}")
    for row in (uni, on_ray):
        count = sum(len(t) for t in row["tokens"])
        print(f"{row['backend']:<8} {row['executor']:<18} {row['ready_s']:>8.2f} "
              f"{row['generate_s']:>11.3f} {count:>7}")
    print(f"greedy tokens equal: {equal} ({differing} of {len(batch)} sequences differ)")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
