"""Mixture of experts on one GPU: the nano workload and batch-1 decode on a
Qwen3-30B-A3B-shaped model (48 layers, 128 experts of 768, 8 per token; bf16 random
weights drawn on the device: load_format="dummy", as no 61 GB checkpoint fits here).

The roofline counts what a decode step must read: the dense weights (attention,
embeddings, LM head, routers), every expert that at least one of the step's tokens
is routed to, and the KV cache of every live sequence, at the copy bandwidth measured
in the same run. With B tokens each routed to k of E experts independently and
uniformly (what random weights give), a layer reads E * (1 - (1 - k / E) ** B)
distinct experts on average; the run checks that formula against the experts the
router actually picked for batches of 1 to 256 one-token prompts.

    python benchmarks/moe_throughput.py [--json out.json] [--num-seqs 256]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from throughput import (batch1_decode, copy_bandwidth, kv_bytes_per_token,  # noqa: E402
                        nano_params, nano_workload, write_wordlevel_tokenizer)

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
    hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16",
    bos_token_id=0, eos_token_id=1, transformers_version="4.51.0")


def expected_distinct(tokens: int, k: int, experts: int) -> float:
    return experts * (1 - (1 - k / experts) ** tokens)


def step_bytes(batch: int, context: int, dense: int, expert: int, shape: dict) -> float:
    """Bytes one decode step of batch sequences holding context tokens in all reads."""
    layers, e, k = shape["num_hidden_layers"], shape["num_experts"], shape["num_experts_per_tok"]
    return (dense + layers * expected_distinct(batch, k, e) * expert
            + context * kv_bytes_per_token(shape))


def measured_distinct(llm, batches: list[int]) -> dict[int, float]:
    """Mean distinct experts per layer when batch tokens (two-token prompts: a step of
    one-token prompts would replay a decode graph, hooks unseen) are prefilled in one
    eager step, from the router's own choices."""
    from spindle import SamplingParams
    from spindle.layers.moe import FusedExperts

    model = llm.engine.core.executor.worker.runner.model
    vocab = llm.engine.core.config.model.vocab_size
    counts: list[int] = []
    hooks = [m.register_forward_pre_hook(
        lambda mod, args: counts.append(int(torch.unique(args[1]).numel())))
        for m in model.modules() if isinstance(m, FusedExperts)]
    rng = random.Random(3)
    result = {}
    try:
        for batch in batches:
            counts.clear()
            prompts = [{"prompt_token_ids": [rng.randrange(min(10000, vocab))
                                             for _ in range(2)]} for _ in range(batch // 2)]
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
            result[batch] = sum(counts) / max(len(counts), 1)
    finally:
        for h in hooks:
            h.remove()
    return result


def run(args) -> dict:
    import transformers
    import triton

    from spindle import LLM

    shape = QWEN3_30B_A3B
    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "triton": triton.__version__,
                    "transformers": transformers.__version__}
    bandwidth = copy_bandwidth()
    result["copy_bandwidth_TBps"] = bandwidth / 1e12
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen3-30b-a3b-shape"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(shape))
        write_wordlevel_tokenizer(path, shape["vocab_size"])
        start = time.perf_counter()
        llm = LLM(str(path), load_format="dummy", dtype="bfloat16", max_model_len=4096,
                  max_num_seqs=args.num_seqs, max_num_batched_tokens=8192,
                  enable_prefix_caching=False)
        result["startup_s"] = time.perf_counter() - start
        model = llm.engine.core.executor.worker.runner.model
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                      if ".experts." in n)
        expert = experts // (shape["num_hidden_layers"] * shape["num_experts"])
        dense = total - experts
        result.update(weight_bytes=total, expert_bytes=expert, dense_bytes=dense)

        result["batch1_tok_s"] = batch1_decode(llm)[0]
        result["batch1_bound_tok_s"] = bandwidth / step_bytes(1, 512 + 128, dense, expert, shape)

        prompts, outputs = nano_workload(args.num_seqs)
        params = nano_params(outputs)
        llm.generate(prompts[:16], params[:16], use_tqdm=False)  # warm-up call
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        floor = 0.0
        for step in range(1, max(outputs) + 1):
            live = [(p, o) for p, o in zip(prompts, outputs) if o >= step]
            context = sum(len(p) + step for p, _ in live)
            floor += step_bytes(len(live), context, dense, expert, shape) / bandwidth
        result.update(nano_output_tokens=produced, nano_seconds=seconds,
                      nano_tok_s=produced / seconds, roofline_s=floor,
                      roofline_tok_s=produced / floor, ratio_to_roofline=floor / seconds)
        distinct = measured_distinct(llm, [2, 8, 32, 128, 256])
        result["distinct_experts"] = {
            b: {"measured": m, "formula": expected_distinct(b, shape["num_experts_per_tok"],
                                                            shape["num_experts"])}
            for b, m in distinct.items()}
        llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--num-seqs", type=int, default=256)
    args = parser.parse_args()
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    distinct = result.pop("distinct_experts")
    for key, value in result.items():
        print(f"{key:<24}{value:.4g}" if isinstance(value, float) else f"{key:<24}{value}")
    print("\nbatch  distinct experts per layer: measured  formula")
    for batch, d in distinct.items():
        print(f"{batch:>5}  {d['measured']:>33.1f}  {d['formula']:>7.1f}")


if __name__ == "__main__":
    main()
