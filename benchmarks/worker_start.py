"""Engine start with forked vs spawned workers (the mp executor on CPU).

Each run is a fresh Python process (as a user's script is): it times
LLM(tensor_parallel_size=TP, distributed_executor_backend="mp",
worker_start_method=M) until ready, then one short greedy generation, and checks
that both start methods give the same tokens. Runs alternate between the methods;
the table shows the median and the best of --repeats.

    python benchmarks/worker_start.py [--tp 2 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

_RUN = """
import json, sys, time
start = time.perf_counter()
from spindle import LLM, SamplingParams
imported = time.perf_counter() - start

if __name__ == "__main__":  # (spawn runs this script again in every worker)
    llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=int(sys.argv[3]),
              distributed_executor_backend="mp", max_model_len=256,
              worker_start_method=sys.argv[2])
    ready = time.perf_counter() - start
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8),
                       use_tqdm=False)
    llm.shutdown()
    print(json.dumps({"import_s": imported, "ready_s": ready,
                      "tokens": out[0].outputs[0].token_ids}))
"""


def run_once(script: Path, model: Path, method: str, tp: int) -> dict:
    done = subprocess.run([sys.executable, str(script), str(model), method, str(tp)],
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch
    import transformers

    from spindle.tools.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "llama", arch="llama")
        script = Path(tmp) / "run.py"
        script.write_text(textwrap.dedent(_RUN))
        runs: dict[str, list[dict]] = {"fork": [], "spawn": []}
        for _ in range(args.repeats):
            for method in runs:
                runs[method].append(run_once(script, model, method, args.tp))
    tokens = {m: {json.dumps(r["tokens"]) for r in rs} for m, rs in runs.items()}
    print(f"python {platform.python_version()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; TP={args.tp}, {args.repeats} runs each")
    print(f"{'start method':<13} {'ready s (median)':>17} {'ready s (best)':>15} "
          f"{'after import s':>15}")
    for method, rs in runs.items():
        ready = [r["ready_s"] for r in rs]
        after_import = [r["ready_s"] - r["import_s"] for r in rs]
        print(f"{method:<13} {statistics.median(ready):>17.2f} {min(ready):>15.2f} "
              f"{statistics.median(after_import):>15.2f}")
    same = len(tokens["fork"] | tokens["spawn"]) == 1
    print(f"same greedy tokens with both methods: {same}")


if __name__ == "__main__":
    main()
