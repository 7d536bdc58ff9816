"""The response formats of /v1/audio/transcriptions and /v1/audio/translations: a
transcription's segments (one per audio window) as OpenAI's json, text, verbose_json,
srt and vtt. Pure functions of the segments; nothing here knows of the engine."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Sequence

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


@dataclass(frozen=True)
class Segment:
    """One transcribed stretch of audio: its bounds in seconds, its text and tokens."""

    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()
    seek: int = 0  # where the stretch starts, in the feature extractor's frames (10 ms)
    temperature: float = 0.0
    avg_logprob: float = 0.0  # mean logprob of its generated tokens (0.0: not measured)


def render(response_format: str, segments: Sequence[Segment], task: str, language: str,
           duration: float) -> dict[str, Any] | str:
    """segments in response_format: a JSON body (json, verbose_json) or text (text, srt,
    vtt). The routes and `spindle transcribe` both answer through it."""
    if response_format == "json":
        return json_body(segments)
    if response_format == "verbose_json":
        return verbose_json_body(segments, task, language, duration)
    texts = {"text": join_texts, "srt": srt, "vtt": vtt}
    if response_format not in texts:
        raise ValueError(f"response_format must be one of {RESPONSE_FORMATS}, "
                         f"got {response_format!r}")
    return texts[response_format](segments)


def join_texts(segments: Sequence[Segment]) -> str:
    """The whole transcription: the segments' texts, trimmed, one space between (Whisper's
    texts start with a space of their own); empty ones left out."""
    return " ".join(text for text in (s.text.strip() for s in segments) if text)


def json_body(segments: Sequence[Segment]) -> dict[str, Any]:
    return {"text": join_texts(segments)}


def verbose_json_body(segments: Sequence[Segment], task: str, language: str,
                      duration: float) -> dict[str, Any]:
    """OpenAI's verbose_json. no_speech_prob is always 0.0: spindle does not compute it."""
    return {"task": task, "language": language, "duration": duration,
            "text": join_texts(segments),
            "segments": [{"id": i, "seek": s.seek, "start": s.start, "end": s.end,
                          "text": s.text, "tokens": list(s.tokens),
                          "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                          "compression_ratio": compression_ratio(s.text),
                          "no_speech_prob": 0.0} for i, s in enumerate(segments)]}


def srt(segments: Sequence[Segment]) -> str:
    """SubRip: numbered cues from 1, "HH:MM:SS,mmm --> HH:MM:SS,mmm", a blank line after
    each. Segments without text get no cue."""
    cues = [(s, text) for s in segments if (text := _cue_text(s.text))]
    return "".join(f"{n}\n{srt_timestamp(s.start)} --> {srt_timestamp(s.end)}\n{text}\n\n"
                   for n, (s, text) in enumerate(cues, start=1))


def vtt(segments: Sequence[Segment]) -> str:
    """WebVTT: the "WEBVTT" header, then one cue per segment with text
    ("HH:MM:SS.mmm --> HH:MM:SS.mmm"). &, < and > are escaped: cue text is markup."""
    cues = "".join(f"{vtt_timestamp(s.start)} --> {vtt_timestamp(s.end)}\n{_escape_vtt(text)}\n\n"
                   for s in segments if (text := _cue_text(s.text)))
    return "WEBVTT\n\n" + cues


def srt_timestamp(seconds: float) -> str:
    return _timestamp(seconds, ",")


def vtt_timestamp(seconds: float) -> str:
    return _timestamp(seconds, ".")


def compression_ratio(text: str) -> float:
    """Whisper's repetition gauge: the text's UTF-8 length over its zlib-compressed
    length (a text looping on one phrase compresses well, scoring above 2.4)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def _timestamp(seconds: float, decimal_mark: str) -> str:
    """HH:MM:SS<mark>mmm, rounded to the millisecond (hours may pass 99)."""
    if seconds < 0:
        raise ValueError(f"a timestamp must not be negative, got {seconds}")
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_mark}{ms:03d}"


def _cue_text(text: str) -> str:
    """A subtitle cue's text on one line: a blank line inside it would end the cue."""
    return " ".join(text.split())


def _escape_vtt(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
