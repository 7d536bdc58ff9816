"""Tensor-parallel scaling on one host: the nano workload on a Llama-3-8B-shaped
checkpoint (random bf16 weights) with the mp executor at each --tp size.

Each size runs in a fresh process, so that every engine starts on empty devices.
The workload is the nano workload of benchmarks/throughput.py (same seed and lengths).
Prints tok/s per size and the scaling efficiency, (tok/s at n) / (n x tok/s at 1).
--json writes the figures.

    python benchmarks/tp_scaling.py --tp 1 2 [--num-seqs 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import nano_workload  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=14336, tie_word_embeddings=False)


def write_llama_checkpoint(out: Path, shape: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A LlamaForCausalLM checkpoint with random weights (drawn on the GPU, written
    one layer per safetensors shard) and a word-level tokenizer over the vocabulary."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
                  max_position_embeddings=8192, rope_theta=500000.0, hidden_act="silu",
                  attention_bias=False, mlp_bias=False, torch_dtype="bfloat16",
                  bos_token_id=0, eos_token_id=1, **shape)
    (out / "config.json").write_text(json.dumps(config))
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    nq, nkv, vocab = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]

    def rand(*size):
        return (torch.randn(size, generator=gen, device="cuda") * 0.02).to(dtype).cpu()

    shards: list[dict] = [{"model.embed_tokens.weight": rand(vocab, h),
                           "lm_head.weight": rand(vocab, h),
                           "model.norm.weight": torch.ones(h, dtype=dtype)}]
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shards.append({
            p + "self_attn.q_proj.weight": rand(nq * d, h), p + "self_attn.k_proj.weight": rand(nkv * d, h),
            p + "self_attn.v_proj.weight": rand(nkv * d, h), p + "self_attn.o_proj.weight": rand(h, nq * d),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)})
    weight_map = {}
    for n, shard in enumerate(shards):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name))
        weight_map.update({key: name for key in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tok = Tokenizer(models.WordLevel({f"t{n}": n for n in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t1", "bos_token": "t0"}))
    return out


_RUN_ONE = """
import json, sys, time
sys.path.insert(0, sys.argv[4])
from throughput import nano_workload
from spindle import LLM, SamplingParams

path, tp, num_seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
start = time.perf_counter()
llm = LLM(path, dtype="bfloat16", tensor_parallel_size=tp, max_model_len=4096,
          max_num_seqs=256, max_num_batched_tokens=8192, enable_prefix_caching=False)
startup = time.perf_counter() - start
prompts, outputs = nano_workload(num_seqs)
params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outputs]
llm.generate(prompts[:16], params[:16], use_tqdm=False)  # warm-up call
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - start
produced = sum(len(o.outputs[0].token_ids) for o in outs)
print("RESULT " + json.dumps(dict(tp=tp, startup_s=startup, seconds=seconds,
                                  output_tokens=produced, tok_s=produced / seconds)))
llm.shutdown()
"""


def run_size(path: Path, tp: int, num_seqs: int, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-c", _RUN_ONE, str(path), str(tp), str(num_seqs),
                           str(Path(__file__).resolve().parent)],
                          capture_output=True, text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        return {"tp": tp, "error": (proc.stdout + proc.stderr)[-3000:]}
    return json.loads(lines[0][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per size")
    parser.add_argument("--checkpoint", type=Path, help="reuse this checkpoint directory")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                    "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                    "shape": "Llama-3-8B", "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None or not (path / "config.json").exists():
            start = time.perf_counter()
            path = write_llama_checkpoint(path or Path(tmp) / "llama3-8b-shape", LLAMA3_8B)
            result["checkpoint_write_s"] = time.perf_counter() - start
        torch.cuda.empty_cache()
        for tp in args.tp:
            result["runs"].append(run_size(path, tp, args.num_seqs, args.timeout))
            print(json.dumps(result["runs"][-1])[:3000], flush=True)
    base = next((r["tok_s"] for r in result["runs"] if r.get("tp") == 1 and "tok_s" in r), None)
    print(f"\n{'TP':>3} {'tok/s':>10} {'seconds':>9} {'startup s':>10} {'efficiency':>11}")
    for r in result["runs"]:
        if "tok_s" not in r:
            print(f"{r['tp']:>3}  failed (see JSON)")
            continue
        r["efficiency"] = r["tok_s"] / (r["tp"] * base) if base else None
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
        print(f"{r['tp']:>3} {r['tok_s']:>10.0f} {r['seconds']:>9.1f} {r['startup_s']:>10.1f} {eff:>11}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
