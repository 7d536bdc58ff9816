"""`spindle transcribe FILE ... --model WHISPER_DIR`: audio files to text, offline, the
way the server's /v1/audio/transcriptions does it.

Each file is decoded (soundfile: wav, flac, ogg, mp3, ...), resampled to the
checkpoint's rate and cut into windows of its chunk_length (30 s); every window of
every file is one request, all generated together. Without --language, a multilingual
checkpoint's language is detected on each file's first window. --format picks what is
printed per file: text (the default), json, verbose_json, srt or vtt; with several
files each answer is preceded by a "==> FILE <==" line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from spindle.entrypoints.cli_args import HelpFormatter, add_engine_args, engine_args_from
from spindle.entrypoints.openai.transcription_formats import RESPONSE_FORMATS


def add_transcribe_parser(subparsers: argparse._SubParsersAction) -> None:
    cmd = subparsers.add_parser(
        "transcribe", help="Transcribe (or translate) audio files with a Whisper checkpoint.",
        description=__doc__, usage="%(prog)s --model WHISPER_DIR [options] FILE [FILE ...]",
        formatter_class=HelpFormatter)
    cmd.add_argument("audio", nargs="+", metavar="FILE", help="Audio files.")
    cmd.add_argument("--language", default=None,
                     help="Spoken language, an ISO-639-1 code such as en (default: detected "
                          "on each file's first window; English-only checkpoints: en).")
    cmd.add_argument("--translate", action="store_true",
                     help="Translate into English instead of transcribing.")
    cmd.add_argument("--prompt", default=None,
                     help="Text the transcription follows on from (names, spelling, style).")
    cmd.add_argument("--format", choices=RESPONSE_FORMATS, default="text", help="What to print.")
    add_engine_args(cmd, skip=("task",))
    cmd.set_defaults(func=cmd_transcribe)


def cmd_transcribe(ns: argparse.Namespace) -> int:
    from spindle.entrypoints.llm import LLM

    if not ns.model:
        raise ValueError("transcribe needs a Whisper checkpoint: pass --model PATH")
    audio = [_load(Path(f)) for f in ns.audio]  # (bad files fail before the engine starts)
    args = engine_args_from(ns, model=ns.model, task="generate")
    llm = LLM(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
    try:
        task = "translate" if ns.translate else "transcribe"
        answers = transcribe(llm, audio, ns.language, task, ns.prompt, ns.format)
    finally:
        llm.shutdown()
    for path, answer in zip(ns.audio, answers):
        if len(ns.audio) > 1:
            sys.stdout.write(f"==> {path} <==\n")
        sys.stdout.write(answer if answer.endswith("\n") else answer + "\n")
    sys.stdout.flush()
    return 0


def _load(path: Path) -> tuple:
    from spindle.multimodal.audio_io import decode_audio

    if not path.is_file():
        raise ValueError(f"no such audio file: {path}")
    try:
        return decode_audio(path.read_bytes())
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def transcribe(llm, audio: list[tuple], language: str | None, task: str, prompt: str | None,
               response_format: str) -> list[str]:
    """Each (waveform, rate) transcribed by llm (a Whisper engine), rendered in
    response_format: the server's segments and formats, offline."""
    from spindle.entrypoints.openai import transcription_formats as formats
    from spindle.entrypoints.openai.serving_base import tokenizer_special_ids
    from spindle.entrypoints.openai.serving_transcription import AudioCheckpoint, segment_of
    from spindle.multimodal.audio_io import resample, split_windows
    from spindle.multimodal.whisper_prompt import decoder_prompt_ids
    from spindle.sampling_params import SamplingParams

    model = llm.engine.config.model
    if model.model_kind != "encoder_decoder":
        raise ValueError(f"{model.architecture} does not transcribe audio: pass a Whisper "
                         "checkpoint as --model")
    checkpoint = AudioCheckpoint.read(model.model, model.hf_config)
    tokenizer, rate = llm.engine.tokenizer, checkpoint.sampling_rate
    files = [split_windows(resample(w, r, rate), rate, checkpoint.chunk_length)
             for w, r in audio]
    languages = [language or _detect(llm, tokenizer, checkpoint, windows[0][2])
                 for windows in files]
    limit = model.max_model_len // 2 - 1
    requests, owners = [], []
    for i, (windows, lang) in enumerate(zip(files, languages)):
        ids = decoder_prompt_ids(tokenizer, checkpoint.generation_config, lang, task, prompt,
                                 max_prompt_tokens=limit)
        for start, end, samples in windows:
            requests.append({"prompt_token_ids": ids,
                             "multi_modal_data": {"audio": (samples, rate)}})
            owners.append((i, start, end, len(ids)))
    params = [SamplingParams(temperature=0.0, max_tokens=model.max_model_len - n,
                             logprobs=0 if response_format == "verbose_json" else None)
              for *_, n in owners]
    outputs = llm.generate(requests, params, use_tqdm=False)
    special = tokenizer_special_ids(tokenizer)
    segments: list[list] = [[] for _ in files]
    for (i, start, end, _), output in zip(owners, outputs):
        seek = round(start * rate) // checkpoint.hop_length
        segments[i].append(segment_of(start, end, output, 0.0, special, seek))
    bodies = [formats.render(response_format, s, task, lang or "en", len(w) / r)
              for s, lang, (w, r) in zip(segments, languages, audio)]
    return [b if isinstance(b, str) else json.dumps(b, ensure_ascii=False) for b in bodies]


def _detect(llm, tokenizer, checkpoint, samples) -> str | None:
    """The language Whisper detects on samples (None: an English-only checkpoint)."""
    from spindle.multimodal.whisper_prompt import language_detection

    detection = language_detection(tokenizer, checkpoint.generation_config, samples,
                                   checkpoint.sampling_rate)
    if detection is None:
        return None
    prompt, params, codes = detection
    return codes[llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids[0]]
