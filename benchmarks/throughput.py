"""GPU throughput: the "nano" workload and batch-1 decode on a Qwen3-0.6B-shaped model.

Measures the device's copy bandwidth in the same run and computes the roofline the
way ../shared/BENCHMARKS.md defines it (every decode step reads all weights once
and the KV cache of every live sequence once). Prints the startup table, a result
table, and writes JSON with --json.

    python benchmarks/throughput.py [--json out.json] [--skip-nano] [--num-seqs 256]
    python benchmarks/throughput.py --startup-only [--importtime FILE]   # startup alone
    python benchmarks/throughput.py --nano-first    # nano as the engine's first call

--startup (and --startup-only) also time `LLM(...)` from a fresh interpreter to ready,
phase by phase, next to its worker-stage table: with an empty Triton cache and start
cache (cold: every kernel compiles, transformers reads the config and tokenizer), with
the caches that run filled (warm: its kernel plan too; no transformers), and warm with
the start cache off (SPINDLE_START_CACHE=0). That
checkpoint has a Qwen3-style tokenizer (byte-level BPE of Qwen's size, Qwen2Tokenizer),
which is what a real start loads; the throughput runs keep the cheaper word-level one.
The fresh interpreters may write bytecode (PYTHONDONTWRITEBYTECODE, which some images
set, is dropped for them): a module without it is compiled in the cold start and read
in the warm one, as after a pip install, which writes it.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

import gpu_timing

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, tie_word_embeddings=True)


# config.json fields besides the shape, per architecture. (transformers_version as in the
# real Qwen3-0.6B config: without one, transformers takes any tokenizer for a possibly
# broken Mistral one and warns.)
ARCHITECTURES = {
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rms_norm_eps=1e-6,
                  max_position_embeddings=40960, rope_theta=1000000.0,
                  transformers_version="4.51.0"),
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
                  max_position_embeddings=8192, rope_theta=500000.0, mlp_bias=False),
}


def write_random_checkpoint(out: Path, shape: dict, dtype: torch.dtype = torch.bfloat16,
                            model_type: str = "qwen3") -> Path:
    """A Qwen3ForCausalLM (or LlamaForCausalLM) checkpoint with random weights and a
    word-level tokenizer covering the whole vocabulary (throughput does not depend on
    weight values)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = dict(ARCHITECTURES[model_type], hidden_act="silu", attention_bias=False,
                  torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, **shape)
    (out / "config.json").write_text(json.dumps(config))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    nq, nkv = shape["num_attention_heads"], shape["num_key_value_heads"]

    def rand(*size, std=0.02):
        return (torch.randn(size, generator=gen, device=device) * std).to(dtype).cpu()

    def ones(n):
        return torch.ones(n, dtype=dtype)

    weights = {"model.embed_tokens.weight": rand(shape["vocab_size"], h),
               "model.norm.weight": ones(h)}
    if not shape.get("tie_word_embeddings", True):
        weights["lm_head.weight"] = rand(shape["vocab_size"], h)
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(nq * d, h), p + "self_attn.k_proj.weight": rand(nkv * d, h),
            p + "self_attn.v_proj.weight": rand(nkv * d, h), p + "self_attn.o_proj.weight": rand(h, nq * d),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h)})
        if model_type == "qwen3":
            weights.update({p + "self_attn.q_norm.weight": ones(d),
                            p + "self_attn.k_norm.weight": ones(d)})
    save_file(weights, str(out / "model.safetensors"))
    write_wordlevel_tokenizer(out, shape["vocab_size"])
    return out


def write_wordlevel_tokenizer(out: Path, vocab_size: int) -> None:
    """Token "t<n>" for every id n; decoding joins words with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{n}": n for n in range(vocab_size)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t1", "bos_token": "t0"}))


def nano_workload(num_seqs: int = 256) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py shape: all prompts are drawn first, then all output lengths."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
               for _ in range(num_seqs)]
    outputs = [rng.randint(100, 1024) for _ in range(num_seqs)]
    return prompts, outputs


def batch1_decode(llm, prompt_len: int = 512):
    """Batch-1 decode tok/s after a prompt_len-token prompt: the time of 257 new tokens
    minus the time of 1, over 256 (a warm-up call first). Returns (tok/s, the outputs
    of the 257-token run)."""
    from spindle import SamplingParams

    prompt = [random.Random(1).randint(0, 10000) for _ in range(prompt_len)]
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate([prompt], greedy(8), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate([prompt], greedy(1), use_tqdm=False)
    t1 = time.perf_counter()
    outputs = llm.generate([prompt], greedy(257), use_tqdm=False)
    t2 = time.perf_counter()
    return 256 / ((t2 - t1) - (t1 - t0)), outputs


def nano_params(outputs: list[int]):
    from spindle import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outputs]


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (median of 20):
    the roofline's bandwidth."""
    return gpu_timing.copy_bandwidth(2 << 30)


def kv_bytes_per_token(shape: dict) -> int:
    """Bytes of bf16 KV cache one token holds across all layers of a dense model."""
    return shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2


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
    of a decode step's model forward, without any host work; the LM head included
    unless SPINDLE_GRAPH_LOGITS=0)."""
    runner = llm.engine.core.executor.worker.runner.graph_runner
    if runner is None:
        return {}
    times = {}
    for size in (1, 64, runner.max_batch):
        size = min(s for s in runner.sizes if s >= size)
        times[f"graph_replay_ms_b{size}"] = gpu_timing.replay_ms(runner.graphs[1, size, False])
    runner.forget_device_inputs()  # (an advancing graph moved its inputs on each replay)
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


QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> "
    "<|box_start|> <|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> "
    "<|vision_pad|> <|image_pad|> <|video_pad|>").split()
QWEN3_ADDED_TOKENS = (
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> "
    "<|repo_name|> <|file_sep|> <tool_response> </tool_response> <think> </think>").split()
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def write_qwen3_style_tokenizer(out: Path, num_tokens: int = 151643) -> None:
    """A tokenizer laid out like Qwen3's, for what a start loads: byte-level BPE with
    Qwen's pre-tokenizer, 151,643 tokens and 151,387 merges, its 26 added tokens,
    vocab.json and merges.txt beside tokenizer.json, class Qwen2Tokenizer. The merges
    are synthetic (each token is an earlier one plus a byte), not trained."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors)

    from spindle.tools.tiny_model import PRETOKENIZE_REGEX

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens, merges = list(alphabet), []
    vocab = {t: n for n, t in enumerate(tokens)}
    for base in tokens:  # grows while it is walked
        for byte in alphabet[:40]:
            if len(tokens) == num_tokens:
                break
            vocab[base + byte] = len(tokens)
            tokens.append(base + byte)
            merges.append((base, byte))
        if len(tokens) == num_tokens:
            break
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in QWEN3_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    added = {str(num_tokens + n): {"content": t, "lstrip": False, "normalized": False,
                                   "rstrip": False, "single_word": False,
                                   "special": t in QWEN3_SPECIAL_TOKENS}
             for n, t in enumerate(QWEN3_SPECIAL_TOKENS + QWEN3_ADDED_TOKENS)}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}, indent=2))


def startup_checkpoint(weights_from: Path, out: Path) -> Path:
    """The benchmark checkpoint (its weights linked, not copied) with a Qwen3-style tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text((weights_from / "config.json").read_text())
    (out / "model.safetensors").symlink_to((weights_from / "model.safetensors").resolve())
    write_qwen3_style_tokenizer(out)
    return out


# Runs in a fresh interpreter: times `from spindle import LLM` and `LLM(...)` phase by
# phase (wrapping the engine's own steps), then prints one JSON line and the stage table.
_STARTUP_SCRIPT = r"""
import json, sys, time
launched = float(sys.argv[2])  # the parent's time.time() just before it started us
script_start, start = time.time(), time.perf_counter()
from spindle import LLM
phases = {"interpreter start": script_start - launched,
          "from spindle import LLM": time.perf_counter() - start}
if sys.argv[3] == "warm-hf":  # as a script that made its checkpoint with transformers
    start = time.perf_counter()
    from transformers import AutoConfig, AutoTokenizer
    phases["script imports transformers"] = time.perf_counter() - start
import spindle.config as config_module
import spindle.engine.llm_engine as engine_module

def timed(owner, name, label):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            phases[label] = time.perf_counter() - t
    setattr(owner, name, wrapper)

timed(config_module.EngineArgs, "create_engine_config", "create_engine_config")
timed(engine_module, "EngineCore", "EngineCore (executor + worker stages)")
timed(engine_module, "load_tokenizer", "tokenizer load")
start = time.perf_counter()
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=4096, max_num_seqs=256)
phases["LLM(...)"] = time.perf_counter() - start
phases["process start -> ready"] = time.time() - launched
stages = sum(r["seconds"] for r in llm.engine.core.executor.lifecycle_reports()[0])
phases["  worker stages (table below)"] = stages
heavy = ("transformers", "triton", "jinja2", "sklearn", "scipy", "fastapi", "ray")
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(heavy))
auto = sorted(m for m in sys.modules  # transformers' auto registry (seconds to import)
              if m.rsplit(".", 1)[-1] in ("configuration_auto", "tokenization_auto",
                                          "modeling_auto"))
print("STARTUP_JSON " + json.dumps({"phases": phases, "loaded": loaded, "auto": auto}))
print(llm.engine.core.startup_table)
llm.shutdown()
"""
_PHASE_ORDER = ("interpreter start", "from spindle import LLM", "script imports transformers",
                "create_engine_config",
                "EngineCore (executor + worker stages)", "  worker stages (table below)",
                "tokenizer load", "LLM(...)",
                "process start -> ready")
_STARTUP_RUNS = (("cold", "cold Triton"), ("warm", "warm Triton"),
                 ("warm-off", "warm, no start cache"), ("warm-hf", "warm, HF imported"))


def measure_startup(path: Path, importtime: Path | None = None) -> dict:
    """Process start to ready, in fresh interpreters: cold (an empty Triton cache: every
    kernel compiles; an empty start cache: the config and tokenizer come through
    transformers), warm (the caches the cold run filled, with its kernel plan),
    warm-off: warm with the start cache off (SPINDLE_START_CACHE=0: transformers'
    config and tokenizer, as before the start cache), and warm-hf: warm, in a script
    that imported transformers before `LLM()` (as one that wrote its checkpoint with
    transformers has)."""
    import os
    import subprocess
    import sys

    result = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache,
               "SPINDLE_START_CACHE_DIR": str(Path(cache) / "spindle-start")}
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # (see the module docstring)
        env.pop("SPINDLE_START_CACHE", None)
        runs = [(label, {**env, "SPINDLE_START_CACHE": "0"} if label == "warm-off" else env)
                for label, _ in _STARTUP_RUNS]
        if importtime is not None:  # one more: -X importtime slows imports down
            runs.append(("importtime", {**env, "PYTHONPROFILEIMPORTTIME": "1"}))
        for label, run_env in runs:
            proc = subprocess.run(
                [sys.executable, "-c", _STARTUP_SCRIPT, str(path), repr(time.time()), label],
                capture_output=True, text=True, timeout=600, env=run_env,
                cwd=Path(__file__).resolve().parent.parent)
            if label == "importtime":
                importtime.write_text("".join(l for l in proc.stderr.splitlines(True)
                                              if l.startswith("import time:")))
                continue
            lines = proc.stdout.splitlines()
            found = [l for l in lines if l.startswith("STARTUP_JSON ")]
            if not found:
                result[f"startup_{label}_s"] = float("nan")
                result[f"startup_{label}_table"] = proc.stdout + proc.stderr[-3000:]
                continue
            report = json.loads(found[0].split(" ", 1)[1])
            result[f"startup_{label}_s"] = report["phases"]["process start -> ready"]
            result[f"startup_{label}_phases"] = report["phases"]
            result[f"startup_{label}_loaded"] = report["loaded"] + report["auto"]
            result[f"startup_{label}_table"] = "\n".join(lines[lines.index(found[0]) + 1:])
    return result


def format_startup(result: dict) -> str:
    """The phase table of both fresh starts, then each one's worker-stage table."""
    runs = [(l, title) for l, title in _STARTUP_RUNS if f"startup_{l}_phases" in result]
    labels = [l for l, _ in runs]
    lines = ["--- fresh process: `LLM(...)` to ready, Qwen3-0.6B shape (seconds) ---",
             f"{'phase':<40}" + "".join(f"{title:>19}" for _, title in runs)]
    for phase in _PHASE_ORDER:
        lines.append(f"{phase:<40}" + "".join(
            f"{result[f'startup_{l}_phases'].get(phase, float('nan')):>19.3f}" for l in labels))
    for label in labels:
        lines.append(f"imported ({label}): {', '.join(result[f'startup_{label}_loaded'])}")
    for label, title in _STARTUP_RUNS:
        table = result.get(f"startup_{label}_table")
        if table:
            lines.append(f"--- worker stages, fresh process, {title} ---\n{table}")
    return "\n".join(lines)


def run_startup_only(args) -> dict:
    result: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "qwen3-0.6b-shape", QWEN3_06B)
        result.update(measure_startup(startup_checkpoint(path, Path(tmp) / "startup"),
                                      args.importtime))
    return result


def nano_run(llm, args, weight_bytes: int, kv_per_token: int, bandwidth: float,
             warm_up: bool = True) -> dict:
    """The nano workload, timed (after a 16-request warm-up call unless warm_up=False)."""
    from spindle import SamplingParams

    prompts, outputs = nano_workload(args.num_seqs)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)
              for o in outputs]
    if warm_up:
        llm.generate(prompts[:16], params[:16], use_tqdm=False)  # warm-up call
    timer = StepTimer(llm.engine)
    start = time.perf_counter()
    with profiled(args.profile is not None, args.profile, "nano"):
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    floor = roofline_seconds(prompts, outputs, weight_bytes, kv_per_token, bandwidth)
    return dict(nano_output_tokens=produced, nano_seconds=seconds,
                nano_tok_s=produced / seconds, roofline_s=floor,
                roofline_tok_s=produced / floor, ratio_to_roofline=floor / seconds,
                steps=timer.steps, execute_s=timer.execute, host_s=timer.host - timer.execute,
                vs_transformers_anchor=produced / seconds / 730.0)


def engine_after_one_request(path: Path):
    """(llm, its CUDA graph runner): an engine on the checkpoint at path with this
    script's settings, after one_request (its graphs captured and replayed). The caller
    shuts the engine down."""
    from spindle import LLM

    llm = LLM(str(path), dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
              max_num_batched_tokens=8192, enable_prefix_caching=False)
    one_request(llm)
    return llm, llm.engine.core.executor.worker.runner.graph_runner


def one_request(llm) -> None:
    """One greedy request of 8 tokens on a 512-token prompt (the same every call)."""
    from spindle import SamplingParams

    prompt = [random.Random(1).randint(0, 10000) for _ in range(512)]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)


def checkpoint(path: Path) -> Path:
    """The Qwen3-0.6B-shaped random checkpoint at path: written there unless an
    earlier run left it (its config.json and weights)."""
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    return write_random_checkpoint(path, QWEN3_06B)


def run(args) -> dict:
    from spindle import LLM, SamplingParams

    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "batch_invariant": args.batch_invariant,
                    "quantization": args.quantization}
    import transformers
    import triton

    result.update(transformers=transformers.__version__, triton=triton.__version__)
    bandwidth = copy_bandwidth()
    result["copy_bandwidth_TBps"] = bandwidth / 1e12
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.checkpoint or Path(tmp) / "qwen3-0.6b-shape")
        if args.startup:
            result.update(measure_startup(startup_checkpoint(path, Path(tmp) / "startup"),
                                          args.importtime))
        start = time.perf_counter()
        llm = LLM(str(path), dtype="bfloat16", max_model_len=4096,
                  max_num_seqs=args.num_seqs, max_num_batched_tokens=args.batched_tokens,
                  enforce_eager=args.enforce_eager, enable_prefix_caching=False,
                  batch_invariant=args.batch_invariant,
                  quantization=args.quantization, block_size=args.block_size)
        result["startup_s"] = time.perf_counter() - start
        result["startup_table"] = llm.engine.core.startup_table
        weight_bytes = sum(p.numel() * p.element_size()
                           for p in llm.engine.core.executor.worker.runner.model.parameters())
        result["weight_bytes"] = weight_bytes
        kv_per_token = kv_bytes_per_token(QWEN3_06B)

        if args.nano_first:
            result.update(nano_run(llm, args, weight_bytes, kv_per_token, bandwidth,
                                   warm_up=False))
            llm.shutdown()
            return result
        # Batch-1 decode: time of 257 tokens minus time of 1, over 256.
        prompt = [random.Random(1).randint(0, 10000) for _ in range(512)]
        greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
        llm.generate([prompt], greedy(8), use_tqdm=False)
        result.update(graph_replay_ms(llm))
        t0 = time.perf_counter()
        llm.generate([prompt], greedy(1), use_tqdm=False)
        t1 = time.perf_counter()
        with profiled(args.profile is not None, args.profile, "batch-1 decode"):
            batch1 = llm.generate([prompt], greedy(257), use_tqdm=False)
        t2 = time.perf_counter()
        decode_s = (t2 - t1) - (t1 - t0)
        result["batch1_tok_s"] = 256 / decode_s
        # The greedy tokens, to compare runs with different kernels (first 32 shown).
        result["batch1_tokens_head"] = list(batch1[0].outputs[0].token_ids[:32])
        result["batch1_tokens_hash"] = hash(tuple(batch1[0].outputs[0].token_ids))
        result["batch1_bound_tok_s"] = bandwidth / weight_bytes

        if not args.skip_nano:
            result.update(nano_run(llm, args, weight_bytes, kv_per_token, bandwidth))
        llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-nano", action="store_true")
    parser.add_argument("--checkpoint", type=Path,
                        help="keep the random checkpoint in this folder, and reuse it if "
                        "an earlier run left it there (default: a temporary one)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--batched-tokens", type=int, default=8192)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV cache page (the engine's block_size)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the engine's batch_invariant mode (fixed-order numerics)")
    parser.add_argument("--quantization", choices=["fp8"],
                        help="the engine's quantization (weight bytes in the roofline follow)")
    parser.add_argument("--nano-first", action="store_true",
                        help="the nano workload as the engine's first call: no batch-1 run "
                        "and no warm-up call before it (what a user's first run sees)")
    parser.add_argument("--startup", action="store_true",
                        help="also time process start to ready in fresh interpreters (cold, warm)")
    parser.add_argument("--startup-only", action="store_true",
                        help="only the fresh-process startup measurement (no throughput runs)")
    parser.add_argument("--importtime", type=Path,
                        help="with --startup: one more fresh start under -X importtime, its "
                        "report written to this file")
    parser.add_argument("--profile", type=Path, help="cProfile the timed runs into this file "
                        "(slows them: use for where the host time goes, not for figures)")
    args = parser.parse_args()
    result = run_startup_only(args) if args.startup_only else run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if "startup_table" in result:
        print(result.pop("startup_table"))
    if any(key.startswith("startup_cold") for key in result):
        print(format_startup(result))
    for key in [k for k in result if k.startswith("startup_") and not k.endswith("_s")]:
        del result[key]  # (printed above)
    print()
    for key, value in result.items():
        print(f"{key:<24}{value:.4g}" if isinstance(value, float) else f"{key:<24}{value}")


if __name__ == "__main__":
    main()
