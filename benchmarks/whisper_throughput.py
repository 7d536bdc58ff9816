"""Speech to text on one GPU: spindle vs the transformers pipeline on a
whisper-large-v3-shaped random bf16 checkpoint, the same clips, in one run.

64 clips of 10-30 s of synthetic audio (tools/tiny_whisper.synthetic_audio: tones and
bursts), each decoded to exactly --new-tokens tokens after Whisper's 4-token prompt
(<|startoftranscript|><|en|><|transcribe|><|notimestamps|>): random weights never
stop on their own, so both engines are told to generate that many (spindle
ignore_eos, transformers min_new_tokens = max_new_tokens). Both start from the raw
waveforms (feature extraction inside the timed region). The figure is audio seconds
transcribed per wall second; tokens per second beside it.

    python benchmarks/whisper_throughput.py [--clips 64] [--new-tokens 64]
        [--hf-batch-sizes 16,64] [--json out.json]

The checkpoint: transformers' own init for the large-v3 shape (d_model 1280, 32 + 32
layers, 20 heads, 128 mel bins, 51866 tokens), a word-level tokenizer of that size
with Whisper's special tokens at their real ids, and the real feature extractor
settings (30 s windows, 128 mels).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

LARGE_V3 = dict(vocab_size=51866, num_mel_bins=128, d_model=1280, encoder_layers=32,
                decoder_layers=32, encoder_attention_heads=20, decoder_attention_heads=20,
                encoder_ffn_dim=5120, decoder_ffn_dim=5120, max_source_positions=1500,
                max_target_positions=448)
# Whisper's special tokens at their large-v3 ids.
EOT, SOT, EN = 50257, 50258, 50259
TRANSLATE, TRANSCRIBE, NO_TIMESTAMPS, PREV = 50358, 50359, 50364, 50362
PROMPT = [SOT, EN, TRANSCRIBE, NO_TIMESTAMPS]


def make_checkpoint(out: Path) -> Path:
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    config = WhisperConfig(**LARGE_V3, pad_token_id=EOT, bos_token_id=EOT, eos_token_id=EOT,
                           decoder_start_token_id=SOT, suppress_tokens=[],
                           begin_suppress_tokens=[],
                           architectures=["WhisperForConditionalGeneration"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WhisperForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    _write_tokenizer(out)
    generation = {"decoder_start_token_id": SOT, "eos_token_id": EOT, "pad_token_id": EOT,
                  "bos_token_id": EOT, "no_timestamps_token_id": NO_TIMESTAMPS,
                  "prev_sot_token_id": PREV, "lang_to_id": {"<|en|>": EN},
                  "task_to_id": {"transcribe": TRANSCRIBE, "translate": TRANSLATE},
                  "is_multilingual": True, "suppress_tokens": [], "begin_suppress_tokens": []}
    (out / "generation_config.json").write_text(json.dumps(generation))
    WhisperFeatureExtractor(feature_size=128).save_pretrained(out)
    return out


def _write_tokenizer(out: Path) -> None:
    """A WhisperTokenizer (the pipeline decodes through its _decode_asr) over a
    byte-level vocabulary of large-v3's size, with no merges: ids stand for themselves,
    Whisper's special tokens at their real ids."""
    specials = {EOT: "<|endoftext|>", SOT: "<|startoftranscript|>", EN: "<|en|>",
                TRANSLATE: "<|translate|>", TRANSCRIBE: "<|transcribe|>",
                NO_TIMESTAMPS: "<|notimestamps|>", PREV: "<|startofprev|>"}
    vocab = {specials.get(i, f"w{i}"): i for i in range(LARGE_V3["vocab_size"])}
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "merges.txt").write_text("#version: 0.2\n")
    added = {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False} for i, t in specials.items()}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "WhisperTokenizer", "added_tokens_decoder": added,
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 448}))


def make_clips(count: int, seed: int) -> list[np.ndarray]:
    from spindle.tools.tiny_whisper import synthetic_audio

    rng = np.random.default_rng(seed)
    return [synthetic_audio(float(rng.uniform(10, 30)), seed * 1000 + i) for i in range(count)]


def run_spindle(path: Path, clips: list[np.ndarray], new_tokens: int,
                profile: bool = False) -> dict:
    from spindle import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=len(clips), max_model_len=448)
    ready = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT, "multi_modal_data": {"audio": (c, 16000)}}
               for c in clips]
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # Where the time goes: the features alone, then the engine alone on them, step by step.
    start = time.perf_counter()
    processed = [llm.engine.input_processor.process(p, params) for p in prompts]
    features_s = time.perf_counter() - start
    steps = _trace_steps(llm)
    start = time.perf_counter()
    llm.generate(processed, params, use_tqdm=False)
    engine_s = time.perf_counter() - start
    step_summary = _summarize(steps)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(processed[:16], params, use_tqdm=False)
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))
    llm.shutdown()
    return {"engine": "spindle", "ready_s": ready, "seconds": seconds, "tokens": tokens,
            "features_s": features_s, "engine_s": engine_s, **step_summary,
            "first_tokens": [o.outputs[0].token_ids[:8] for o in outputs[:4]]}


def _trace_steps(llm) -> list:
    """(time the step was scheduled, requests it admitted), appended as the engine runs."""
    scheduler, steps = llm.engine.core.scheduler, []
    schedule = scheduler.schedule

    def traced(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.append((time.perf_counter(), len(out.new_requests)))
        return out

    scheduler.schedule = traced
    return steps


def _summarize(steps: list) -> dict:
    """Seconds and counts of the steps that start requests (run encoders) and of pure
    decode steps (a step's time: until the next one is scheduled)."""
    starting = decoding = 0.0
    num_starting = num_decoding = 0
    for (t, new), (t_next, _) in zip(steps, steps[1:]):
        if new:
            starting += t_next - t
            num_starting += 1
        else:
            decoding += t_next - t
            num_decoding += 1
    return {"encoder_steps": num_starting, "encoder_steps_s": starting,
            "decode_steps": num_decoding, "decode_steps_s": decoding}


def run_transformers(path: Path, clips: list[np.ndarray], new_tokens: int,
                     batch_size: int) -> dict:
    from transformers import pipeline

    start = time.perf_counter()
    asr = pipeline("automatic-speech-recognition", model=str(path), dtype=torch.bfloat16,
                   device="cuda")
    ready = time.perf_counter() - start
    kwargs = dict(batch_size=batch_size, generate_kwargs=dict(
        language="en", task="transcribe", max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, num_beams=1, do_sample=False))
    # (fresh dicts for each call: the pipeline pops their keys)
    asr([{"raw": c, "sampling_rate": 16000} for c in clips[:4]], **kwargs)  # warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    asr([{"raw": c, "sampling_rate": 16000} for c in clips], **kwargs)
    seconds = time.perf_counter() - start
    del asr
    torch.cuda.empty_cache()
    return {"engine": f"transformers pipeline, batch_size={batch_size}", "ready_s": ready,
            "seconds": seconds, "tokens": new_tokens * len(clips)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-batch-sizes", default="16,64")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="print torch profiler tables of spindle on 16 clips")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    clips = make_clips(args.clips, seed=1)
    audio = sum(len(c) for c in clips) / 16000
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "clips": args.clips, "audio_seconds": audio, "new_tokens": args.new_tokens,
              "results": []}
    runs = [lambda p: run_spindle(p, clips, args.new_tokens, args.profile)]
    if not args.skip_transformers:
        runs += [lambda p, size=int(s): run_transformers(p, clips, args.new_tokens, size)
                 for s in args.hf_batch_sizes.split(",") if s]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp))
        for run in runs:  # (each result is kept as soon as it exists)
            result = run(path)
            result["audio_s_per_s"] = audio / result["seconds"]
            result["tokens_per_s"] = result["tokens"] / result["seconds"]
            report["results"].append(result)
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=2))
            _print_table(report)


def _print_table(report: dict) -> None:
    print(f"{report['clips']} clips, {report['audio_seconds']:.0f} s of audio, "
          f"{report['new_tokens']} tokens each, {report['device']}, torch {report['torch']}")
    print(f"{'engine':42s} {'ready s':>8s} {'wall s':>8s} {'audio s/s':>10s} {'tok/s':>9s}")
    for r in report["results"]:
        print(f"{r['engine']:42s} {r['ready_s']:8.1f} {r['seconds']:8.2f} "
              f"{r['audio_s_per_s']:10.1f} {r['tokens_per_s']:9.0f}")
        if "features_s" in r:
            print(f"  spindle: features {r['features_s']:.2f} s; engine on features "
                  f"{r['engine_s']:.2f} s: {r['encoder_steps']} steps starting requests "
                  f"{r['encoder_steps_s']:.2f} s, {r['decode_steps']} decode steps "
                  f"{r['decode_steps_s']:.2f} s")


if __name__ == "__main__":
    main()
