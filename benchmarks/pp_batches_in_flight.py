"""Pipeline parallelism: P batches in flight vs one, output tok/s, one run.

PP=2 on one host (mp backend by default, or --backend ray on a loopback Ray
instance), the same model, prompts and engine settings; only
max_concurrent_batches differs (2 = pipeline_parallel_size, the default, vs 1).
With one batch in flight a stage idles while the other works; with two, both work.

--device-us-per-token N models stages on devices of their own: each stage's forward
also sleeps N microseconds per token (compute-bound device time that leaves the host
CPU free), for hosts whose cores cannot run two stages at once (docs/benchmarks.md).

    python benchmarks/pp_batches_in_flight.py [--backend mp|ray] [--prompts 64 --new 64]
        [--device-us-per-token 300]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path


def build_model(out: Path, args) -> Path:
    from spindle.tools.tiny_model import make_tiny_model

    return make_tiny_model(out / "bench-llama", arch="llama", hidden_size=args.hidden,
                           num_layers=args.layers, num_heads=8, num_kv_heads=4,
                           intermediate_size=args.hidden * 3, vocab_size=args.vocab)


def add_device_time(worker, us_per_token: float) -> None:
    """Make this stage's forward also take us_per_token per token (sleeping)."""
    import time

    model = worker.runner.model
    forward = model.forward

    def timed_forward(input_ids, positions, *rest, **kwargs):
        out = forward(input_ids, positions, *rest, **kwargs)
        time.sleep(us_per_token * 1e-6 * positions.shape[0])
        return out

    model.forward = timed_forward


def run(path: Path, args, batches: int) -> dict:
    from spindle import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(10, args.vocab) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    with LLM(str(path), device="cpu", pipeline_parallel_size=2,
             distributed_executor_backend=args.backend, max_concurrent_batches=batches,
             max_model_len=args.prompt_len + args.new + 16, enable_prefix_caching=False,
             max_num_batched_tokens=args.max_batched_tokens) as llm:
        if args.device_us_per_token:
            llm.engine.core.executor.collective_rpc(add_device_time,
                                                    args=(args.device_us_per_token,))
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in out]
    return {"batches_in_flight": batches, "seconds": seconds,
            "tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="mp", choices=["mp", "ray"])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max-batched-tokens", type=int, default=None)
    p.add_argument("--device-us-per-token", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    if args.backend == "ray":
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=2,
                 object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args)
        rows = []
        for _ in range(args.repeats):  # interleaved: drift on a shared machine hits both
            for batches in (1, 2):
                rows.append(run(path, args, batches))
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    best = {b: max(r["tok_s"] for r in rows if r["batches_in_flight"] == b) for b in (1, 2)}
    result = {"backend": args.backend, "cpu": platform.processor() or platform.machine(),
              "cores": len(os.sched_getaffinity(0)), "args": vars(args),
              "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
              "best_tok_s": best, "speedup": best[2] / best[1], "same_tokens": same}
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
