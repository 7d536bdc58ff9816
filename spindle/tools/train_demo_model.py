"""Train spindle's demo model: a small Llama that writes Python, learned from the
standard library's own source (a corpus every machine with Python has).

Pipeline (deterministic for a given seed and Python installation):

1. Corpus: the ``.py`` files of the running interpreter's standard library, sorted by
   relative path; test suites, ``site-packages`` and IDLE are left out. Every
   ``--holdout-every``-th file (in that order) is the held-out split.
2. Tokenizer: byte-level BPE (``tokenizers``), ``--vocab-size`` tokens, trained on the
   training split only, with the special tokens of :mod:`spindle.tools.tiny_model`
   (``<|bos|>``, ``<|eos|>``, ``<|pad|>``, ChatML markers).
3. Model: a Llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention, tied
   embeddings) written here in plain PyTorch; AdamW, linear warm-up then cosine decay
   over ``--steps``; float32 arithmetic on every device by default, so a GPU rerun
   follows the shipped CPU run (``--precision bf16`` trades that for speed on CUDA).
   Batches are random windows
   of the token stream (each file is ``<|bos|> source <|eos|>``) drawn from a seeded
   generator.
4. Output: a standard Hugging Face checkpoint directory (config.json,
   generation_config.json, model.safetensors in float16 (``--dtype``; spindle's
   ``dtype="auto"`` computes float16 checkpoints in float32 on the CPU), tokenizer.json,
   tokenizer_config.json) that ``transformers`` loads as ``LlamaForCausalLM``.
   It prints the held-out loss (nats/token and bits per byte) and writes it, with the
   settings, to ``training_summary.json`` in the output directory.

``--minutes`` is a safety cap only: the learning-rate schedule follows ``--steps``, so a
run that hits the cap stops before its schedule ends (it says so).

The shipped model (spindle/demo_model) was made on one CPU thread, with the defaults::

    OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 python -m spindle.tools.train_demo_model \\
        --device cpu --seed 0 --minutes 36 --out spindle/demo_model

and the same settings on a GPU are ``--device cuda``. ``--evaluate DIR`` prints the
held-out loss of an existing checkpoint. docs/demo_model.md has the settings, the
measured loss (3.4147 nats/token held out) and sample completions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from spindle.tools.tiny_model import (BOS_ID, CHAT_TEMPLATE, EOS_ID, IM_END_ID, PAD_ID,
                                      SPECIAL_TOKENS, train_bpe_tokenizer)

# Directory names (anywhere in a file's relative path) left out of the corpus: test
# suites are huge and full of deliberately odd code; site-packages is not the stdlib.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib",
                 "__pycache__", "lib2to3", "turtledemo"}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ROPE_THETA = 10000.0
RMS_EPS = 1e-5


@dataclass
class ModelSettings:
    vocab_size: int = 8192
    hidden_size: int = 192
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 3
    intermediate_size: int = 512
    context: int = 512

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# ---------------------------------------------------------------------- corpus
def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect_corpus(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, source) of the stdlib's .py files, sorted by relative path."""
    root = root or stdlib_dir()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append((rel.as_posix(), text))
    files.sort()
    if not files:
        raise RuntimeError(f"no .py files found under {root}")
    return files


def split_corpus(files: list[tuple[str, str]], holdout_every: int):
    train = [f for i, f in enumerate(files) if i % holdout_every != holdout_every - 1]
    held = [f for i, f in enumerate(files) if i % holdout_every == holdout_every - 1]
    return train, held


# ---------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    """The tiny-model maker's byte-level BPE (transformers' Qwen2-style pipeline)."""
    return train_bpe_tokenizer(texts, vocab_size)


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """<|bos|> text <|eos|> for every text, concatenated (int64)."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------- model
class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return self.weight * x.to(dtype)


def rope_tables(s: ModelSettings, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, s.head_dim, 2, device=device,
                                                  dtype=torch.float32) / s.head_dim))
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # HF's rotate_half layout
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, s: ModelSettings):
        super().__init__()
        self.s = s
        d, hd = s.hidden_size, s.head_dim
        self.input_layernorm = RMSNorm(d)
        self.q_proj = nn.Linear(d, s.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, s.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, s.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(s.num_heads * hd, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d)
        self.gate_proj = nn.Linear(d, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, d, bias=False)

    def forward(self, x, cos, sin):
        s = self.s
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, s.num_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = s.num_heads // s.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DemoLlama(nn.Module):
    def __init__(self, s: ModelSettings):
        super().__init__()
        self.s = s
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            # GPT-2-style: residual output projections shrink with depth.
            scale = 1 / math.sqrt(2 * self.s.num_layers) if name.endswith(("o_proj.weight",
                                                                          "down_proj.weight")) else 1
            nn.init.normal_(p, std=std * scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.s, ids.shape[1], ids.device)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.linear(self.norm(x), self.embed_tokens.weight)  # tied LM head

    def hf_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The weights under transformers' LlamaForCausalLM names (tied head omitted)."""
        return {k: v.detach().to("cpu", dtype).contiguous().clone()
                for k, v in self.hf_state_dict_params().items()}

    def hf_state_dict_params(self) -> dict[str, nn.Parameter]:
        out = {"model.embed_tokens.weight": self.embed_tokens.weight,
               "model.norm.weight": self.norm.weight}
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[pre + f"self_attn.{name}.weight"] = getattr(layer, name).weight
            for name in ("gate_proj", "up_proj", "down_proj"):
                out[pre + f"mlp.{name}.weight"] = getattr(layer, name).weight
            out[pre + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[pre + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        return out


def round_trip(model: DemoLlama, dtype: torch.dtype) -> None:
    """Round the weights to the checkpoint dtype in place (what gets evaluated is what ships)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(p.dtype))


# ---------------------------------------------------------------------- training
def lr_at(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: DemoLlama, stream: torch.Tensor, context: int, max_tokens: int,
             batch: int, device, autocast) -> tuple[float, int]:
    """Mean next-token loss over consecutive, non-overlapping windows of the stream
    (at most max_tokens predicted tokens). Returns (loss, tokens scored)."""
    model.eval()
    n_windows = min((len(stream) - 1) // context, max(1, max_tokens // context))
    total, count = 0.0, 0
    for start in range(0, n_windows, batch):
        idx = torch.arange(start, min(n_windows, start + batch)) * context
        x = torch.stack([stream[i:i + context] for i in idx.tolist()]).to(device)
        y = torch.stack([stream[i + 1:i + 1 + context] for i in idx.tolist()]).to(device)
        with autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1),
                               reduction="sum")
        total += loss.item()
        count += y.numel()
    model.train()
    return total / count, count


def write_checkpoint(out: Path, model: DemoLlama, tokenizer, s: ModelSettings,
                     summary: dict, dtype: str = "float16") -> None:
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size, num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim, max_position_embeddings=s.context, rms_norm_eps=RMS_EPS,
        rope_theta=ROPE_THETA, tie_word_embeddings=True, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, hidden_act="silu",
        attention_bias=False, mlp_bias=False)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    config.save_pretrained(out)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID],
                  "pad_token_id": PAD_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    save_file(model.hf_state_dict(DTYPES[dtype]), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tokenizer.to_str())
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID], "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": s.context,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def load_checkpoint(path: Path) -> tuple[DemoLlama, object]:
    """A checkpoint written by write_checkpoint, back as (float32 DemoLlama, tokenizer)."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    config = json.loads((path / "config.json").read_text())
    s = ModelSettings(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                      num_layers=config["num_hidden_layers"],
                      num_heads=config["num_attention_heads"],
                      num_kv_heads=config["num_key_value_heads"],
                      intermediate_size=config["intermediate_size"],
                      context=config["max_position_embeddings"])
    model = DemoLlama(s)
    names = {id(p): n for n, p in model.hf_state_dict_params().items()}
    state = load_file(str(path / "model.safetensors"))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(state[names[id(p)]].float())
    return model, Tokenizer.from_file(str(path / "tokenizer.json"))


def evaluate_checkpoint(args: argparse.Namespace) -> float:
    """Held-out loss of an existing checkpoint (same corpus split as training)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer = load_checkpoint(Path(args.evaluate))
    model.to(device)
    _, held_files = split_corpus(collect_corpus(), args.holdout_every)
    held_texts = [t for _, t in held_files]
    held_stream = encode_stream(tokenizer, held_texts)
    bytes_per_token = sum(len(t.encode()) for t in held_texts) / len(held_stream)
    import contextlib

    loss, scored = evaluate(model, held_stream, model.s.context, args.eval_tokens,
                            args.eval_batch, device, contextlib.nullcontext)
    print(f"{args.evaluate}: held-out loss {loss:.4f} nats/token "
          f"({loss / math.log(2) / bytes_per_token:.3f} bits/byte) over {scored:,} tokens")
    return loss


@torch.no_grad()
def greedy(model: DemoLlama, tokenizer, prompt: str, max_new: int, device) -> str:
    model.eval()
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    prompt_len = len(ids)
    for _ in range(max_new):
        logits = model(torch.tensor([ids[-model.s.context:]], device=device))
        nxt = int(logits[0, -1].float().argmax())
        if nxt == EOS_ID:
            break
        ids.append(nxt)
    model.train()
    return tokenizer.decode(ids[prompt_len:])


def train(args: argparse.Namespace) -> dict:
    t_start = time.time()
    device = torch.device(args.device if args.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads or 1))
    torch.manual_seed(args.seed)
    s = ModelSettings(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                      num_layers=args.num_layers, num_heads=args.num_heads,
                      num_kv_heads=args.num_kv_heads,
                      intermediate_size=args.intermediate_size, context=args.context)
    if s.hidden_size % s.num_heads or s.num_heads % s.num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")

    files = collect_corpus()
    train_files, held_files = split_corpus(files, args.holdout_every)
    train_texts = [t for _, t in train_files]
    held_texts = [t for _, t in held_files]
    print(f"corpus: {len(files)} files from {stdlib_dir()} "
          f"({sum(len(t.encode()) for _, t in files) / 1e6:.1f} MB); "
          f"held out {len(held_files)} files", flush=True)
    tokenizer = train_tokenizer(train_texts, s.vocab_size)
    train_stream = encode_stream(tokenizer, train_texts)
    held_stream = encode_stream(tokenizer, held_texts)
    held_bytes = sum(len(t.encode()) for t in held_texts)
    bytes_per_token = held_bytes / len(held_stream)
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens; train {len(train_stream):,} tokens, "
          f"held-out {len(held_stream):,} tokens ({bytes_per_token:.2f} bytes/token); "
          f"{time.time() - t_start:.0f}s", flush=True)

    model = DemoLlama(s).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters ({asdict(s)})", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    if device.type == "cuda":
        # float32: no TF32 either, for the same arithmetic as the shipped CPU run.
        fast = args.precision == "bf16"
        torch.backends.cuda.matmul.allow_tf32 = fast
        torch.backends.cudnn.allow_tf32 = fast

    if device.type == "cuda" and args.precision == "bf16":
        def autocast():
            return torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        import contextlib

        def autocast():
            return contextlib.nullcontext()
    step_fn = model
    if args.compile:
        step_fn = torch.compile(model)

    gen = torch.Generator().manual_seed(args.seed)
    train_stream_dev = train_stream.to(device)
    offsets = torch.arange(s.context + 1, device=device)
    warmup = min(args.warmup, max(1, args.steps // 10))
    deadline = t_start + args.minutes * 60 if args.minutes else None
    t_train = time.time()
    tokens_seen = 0
    smoothed = None
    step = 0
    stopped_early = False
    model.train()
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_stream) - s.context - 1, (args.batch_size,),
                               generator=gen).to(device)
        chunk = train_stream_dev[starts[:, None] + offsets]
        x, y = chunk[:, :-1], chunk[:, 1:]
        with autocast():
            logits = step_fn(x)
        loss = F.cross_entropy(logits.float().view(-1, s.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        tokens_seen += x.numel()
        if step % args.log_every == 0 or step == args.steps - 1:
            value = loss.item()
            smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
            elapsed = time.time() - t_train
            print(f"step {step:6d}/{args.steps}  loss {value:.3f}  lr {lr:.2e}  "
                  f"{tokens_seen / max(elapsed, 1e-9):,.0f} tok/s  {elapsed / 60:.1f} min",
                  flush=True)
        if deadline is not None and time.time() > deadline:
            stopped_early = True
            print(f"time budget of {args.minutes} min reached at step {step + 1}/{args.steps}: "
                  f"stopping before the schedule ends", flush=True)
            break
    train_seconds = time.time() - t_train

    round_trip(model, DTYPES[args.dtype])  # evaluate exactly the weights that ship
    held_loss, scored = evaluate(model, held_stream, s.context, args.eval_tokens,
                                 args.eval_batch, device, autocast)
    bpb = held_loss / math.log(2) / bytes_per_token
    print(f"held-out loss {held_loss:.4f} nats/token ({bpb:.3f} bits/byte) over "
          f"{scored:,} tokens", flush=True)
    samples = {p: greedy(model, tokenizer, p, 48, device) for p in args.sample_prompts}
    for prompt, text in samples.items():
        print(f"--- {prompt!r}\n{prompt}{text}", flush=True)
    summary = {
        "seed": args.seed, "device": str(device), "dtype": args.dtype, "precision": args.precision,
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else f"cpu, {torch.get_num_threads()} thread(s)"),
        "torch": torch.__version__, "python": sys.version.split()[0],
        "model": asdict(s), "parameters": n_params,
        "steps_planned": args.steps, "steps_done": step + 1, "stopped_early": stopped_early,
        "batch_size": args.batch_size, "lr": args.lr, "warmup": warmup,
        "weight_decay": args.weight_decay, "tokens_seen": tokens_seen,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "corpus_files": len(files), "heldout_files": len(held_files),
        "train_tokens": len(train_stream), "heldout_tokens": len(held_stream),
        "heldout_tokens_scored": scored, "heldout_loss": round(held_loss, 4),
        "heldout_bits_per_byte": round(bpb, 4),
        "samples": samples,
    }
    write_checkpoint(Path(args.out), model, tokenizer, s, summary, args.dtype)
    print(f"wrote {args.out} ({summary['total_seconds'] / 60:.1f} min in all)", flush=True)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spindle.tools.train_demo_model",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="demo_model_out", help="checkpoint directory to write")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1100, help="optimizer steps (the LR schedule)")
    p.add_argument("--minutes", type=float, default=0,
                   help="wall-clock cap in minutes (0: none); stops early if reached")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--num-heads", type=int, default=6)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--holdout-every", type=int, default=20,
                   help="every Nth corpus file (sorted by path) is held out")
    p.add_argument("--eval-tokens", type=int, default=262144,
                   help="held-out tokens scored (at most)")
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--precision", choices=("float32", "bf16"), default="float32",
                   help="training arithmetic: float32 (default, any device) or bf16 autocast "
                        "(CUDA only; faster, slightly different result)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch and the tokenizer (0: torch's default)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                   help="checkpoint weight dtype")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--evaluate", metavar="CHECKPOINT", default=None,
                   help="only print the held-out loss of an existing checkpoint")
    p.add_argument("--sample-prompts", nargs="*",
                   default=["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.evaluate:
        evaluate_checkpoint(args)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
