"""GPU throughput of a hybrid (state-space + attention) model: a ~1B-parameter random
bf16 checkpoint on the "nano" workload, and batch-1 decode. --arch picks its shape:
Bamba (Mamba2, the default), Qwen3.5 (Gated DeltaNet, dense), Jamba (Mamba1, experts
every other layer), Mamba (Mamba1 layers only, a float32 state: mamba-1.4b's shape),
Zamba2 (Mamba2 layers, a shared transformer block every sixth: Zamba2-1.2B-like) or
KimiLinear (Kimi delta attention, latent attention every fourth layer, experts).

The roofline counts what every decode step must read at least once: all weights (for
Jamba's experts: all of them, so its bound is generous at small batches; Zamba2's shared
block once per layer that runs it), the
attention KV of every live sequence (only the attention layers have one), and every
live sequence's state (each state layer's cache spec: conv + SSM or recurrent state;
the step also writes it back, which the bound leaves out, so the bound is generous).
The copy bandwidth is measured in the same run.

    python benchmarks/hybrid_throughput.py [--arch bamba|qwen3_5|jamba|mamba|zamba2|
                                                   kimi_linear]
                                           [--json out.json]
                                           [--num-seqs 256]
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
from throughput import (StepTimer, batch1_decode, copy_bandwidth, nano_params,  # noqa: E402
                        nano_workload, write_wordlevel_tokenizer)

BAMBA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=4096, num_hidden_layers=20,
                num_attention_heads=16, num_key_value_heads=4, attn_layer_indices=[4, 10, 16],
                mamba_n_heads=64, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, tie_word_embeddings=False,
                max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
                pad_token_id=2)


# Qwen3.5-shaped: Gated DeltaNet layers (16 key heads of 128 for 16 value heads of 128)
# with gated attention every 4th layer, a dense MLP: 1.28B parameters.
QWEN3_5_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=20, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                  tie_word_embeddings=False, max_position_embeddings=8192, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
# Jamba-shaped: Mamba1 layers (state 16, 2x expansion), attention every 8th layer, 8
# experts (2 per token) every other layer: 1.34B parameters.
JAMBA_1B = dict(vocab_size=32000, hidden_size=1536, intermediate_size=3072,
                num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4,
                attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
                expert_layer_offset=1, num_experts=8, num_experts_per_tok=2, mamba_d_state=16,
                mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto",
                tie_word_embeddings=False, max_position_embeddings=8192, rms_norm_eps=1e-6,
                bos_token_id=0, eos_token_id=1, pad_token_id=2)
# mamba-1.4b's shape (state-spaces/mamba-1.4b-hf): 48 Mamba1 layers of 2048, state 16.
MAMBA_1_4B = dict(vocab_size=50280, hidden_size=2048, num_hidden_layers=48, state_size=16,
                  conv_kernel=4, expand=2, time_step_rank="auto", tie_word_embeddings=True,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
# Zamba2-1.2B-like: 38 Mamba2 layers of 2048 (64 heads of 64, state 64), every sixth one
# first running the one shared transformer block (32 heads of 128 over [x, embeddings],
# rotary, an MLP of 8192 with rank-128 adapters per use).
ZAMBA2_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                 num_hidden_layers=38, num_attention_heads=32, num_key_value_heads=32,
                 n_mamba_heads=64, mamba_d_state=64, mamba_ngroups=1, mamba_d_conv=4,
                 mamba_expand=2, chunk_size=256, num_mem_blocks=1, adapter_rank=128,
                 use_shared_attention_adapter=False, use_mem_rope=True,
                 layers_block_type=["hybrid" if i % 6 == 5 else "linear_attention"
                                    for i in range(38)],
                 tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 bos_token_id=0, eos_token_id=1, pad_token_id=2)
# KimiLinear-shaped: 20 layers of 2048, Kimi delta attention (16 heads of 128, a float32
# state of 1 MiB a layer and sequence) with latent attention every fourth layer (16
# heads, a latent of 512 + 64 shared features, no positions); a dense first layer, then
# 16 experts of 384 (4 per token) and a shared one: about 1.2B parameters.
KIMI_LINEAR_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=4096,
                      moe_intermediate_size=384, num_hidden_layers=20, num_attention_heads=16,
                      num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                      qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                      num_local_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                      n_group=1, topk_group=1, linear_attn_config={
                          "head_dim": 128, "num_heads": 16, "short_conv_kernel_size": 4,
                          "full_attn_layers": [i + 1 for i in range(20) if i % 4 == 3],
                          "kda_layers": [i + 1 for i in range(20) if i % 4 != 3]},
                      tie_word_embeddings=False, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, pad_token_id=2)
SHAPES = {"bamba": ("BambaConfig", "BambaForCausalLM", BAMBA_1B),
          "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", KIMI_LINEAR_1B),
          "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", ZAMBA2_1B),
          "mamba": ("MambaConfig", "MambaForCausalLM", MAMBA_1_4B),
          "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5_1B),
          "jamba": ("JambaConfig", "JambaForCausalLM", JAMBA_1B)}


def write_checkpoint(out: Path, arch: str) -> Path:
    """transformers' own model of SHAPES[arch] with its random init, in bf16."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, architecture, shape = SHAPES[arch]
    config = getattr(transformers, config_class)(**shape)
    config.architectures = [architecture]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    write_wordlevel_tokenizer(out, shape["vocab_size"])
    del model
    torch.cuda.empty_cache()
    return out


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter once, and a shared block's
    (Zamba2's) weights once more for each further layer that runs it (a block is
    hundreds of MB: it does not stay in L2 from one use to the next). Adapters are per
    use already."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = getattr(model.model, "shared_blocks", None)
    if blocks is None:
        return total
    uses = [0] * len(blocks)
    for layer in model.model.layers:
        if hasattr(layer, "block_index"):
            uses[layer.block_index] += 1
    for block, count in zip(blocks, uses):
        shared = sum(p.numel() * p.element_size() for name, p in block.named_parameters()
                     if "adapter_list" not in name)
        total += max(0, count - 1) * shared
    return total


def cache_bytes(model: torch.nn.Module, dtype: torch.dtype) -> tuple[int, int]:
    """(KV bytes per token, state bytes per sequence) of model's layers, from the cache
    spec each declares."""
    from spindle.cache.spec import AttentionCacheSpec

    kv_per_token = state_per_seq = 0
    for module in model.modules():
        if not hasattr(module, "cache_spec"):
            continue
        spec = module.cache_spec(dtype)
        if isinstance(spec, AttentionCacheSpec):
            kv_per_token += spec.block_bytes(1)
        else:
            state_per_seq += spec.slot_bytes()
    return kv_per_token, state_per_seq


def roofline_seconds(prompts, outputs, weight_bytes, kv_per_token, state_per_seq, bandwidth):
    total = 0
    for step in range(1, max(outputs) + 1):
        live = [(p, o) for p, o in zip(prompts, outputs) if o >= step]
        context = sum(len(p) + step for p, _ in live)
        total += weight_bytes + context * kv_per_token + len(live) * state_per_seq
    return total / bandwidth


def matmul_flops() -> float:
    """Dense bf16 matmul throughput (FLOP/s, median of 10) on a large square GEMM."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * 8192**3 / times[len(times) // 2]


def matmul_params(params: float, shape: dict) -> float:
    """Parameters a prompt token multiplies through: all but the input embedding and the
    LM head (a prefill computes logits for its last token only)."""
    return params - 2 * shape["vocab_size"] * shape["hidden_size"]


def full_floor_seconds(prompts, outputs, weight_bytes, kv_per_token, state_per_seq, bandwidth,
                       flops, params):
    """A tighter floor than the roofline: every decode step also writes each live
    sequence's state back (as it must), and the prompts' matmuls (2 FLOP per parameter
    per prompt token) run at the measured dense peak. The parts are added because
    these kernels run one after another."""
    decode = roofline_seconds(prompts, outputs, weight_bytes, kv_per_token, 2 * state_per_seq,
                              bandwidth)
    return decode + 2 * params * sum(len(p) for p in prompts) / flops


def profile_kernels(fn):
    """fn() under torch's profiler: the GPU time of each kernel name, descending, and
    the total (compared with the wall time it says how busy the GPU was)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time_total / 1e6
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return out, {"gpu_busy_s": sum(totals.values()), "top": ranked[:40]}


def run(args) -> dict:
    import transformers
    import triton

    from spindle import LLM

    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "triton": triton.__version__, "arch": args.arch,
                    "shape": SHAPES[args.arch][2]}
    bandwidth = copy_bandwidth()
    result["copy_bandwidth_TBps"] = bandwidth / 1e12
    flops = matmul_flops()
    result["matmul_TFLOPs"] = flops / 1e12
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / f"{args.arch}-1b-shape", args.arch)
        start = time.perf_counter()
        llm = LLM(str(path), dtype="bfloat16", max_model_len=4096, max_num_seqs=args.num_seqs,
                  enable_prefix_caching=False, enforce_eager=args.enforce_eager)
        result["startup_s"] = time.perf_counter() - start
        result["startup_table"] = llm.engine.core.startup_table
        runner = llm.engine.core.executor.worker.runner
        weight_bytes = weight_bytes_read(runner.model)
        result["weight_bytes"] = weight_bytes
        result["params_b"] = sum(p.numel() for p in runner.model.parameters()) / 1e9
        # (the parameters a token multiplies through: shared blocks once per use)
        result["params_used_b"] = weight_bytes / 2 / 1e9
        kv_per_token, state_per_seq = cache_bytes(runner.model, torch.bfloat16)
        result.update(kv_bytes_per_token=kv_per_token, state_bytes_per_seq=state_per_seq)

        result["batch1_tok_s"] = batch1_decode(llm)[0]
        result["batch1_bound_tok_s"] = bandwidth / (weight_bytes + state_per_seq
                                                    + 768 * kv_per_token)

        prompts, outputs = nano_workload(args.num_seqs)
        params = nano_params(outputs)
        llm.generate(prompts[:16], params[:16], use_tqdm=False)  # warm-up call
        timer = StepTimer(llm.engine)
        start = time.perf_counter()
        if args.profile:
            outs, result["kernels"] = profile_kernels(lambda: llm.generate(prompts, params,
                                                                         use_tqdm=False))
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        floor = roofline_seconds(prompts, outputs, weight_bytes, kv_per_token, state_per_seq,
                                 bandwidth)
        full_floor = full_floor_seconds(prompts, outputs, weight_bytes, kv_per_token,
                                        state_per_seq, bandwidth, flops,
                                        matmul_params(result["params_used_b"] * 1e9,
                                                      SHAPES[args.arch][2]))
        result.update(full_floor_s=full_floor, ratio_to_full_floor=full_floor / seconds)
        result.update(nano_output_tokens=produced, nano_seconds=seconds,
                      nano_tok_s=produced / seconds, roofline_s=floor,
                      roofline_tok_s=produced / floor, ratio_to_roofline=floor / seconds,
                      steps=timer.steps, execute_s=timer.execute,
                      host_s=timer.host - timer.execute)
        llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--arch", choices=sorted(SHAPES), default="bamba",
                        help="the checkpoint's shape (default: bamba)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="profile the nano run's kernels (slows it down)")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(result["startup_table"])
    rows = [("parameters (B)", f"{result['params_b']:.2f}"),
            ("startup (s)", f"{result['startup_s']:.1f}"),
            ("copy bandwidth (TB/s)", f"{result['copy_bandwidth_TBps']:.2f}"),
            ("batch-1 decode (tok/s)", f"{result['batch1_tok_s']:.0f}"),
            ("batch-1 bound (tok/s)", f"{result['batch1_bound_tok_s']:.0f}"),
            ("nano (tok/s)", f"{result['nano_tok_s']:.0f}"),
            ("nano roofline (tok/s)", f"{result['roofline_tok_s']:.0f}"),
            ("ratio to roofline", f"{result['ratio_to_roofline']:.2f}"),
            ("matmul peak (TFLOP/s)", f"{result['matmul_TFLOPs']:.0f}"),
            ("floor with writes+prefill (s)", f"{result['full_floor_s']:.2f}"),
            ("ratio to that floor", f"{result['ratio_to_full_floor']:.2f}"),
            ("steps / host s / execute s",
             f"{result['steps']} / {result['host_s']:.1f} / {result['execute_s']:.1f}")]
    if "kernels" in result:
        print(f"GPU busy {result['kernels']['gpu_busy_s']:.2f} s of {result['nano_seconds']:.2f} s")
        for name, secs in result["kernels"]["top"]:
            print(f"{secs:8.3f} s  {name[:90]}")
    print(f"{f'hybrid ({args.arch} ~1B shape), bf16':<32}{'value':>14}")
    for name, value in rows:
        print(f"{name:<32}{value:>14}")


if __name__ == "__main__":
    main()
