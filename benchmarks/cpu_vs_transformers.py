"""spindle vs transformers `generate` on CPU: same tiny model, same batch, one run.

Absolute numbers on a shared 2-core machine are noisy; the ratio measured side by
side is the figure to record (docs/benchmarks.md).

    python benchmarks/cpu_vs_transformers.py [--batch 16 --prompt-len 128 --new 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch


def build_model(out: Path, args) -> Path:
    from spindle.tools.tiny_model import make_tiny_model

    return make_tiny_model(out / "bench-llama", arch="llama", hidden_size=args.hidden,
                           num_layers=args.layers, num_heads=8, num_kv_heads=4,
                           intermediate_size=args.hidden * 3, vocab_size=args.vocab)


def make_prompts(args) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, args.vocab) for _ in range(args.prompt_len)]
            for _ in range(args.batch)]


def run_transformers(path: Path, prompts, new: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = model.generation_config
    config.eos_token_id = None
    config.pad_token_id = 0
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                  do_sample=False, generation_config=config)
    with torch.no_grad():
        model.generate(ids[:2], **{**kwargs, "attention_mask": torch.ones_like(ids[:2]),
                                   "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        seconds = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return produced / seconds


def run_spindle(path: Path, prompts, new: int) -> tuple[float, str]:
    from spindle import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=2048,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    table = llm.engine.core.startup_table
    llm.shutdown()
    return produced / seconds, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp), args)
        prompts = make_prompts(args)
        hf = run_transformers(path, prompts, args.new)
        ours, table = run_spindle(path, prompts, args.new)
    import transformers

    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "batch": args.batch,
        "prompt_len": args.prompt_len, "new_tokens": args.new,
        "model": f"llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} fp32",
        "transformers_tok_s": round(hf, 1), "spindle_tok_s": round(ours, 1),
        "ratio": round(ours / hf, 2),
    }
    print(table)
    print()
    print(f"{'engine':<14}{'tok/s':>10}")
    print(f"{'transformers':<14}{hf:>10.1f}")
    print(f"{'spindle':<14}{ours:>10.1f}")
    print(f"{'ratio':<14}{ours / hf:>10.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
