"""Make tiny, real Whisper checkpoints (WhisperForConditionalGeneration) for tests and
benchmarks: config.json, generation_config.json, preprocessor_config.json (the
WhisperFeatureExtractor the checkpoint's audio goes through), safetensors weights and a
byte-level BPE tokenizer whose special tokens are Whisper's (start of transcript,
languages, tasks, no timestamps, ...), all made offline and deterministic for a seed.

A tiny checkpoint may use a shorter audio window than Whisper's 30 s
(``chunk_length`` seconds): the encoder then has ``chunk_length * 50`` positions, as
Whisper's 1500 for 30 s (100 mel frames a second, halved by the second convolution).
Weights are transformers' own init rescaled so that every matrix keeps its input's
scale (std 1 / sqrt(fan in)) and logits have a std of about ``logit_std``: with
transformers' std 0.02 a tiny model's logits are flat, and with one std for all, the
encoder's output swamps the decoder's token signal (every step gives one token). The
first convolution's kernels have zero mean, so the constant floor of quiet log-mel bins
does not drown what changes along the window.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from spindle.tools.tiny_model import _corpus, _randn_like

SAMPLING_RATE = 16000
HOP_LENGTH = 160
N_FFT = 400
# Queries and keys at this multiple of unit scale: attention scores of std ~4, so a
# query picks a few positions instead of averaging the window into one constant.
ATTENTION_GAIN = 2.0
LANGUAGES = ("en", "fr", "de", "es")
# Whisper's special tokens, in the order real checkpoints number them after the text.
SPECIAL_TOKENS = ("<|endoftext|>", "<|startoftranscript|>",
                  *(f"<|{lang}|>" for lang in LANGUAGES),
                  "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
                  "<|nospeech|>", "<|notimestamps|>")


def encoder_positions(chunk_length: int) -> int:
    """Encoder positions of a window of chunk_length seconds (1500 for Whisper's 30)."""
    return chunk_length * SAMPLING_RATE // HOP_LENGTH // 2


def make_tiny_whisper(out_dir: str | Path, seed: int = 0, vocab_size: int = 384,
                      d_model: int = 64, encoder_layers: int = 2, decoder_layers: int = 2,
                      encoder_heads: int = 4, decoder_heads: int = 4, ffn_dim: int = 128,
                      num_mel_bins: int = 80, chunk_length: int = 2,
                      max_target_positions: int = 64, dtype: str = "float32",
                      logit_std: float = 4.0, **config_extra: Any) -> Path:
    """Write a tiny random Whisper checkpoint to out_dir and return its path."""
    from transformers import WhisperConfig, WhisperFeatureExtractor

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size)
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = WhisperConfig(
        vocab_size=vocab_size, num_mel_bins=num_mel_bins, d_model=d_model,
        encoder_layers=encoder_layers, decoder_layers=decoder_layers,
        encoder_attention_heads=encoder_heads, decoder_attention_heads=decoder_heads,
        encoder_ffn_dim=ffn_dim, decoder_ffn_dim=ffn_dim,
        max_source_positions=encoder_positions(chunk_length),
        max_target_positions=max_target_positions,
        pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"], decoder_start_token_id=ids["<|startoftranscript|>"],
        suppress_tokens=[], begin_suppress_tokens=[], architectures=[
            "WhisperForConditionalGeneration"], **config_extra)
    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=SAMPLING_RATE,
                                        hop_length=HOP_LENGTH, chunk_length=chunk_length,
                                        n_fft=N_FFT)
    model = build_whisper(config, seed, logit_std)
    _calibrate_convolutions(model, extractor, chunk_length, seed)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    config.dtype = dtype
    config.save_pretrained(out)
    _write_weights(model, out, torch_dtype)
    (out / "tokenizer.json").write_text(tokenizer.to_str())
    _write_tokenizer_config(out, max_target_positions)
    _write_generation_config(out, ids)
    extractor.save_pretrained(out)
    return out


@torch.no_grad()
def _calibrate_convolutions(model: torch.nn.Module, extractor: Any, chunk_length: int,
                            seed: int) -> None:
    """Scale each convolution so that, on synthetic audio, what it outputs varies along
    the window with std 1: at the init's scale the audio's signal is a few hundredths,
    and the encoder's positional sinusoids (std ~0.7) decide its output alone."""
    encoder = model.model.encoder
    features = extractor(synthetic_audio(chunk_length * 0.9, seed + 7),
                         sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
    x = features.to(encoder.conv1.weight.dtype)
    for conv in (encoder.conv1, encoder.conv2):
        scale = 1.0 / conv(x).std(dim=-1).mean()
        conv.weight.mul_(scale)
        conv.bias.mul_(scale)
        x = torch.nn.functional.gelu(conv(x))


def build_whisper(config: Any, seed: int, logit_std: float = 4.0) -> torch.nn.Module:
    """transformers' Whisper for config, seeded, with rescaled weights (norms and biases
    randomised too, so a loader that mixes them up fails)."""
    from transformers import WhisperForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WhisperForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name and name.endswith(".weight"):
                param.copy_(1.0 + 0.2 * _randn_like(param, generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * _randn_like(param, generator))
            elif "embed_positions" in name and "encoder" in name:
                continue  # the encoder's fixed sinusoids, as transformers made them
            elif param.dim() >= 2:  # unit-variance outputs: every path counts
                if name.endswith("conv1.weight"):  # (a log-mel floor is no signal)
                    param.sub_(param.mean(dim=(1, 2), keepdim=True))
                fan_in = param[0].numel() if param.dim() > 2 or "embed" not in name else 1
                gain = ATTENTION_GAIN if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                param.mul_(gain / math.sqrt(fan_in) / param.std())
        head = model.get_output_embeddings().weight  # tied to the decoder's embeddings
        head.mul_(logit_std / math.sqrt(config.d_model) / head.std())
    return model


def _write_weights(model: torch.nn.Module, out: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    state = {name: t.detach().to(dtype).contiguous().clone()
             for name, t in model.state_dict().items() if name != "proj_out.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tokenizer_models

    tokenizer = Tokenizer(tokenizer_models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the tokenizer corpus gives {tokenizer.get_vocab_size()} tokens, "
                         f"not vocab_size={vocab_size}")
    return tokenizer


def _write_tokenizer_config(out: Path, max_length: int) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
              "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": None,
              "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": max_length}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_generation_config(out: Path, ids: dict[str, int]) -> None:
    """Whisper's generation settings, as real checkpoints carry them (the language and
    task token maps the server builds decoder prompts from)."""
    generation = {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "prev_sot_token_id": ids["<|startofprev|>"],
        "lang_to_id": {f"<|{lang}|>": ids[f"<|{lang}|>"] for lang in LANGUAGES},
        "task_to_id": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        "is_multilingual": True, "suppress_tokens": [], "begin_suppress_tokens": [],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def synthetic_audio(seconds: float, seed: int = 0, sampling_rate: int = SAMPLING_RATE):
    """A float32 waveform that changes over time like speech does (tones of random
    pitch and noise bursts, each with its own onset and loudness), so an encoder's
    output differs along the window and between seeds; stationary noise would give
    every position the same features."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = int(round(seconds * sampling_rate))
    t = np.arange(n) / sampling_rate
    wave = 0.01 * rng.standard_normal(n)
    for _ in range(max(1, int(seconds * 6))):
        start = rng.uniform(0, max(seconds - 0.05, 0.0))
        length = rng.uniform(0.05, 0.4)
        envelope = np.clip(1 - np.abs((t - start - length / 2) / (length / 2)), 0, None)
        if rng.random() < 0.7:
            tone = np.sin(2 * np.pi * rng.uniform(100, 4000) * t + rng.uniform(0, 6.3))
        else:
            tone = rng.standard_normal(n)
        wave += rng.uniform(0.05, 0.5) * envelope * tone
    return wave.astype(np.float32)
