"""The audio helpers of the /v1/audio routes, without a server: decoding uploads,
resampling, cutting windows, Whisper decoder prompts (on a tiny checkpoint) and the
response formats (json, text, verbose_json, srt, vtt)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile

from spindle.entrypoints.openai.transcription_formats import (Segment, compression_ratio,
                                                              join_texts, json_body, srt,
                                                              srt_timestamp, verbose_json_body,
                                                              vtt, vtt_timestamp)
from spindle.multimodal.audio_io import AudioError, decode_audio, resample, split_windows
from spindle.multimodal.whisper_prompt import decoder_prompt_ids


def encode(waveform: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, waveform, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


# ---- decode_audio ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt,subtype,tolerance", [("WAV", "PCM_16", 1e-4), ("WAV", "FLOAT", 0),
                                                   ("FLAC", "PCM_16", 1e-4)])
def test_decode_returns_the_mono_float32_waveform_and_its_rate(fmt, subtype, tolerance):
    wave = tone(0.5, 22050)
    decoded, rate = decode_audio(encode(wave, 22050, fmt, subtype))
    assert rate == 22050 and decoded.dtype == np.float32 and decoded.shape == wave.shape
    np.testing.assert_allclose(decoded, wave, atol=tolerance)


def test_decode_reads_lossy_ogg():
    decoded, rate = decode_audio(encode(tone(0.5, 16000), 16000, "OGG", "VORBIS"))
    assert rate == 16000 and decoded.ndim == 1 and abs(len(decoded) - 8000) < 200


def test_decode_averages_stereo_to_mono():
    left, right = tone(0.25, 8000, 300), tone(0.25, 8000, 700)
    decoded, _ = decode_audio(encode(np.stack([left, right], axis=1), 8000, subtype="FLOAT"))
    np.testing.assert_allclose(decoded, (left + right) / 2, atol=1e-6)


def test_decode_refuses_garbage_empty_and_non_finite_audio():
    with pytest.raises(AudioError, match="could not decode the audio file: .*"):
        decode_audio(b"this is not audio at all" * 10)
    with pytest.raises(AudioError, match="could not decode the audio file"):
        decode_audio(b"")
    with pytest.raises(AudioError, match="holds no samples"):
        decode_audio(encode(np.zeros(0, dtype=np.float32), 16000))
    wave = tone(0.1, 16000)
    wave[10] = np.nan
    with pytest.raises(AudioError, match="non-finite"):
        decode_audio(encode(wave, 16000, subtype="FLOAT"))
    assert issubclass(AudioError, ValueError)


def test_decode_refuses_audio_over_the_limit():
    data = encode(tone(2.0, 8000), 8000)
    assert len(decode_audio(data, max_seconds=2.0)[0]) == 16000
    with pytest.raises(AudioError, match="longer than the limit of 1.5 seconds"):
        decode_audio(data, max_seconds=1.5)


# ---- resample and split_windows ---------------------------------------------------------
def test_resample_changes_the_rate_and_keeps_the_signal():
    wave = tone(1.0, 44100, 300)
    out = resample(wave, 44100, 16000)
    assert out.dtype == np.float32 and len(out) == 16000
    np.testing.assert_allclose(out[1000:-1000], tone(1.0, 16000, 300)[1000:-1000], atol=1e-3)
    assert resample(wave, 16000, 16000) is wave
    with pytest.raises(ValueError, match="positive"):
        resample(wave, 0, 16000)


def test_split_windows_covers_every_sample_with_bounded_windows():
    wave = np.arange(45, dtype=np.float32)
    windows = split_windows(wave, 10, 2.0)
    assert [(s, e) for s, e, _ in windows] == [(0.0, 2.0), (2.0, 4.0), (4.0, 4.5)]
    assert [len(w) for _, _, w in windows] == [20, 20, 5]
    np.testing.assert_array_equal(np.concatenate([w for _, _, w in windows]), wave)
    assert [len(w) for _, _, w in split_windows(wave[:40], 10, 2.0)] == [20, 20]
    assert [len(w) for _, _, w in split_windows(wave[:41], 10, 2.0)] == [20, 20, 1]
    assert split_windows(wave[:0], 10, 2.0) == []
    with pytest.raises(ValueError, match="window_s"):
        split_windows(wave, 10, 0.01)


# ---- the response formats -----------------------------------------------------------------
SEGMENTS = [Segment(0.0, 30.0, " Hello there.", (5, 6), seek=0, avg_logprob=-0.25),
            Segment(30.0, 60.0, "  ", (), seek=3000),
            Segment(60.0, 3725.5, " a < b &\n\nc", (7,), seek=6000, temperature=0.5)]


def test_timestamps():
    assert srt_timestamp(0) == "00:00:00,000"
    assert srt_timestamp(1.0) == "00:00:01,000"
    assert srt_timestamp(3725.4567) == "01:02:05,457"
    assert vtt_timestamp(59.9996) == "00:01:00.000"
    assert vtt_timestamp(360000.0) == "100:00:00.000"
    with pytest.raises(ValueError, match="negative"):
        srt_timestamp(-1)


def test_json_and_text_join_the_segments():
    assert join_texts(SEGMENTS) == "Hello there. a < b &\n\nc"
    assert json_body(SEGMENTS) == {"text": "Hello there. a < b &\n\nc"}
    assert join_texts([]) == ""


def test_srt_numbers_cues_and_keeps_each_on_one_line():
    assert srt(SEGMENTS) == ("1\n00:00:00,000 --> 00:00:30,000\nHello there.\n\n"
                             "2\n00:01:00,000 --> 01:02:05,500\na < b & c\n\n")
    assert srt([]) == ""


def test_vtt_has_its_header_and_escapes_markup():
    assert vtt(SEGMENTS) == ("WEBVTT\n\n00:00:00.000 --> 00:00:30.000\nHello there.\n\n"
                             "00:01:00.000 --> 01:02:05.500\na &lt; b &amp; c\n\n")
    assert vtt([]) == "WEBVTT\n\n"


def test_verbose_json_has_one_segment_per_window():
    body = verbose_json_body(SEGMENTS, "translate", "fr", 3725.5)
    assert json.loads(json.dumps(body)) == body
    assert {k: body[k] for k in ("task", "language", "duration", "text")} == {
        "task": "translate", "language": "fr", "duration": 3725.5,
        "text": "Hello there. a < b &\n\nc"}
    first, second, third = body["segments"]
    assert first == {"id": 0, "seek": 0, "start": 0.0, "end": 30.0, "text": " Hello there.",
                     "tokens": [5, 6], "temperature": 0.0, "avg_logprob": -0.25,
                     "compression_ratio": compression_ratio(" Hello there."),
                     "no_speech_prob": 0.0}
    assert (second["id"], second["seek"], second["tokens"], second["text"]) == (1, 3000, [], "  ")
    assert (third["temperature"], third["end"]) == (0.5, 3725.5)


def test_compression_ratio_is_high_for_repetition():
    assert compression_ratio("") == 0.0
    assert compression_ratio("the cat " * 50) > 2.4 > compression_ratio("Hello there, cat.")


# ---- Whisper decoder prompts (the tiny checkpoint's ids) ------------------------------------
@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(tokenizer, generation_config) of a tiny Whisper checkpoint."""
    from transformers import AutoTokenizer

    from spindle.tools.tiny_whisper import make_tiny_whisper

    path = make_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))
    return (AutoTokenizer.from_pretrained(str(path)),
            json.loads((path / "generation_config.json").read_text()))


def special(tokenizer, *tokens: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def test_prompt_defaults_to_english_transcription_without_timestamps(whisper):
    tokenizer, config = whisper
    expected = special(tokenizer, "<|startoftranscript|>", "<|en|>", "<|transcribe|>",
                       "<|notimestamps|>")
    assert decoder_prompt_ids(tokenizer, config, None, "transcribe", None) == expected
    assert decoder_prompt_ids(tokenizer, config, "EN", "transcribe", "  ") == expected
    # Without generation_config.json, the vocabulary has the same ids.
    assert decoder_prompt_ids(tokenizer, {}, None, "transcribe", None) == expected


def test_prompt_names_the_language_and_task(whisper):
    tokenizer, config = whisper
    expected = special(tokenizer, "<|startoftranscript|>", "<|fr|>", "<|translate|>",
                       "<|notimestamps|>")
    assert decoder_prompt_ids(tokenizer, config, "fr", "translate", None) == expected
    assert decoder_prompt_ids(tokenizer, {}, "fr", "translate", None) == expected


def test_previous_text_prompt_comes_first(whisper):
    tokenizer, config = whisper
    text_ids = tokenizer.encode(" the previous text", add_special_tokens=False)
    ids = decoder_prompt_ids(tokenizer, config, "de", "transcribe", "the previous text ")
    assert ids == [*special(tokenizer, "<|startofprev|>"), *text_ids,
                   *special(tokenizer, "<|startoftranscript|>", "<|de|>", "<|transcribe|>",
                            "<|notimestamps|>")]
    cut = decoder_prompt_ids(tokenizer, config, "de", "transcribe", "the previous text",
                             max_prompt_tokens=2)
    assert cut[1:3] == text_ids[-2:] and len(cut) == 7
    # A special token's text in the prompt stays text.
    injected = decoder_prompt_ids(tokenizer, config, None, "transcribe", "<|endoftext|>")
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") not in injected


def test_prompt_refuses_unknown_languages_and_tasks(whisper):
    tokenizer, config = whisper
    for generation_config in (config, {}):
        with pytest.raises(ValueError, match="language must be one of 'de', 'en', 'es', 'fr'"):
            decoder_prompt_ids(tokenizer, generation_config, "xx", "transcribe", None)
        with pytest.raises(ValueError, match="language must be one of"):
            decoder_prompt_ids(tokenizer, generation_config, "startoftranscript", "transcribe",
                               None)
    with pytest.raises(ValueError, match="task must be one of 'transcribe', 'translate'"):
        decoder_prompt_ids(tokenizer, config, "en", "summarize", None)


def test_english_only_checkpoint_takes_no_language_or_task(whisper):
    tokenizer, config = whisper
    english = {**config, "is_multilingual": False}
    assert decoder_prompt_ids(tokenizer, english, None, "transcribe", None) == special(
        tokenizer, "<|startoftranscript|>", "<|notimestamps|>")
    with pytest.raises(ValueError, match="English-only"):
        decoder_prompt_ids(tokenizer, english, "fr", "transcribe", None)
    with pytest.raises(ValueError, match="English-only"):
        decoder_prompt_ids(tokenizer, english, None, "translate", None)
