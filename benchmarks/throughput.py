"""GPU throughput: the "nano" workload and batch-1 decode on a Qwen3-0.6B-shaped model.

Measures the device's copy bandwidth in the same run and computes the roofline the
way ../shared/BENCHMARKS.md defines it (every decode step reads all weights once
and the KV cache of every live sequence once). Prints the startup table, a result
table, and writes JSON with --json.

    python benchmarks/throughput.py [--json out.json] [--skip-nano] [--num-seqs 256]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, tie_word_embeddings=True)


def write_random_checkpoint(out: Path, shape: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A Qwen3ForCausalLM checkpoint with random weights and a word-level tokenizer
    covering the whole vocabulary (throughput does not depend on weight values)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    out.mkdir(parents=True, exist_ok=True)
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rms_norm_eps=1e-6,
                  max_position_embeddings=40960, rope_theta=1000000.0, hidden_act="silu",
                  attention_bias=False, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1,
                  **shape)
    (out / "config.json").write_text(json.dumps(config))
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    nq, nkv = shape["num_attention_heads"], shape["num_key_value_heads"]

    def rand(*size, std=0.02):
        return (torch.randn(size, generator=gen, device="cuda") * std).to(dtype).cpu()

    weights = {"model.embed_tokens.weight": rand(shape["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=dtype)}
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(nq * d, h), p + "self_attn.k_proj.weight": rand(nkv * d, h),
            p + "self_attn.v_proj.weight": rand(nkv * d, h), p + "self_attn.o_proj.weight": rand(h, nq * d),
            p + "self_attn.q_norm.weight": torch.ones(d, dtype=dtype),
            p + "self_attn.k_norm.weight": torch.ones(d, dtype=dtype),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)})
    save_file(weights, str(out / "model.safetensors"))
    vocab = {f"t{n}": n for n in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t1", "bos_token": "t0"}))
    return out


def nano_workload(num_seqs: int = 256) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py shape: all prompts are drawn first, then all output lengths."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
               for _ in range(num_seqs)]
    outputs = [rng.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, outputs


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del src, dst
    return 2 * 2 * 2**30 / times[len(times) // 2]


def roofline_seconds(prompts, outputs, weight_bytes: int, kv_bytes_per_token: int,
                     bandwidth: float) -> float:
    """Sum over decode steps of (all weights + KV of every live sequence) / bandwidth."""
    total = 0
    for step in range(1, max(outputs) + 1):
        live_context = sum(len(p) + step for p, o in zip(prompts, outputs) if o >= step)
        total += weight_bytes + live_context * kv_bytes_per_token
    return total / bandwidth


class StepTimer:
    """Wraps LLMEngine.step to split wall time into host work and waiting on the GPU."""

    def __init__(self, engine) -> None:
        self.host = 0.0
        self.execute = 0.0
        self.steps = 0
        core = engine.core
        original_execute = core.executor.execute_model

        def timed_execute(sched):
            start = time.perf_counter()
            out = original_execute(sched)
            self.execute += time.perf_counter() - start
            return out

        core.executor.execute_model = timed_execute
        original_step = engine.step

        def timed_step():
            start = time.perf_counter()
            out = original_step()
            self.host += time.perf_counter() - start
            self.steps += 1
            return out

        engine.step = timed_step


def graph_replay_ms(llm) -> dict:
    """GPU time of one decode-graph replay per captured size of interest (the floor
    of a decode step's model forward, without any host work)."""
    runner = llm.engine.core.executor.worker.runner.graph_runner
    if runner is None:
        return {}
    times = {}
    for size in (1, 64, runner.max_batch):
        size = min(s for s in runner.sizes if s >= size)
        graph = runner.graphs[size]
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        end.synchronize()
        times[f"graph_replay_ms_b{size}"] = start.elapsed_time(end) / 50
    return times


def profiled(enabled: bool, out_path: Path | None, label: str):
    """cProfile the block when enabled; write the top functions to out_path."""
    import contextlib
    import cProfile
    import io
    import pstats

    @contextlib.contextmanager
    def block():
        if not enabled:
            yield
            return
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            yield
        finally:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(35)
            if out_path is not None:
                with open(out_path, "a") as f:
                    f.write(f"===== {label}\n{text.getvalue()}\n")

    return block()


_STARTUP_SCRIPT = """
import time, sys
start = time.perf_counter()
from spindle import LLM
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=4096, max_num_seqs=256)
ready = time.perf_counter() - start
print("STARTUP", ready)
print(llm.engine.core.startup_table)
llm.shutdown()
"""


def measure_startup(path: Path) -> dict:
    """Process start to ready, in a fresh interpreter: cold (first run on this machine:
    Triton compiles) and warm (Triton's on-disk kernel cache filled)."""
    import subprocess
    import sys

    result = {}
    for label in ("cold", "warm"):
        proc = subprocess.run([sys.executable, "-c", _STARTUP_SCRIPT, str(path)],
                              capture_output=True, text=True, timeout=240)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("STARTUP")]
        result[f"startup_{label}_s"] = float(lines[0].split()[1]) if lines else float("nan")
        result[f"startup_{label}_table"] = proc.stdout.split("\n", 1)[-1] + proc.stderr[-2000:]
    return result


def run(args) -> dict:
    from spindle import LLM, SamplingParams

    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__}
    import transformers
    import triton

    result.update(transformers=transformers.__version__, triton=triton.__version__)
    bandwidth = copy_bandwidth()
    result["copy_bandwidth_TBps"] = bandwidth / 1e12
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "qwen3-0.6b-shape", QWEN3_06B)
        if args.startup:
            result.update(measure_startup(path))
        start = time.perf_counter()
        llm = LLM(str(path), dtype="bfloat16", max_model_len=4096,
                  max_num_seqs=args.num_seqs, max_num_batched_tokens=args.batched_tokens,
                  enforce_eager=args.enforce_eager, enable_prefix_caching=False)
        result["startup_s"] = time.perf_counter() - start
        result["startup_table"] = llm.engine.core.startup_table
        weight_bytes = sum(p.numel() * p.element_size()
                           for p in llm.engine.core.executor.worker.runner.model.parameters())
        result["weight_bytes"] = weight_bytes
        kv_per_token = (QWEN3_06B["num_hidden_layers"] * 2 * QWEN3_06B["num_key_value_heads"]
                        * QWEN3_06B["head_dim"] * 2)

        # Batch-1 decode: time of 257 tokens minus time of 1, over 256.
        prompt = [random.Random(1).randint(0, 10000) for _ in range(512)]
        greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
        llm.generate([prompt], greedy(8), use_tqdm=False)
        result.update(graph_replay_ms(llm))
        t0 = time.perf_counter()
        llm.generate([prompt], greedy(1), use_tqdm=False)
        t1 = time.perf_counter()
        with profiled(args.profile is not None, args.profile, "batch-1 decode"):
            llm.generate([prompt], greedy(257), use_tqdm=False)
        t2 = time.perf_counter()
        decode_s = (t2 - t1) - (t1 - t0)
        result["batch1_tok_s"] = 256 / decode_s
        result["batch1_bound_tok_s"] = bandwidth / weight_bytes

        if not args.skip_nano:
            prompts, outputs = nano_workload(args.num_seqs)
            params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
                      for o in outputs]
            llm.generate(prompts[:16], params[:16], use_tqdm=False)  # warm-up call
            timer = StepTimer(llm.engine)
            start = time.perf_counter()
            with profiled(args.profile is not None, args.profile, "nano"):
                outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            floor = roofline_seconds(prompts, outputs, weight_bytes, kv_per_token, bandwidth)
            result.update(nano_output_tokens=produced, nano_seconds=seconds,
                          nano_tok_s=produced / seconds, roofline_s=floor,
                          roofline_tok_s=produced / floor, ratio_to_roofline=floor / seconds,
                          steps=timer.steps, execute_s=timer.execute,
                          host_s=timer.host - timer.execute,
                          vs_transformers_anchor=produced / seconds / 730.0)
        llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-nano", action="store_true")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--batched-tokens", type=int, default=8192)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--startup", action="store_true",
                        help="also time process start to ready in fresh interpreters (cold, warm)")
    parser.add_argument("--profile", type=Path, help="cProfile the timed runs into this file "
                        "(slows them: use for where the host time goes, not for figures)")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(result.pop("startup_table"))
    for label in ("cold", "warm"):
        table = result.pop(f"startup_{label}_table", None)
        if table:
            print(f"--- fresh process, {label} ---\n{table}")
    print()
    for key, value in result.items():
        print(f"{key:<24}{value:.4g}" if isinstance(value, float) else f"{key:<24}{value}")


if __name__ == "__main__":
    main()
