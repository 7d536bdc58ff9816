"""How long starting and leaving an LLM take on the CPU in a process with a big heap (a
script that used transformers has some 400k objects): engines of a tiny Llama one after
another, each answering one request; the median of all but the first.

    python benchmarks/llm_exit_time.py [--engines 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    import transformers.modeling_utils  # noqa: F401 (the heap of a script that used it)

    from spindle import LLM, SamplingParams
    from spindle.tools.tiny_model import make_tiny_model

    path = make_tiny_model(Path(tempfile.mkdtemp()), arch="llama")
    starts, exits = [], []
    for _ in range(args.engines):
        began = time.perf_counter()
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=256)
        ready = time.perf_counter()
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
        answered = time.perf_counter()
        llm.shutdown()
        starts.append(ready - began)
        exits.append(time.perf_counter() - answered)
    figures = {"objects": len(gc.get_objects()),
               "start_s": statistics.median(starts[1:]), "exit_s": statistics.median(exits[1:]),
               "torch": torch.__version__, "python": platform.python_version()}
    print(f"\n{args.engines} engines, heap of {figures['objects']:,} objects "
          f"(torch {torch.__version__}, Python {platform.python_version()})")
    print("| | median s |\n| --- | --- |")
    print(f"| LLM() to ready | {figures['start_s']:.4f} |")
    print(f"| shutdown | {figures['exit_s']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
