"""/v1/audio/transcriptions and /v1/audio/translations through the official openai
client, against a real `spindle serve` of a tiny Whisper checkpoint: every response
format equals offline LLM.generate on the same windows with the same decoder prompt,
and bad requests get a 400 that leaves the server serving."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
import torch

from server_utils import RemoteServer, official_client, served
from spindle import LLM, SamplingParams
from spindle.entrypoints.openai.transcription_formats import Segment, join_texts, srt, vtt
from spindle.multimodal.audio_io import decode_audio, resample, split_windows
from spindle.multimodal.whisper_prompt import decoder_prompt_ids
from spindle.tools.tiny_whisper import make_tiny_whisper, synthetic_audio

ENGINE_FLAGS = ("--device", "cpu", "--dtype", "float32")
RATE = 16000  # the tiny checkpoint's feature extractor's
WINDOW_S = 2  # the tiny checkpoint's chunk_length
UPLOAD_RATE = 22050  # uploads are resampled to RATE
EOS = 0  # <|endoftext|> in the tiny checkpoint


def wav_bytes(waveform: np.ndarray, rate: int, subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, waveform, rate, format="WAV", subtype=subtype)
    return buffer.getvalue()


# 5 s: three windows (2 s, 2 s, 1 s) of the tiny checkpoint.
SPEECH = wav_bytes(synthetic_audio(5.0, seed=1, sampling_rate=UPLOAD_RATE), UPLOAD_RATE)


@pytest.fixture(scope="module")
def whisper_path(tmp_path_factory):
    return make_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))


@pytest.fixture(scope="module")
def server(whisper_path, tmp_path_factory):
    yield from served(tmp_path_factory, str(whisper_path), *ENGINE_FLAGS,
                      "--served-model-name", "whisper", "--max-audio-seconds", "60")


@pytest.fixture(scope="module")
def client(server):
    return official_client(server)


@pytest.fixture(scope="module")
def offline(whisper_path):
    llm = LLM(str(whisper_path), device="cpu", dtype="float32")
    yield llm
    llm.shutdown()


def prompt_ids(llm: LLM, language=None, task="transcribe", prompt=None,
               data: bytes = SPEECH) -> list[int]:
    """The decoder prompt the server should use; without a language, the one
    transformers detects on the upload's first window."""
    model = llm.engine.config.model
    config = json.loads(Path(model.model, "generation_config.json").read_text())
    language = language or detected_language(Path(model.model), data)
    return decoder_prompt_ids(llm.get_tokenizer(), config, language, task, prompt,
                              max_prompt_tokens=model.max_model_len // 2 - 1)


@torch.no_grad()
def detected_language(path: Path, data: bytes) -> str:
    """Whisper's language detection by transformers: the likeliest language token
    after <|startoftranscript|>, on the first window of the upload."""
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    config = json.loads(Path(path, "generation_config.json").read_text())
    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    waveform, rate = decode_audio(data)
    first = split_windows(resample(waveform, rate, RATE), RATE, WINDOW_S)[0][2]
    features = WhisperFeatureExtractor.from_pretrained(path)(
        first, sampling_rate=RATE, return_tensors="pt").input_features
    logits = model(input_features=features, decoder_input_ids=torch.tensor(
        [[config["decoder_start_token_id"]]])).logits[0, -1]
    codes = {token_id: token[2:-2] for token, token_id in config["lang_to_id"].items()}
    return codes[max(codes, key=lambda token_id: float(logits[token_id]))]


def offline_segments(llm: LLM, data: bytes, ids: list[int], logprobs: int | None = None
                     ) -> list[Segment]:
    """What the server should answer: greedy LLM.generate on each window of the upload,
    decoded and resampled as the server does."""
    waveform, rate = decode_audio(data)
    windows = split_windows(resample(waveform, rate, RATE), RATE, WINDOW_S)
    params = SamplingParams(temperature=0.0, logprobs=logprobs,
                            max_tokens=llm.engine.config.model.max_model_len - len(ids))
    outputs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"audio": (w, RATE)}}
                            for _, _, w in windows], params, use_tqdm=False)
    segments = []
    for (start, end, _), output in zip(windows, outputs):
        c = output.outputs[0]
        tokens = c.token_ids[:-1] if c.finish_reason == "stop" and c.token_ids[-1] == EOS \
            else c.token_ids
        avg = c.cumulative_logprob / len(c.token_ids) if logprobs is not None else 0.0
        segments.append(Segment(start, end, c.text, tuple(tokens), seek=round(start * 100),
                                avg_logprob=avg))
    return segments


# ---- answers equal the offline engine's ------------------------------------------------------
def test_json_transcription_equals_offline_generate(client, offline):
    expected = offline_segments(offline, SPEECH, prompt_ids(offline))
    assert len(expected) == 3 and join_texts(expected)
    response = client.audio.transcriptions.create(model="whisper",
                                                  file=("speech.wav", SPEECH, "audio/wav"))
    assert response.text == join_texts(expected)


def test_text_srt_and_vtt_equal_offline_generate(client, offline):
    expected = offline_segments(offline, SPEECH, prompt_ids(offline))
    answers = {fmt: client.audio.transcriptions.create(model="whisper", file=("a.wav", SPEECH),
                                                       response_format=fmt)
               for fmt in ("text", "srt", "vtt")}
    assert answers == {"text": join_texts(expected), "srt": srt(expected), "vtt": vtt(expected)}
    assert answers["srt"].startswith("1\n00:00:00,000 --> 00:00:02,000\n")
    assert answers["vtt"].startswith("WEBVTT\n\n00:00:00.000 --> 00:00:02.000\n")


def test_verbose_json_has_one_segment_per_window(client, offline):
    expected = offline_segments(offline, SPEECH, prompt_ids(offline), logprobs=0)
    response = client.audio.transcriptions.create(model="whisper", file=("a.wav", SPEECH),
                                                  response_format="verbose_json")
    language = detected_language(Path(offline.engine.config.model.model), SPEECH)
    assert (response.language, response.duration, response.text) == (language, 5.0,
                                                                      join_texts(expected))
    assert response.model_extra["task"] == "transcribe"
    assert [(s.id, s.start, s.end, s.seek) for s in response.segments] == [
        (0, 0.0, 2.0, 0), (1, 2.0, 4.0, 200), (2, 4.0, 5.0, 400)]
    for got, want in zip(response.segments, expected):
        assert (got.text, got.tokens, got.temperature) == (want.text, list(want.tokens), 0.0)
        assert got.avg_logprob == pytest.approx(want.avg_logprob, abs=1e-4)
        assert got.avg_logprob < 0 and got.no_speech_prob == 0.0


def test_language_and_prompt_reach_the_decoder_prompt(client, offline):
    ids = prompt_ids(offline, language="fr", prompt="earlier words")
    expected = offline_segments(offline, SPEECH, ids)
    response = client.audio.transcriptions.create(model="whisper", file=("a.wav", SPEECH),
                                                  language="fr", prompt="earlier words")
    assert response.text == join_texts(expected)


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # (the SDK's translations)
def test_translation_equals_offline_generate(client, offline):
    expected = offline_segments(offline, SPEECH, prompt_ids(offline, task="translate"))
    response = client.audio.translations.create(model="whisper", file=("a.wav", SPEECH))
    assert response.text == join_texts(expected)
    verbose = client.audio.translations.create(model="whisper", file=("a.wav", SPEECH),
                                               response_format="verbose_json")
    assert verbose.model_extra["task"] == "translate" and verbose.text == response.text
    assert client.audio.translations.create(model="whisper", file=("a.wav", SPEECH),
                                            response_format="srt") == srt(expected)


def test_sampled_transcription(client):
    response = client.audio.transcriptions.create(model="whisper", file=("a.wav", SPEECH),
                                                  temperature=0.7, response_format="verbose_json")
    assert len(response.segments) == 3 and {s.temperature for s in response.segments} == {0.7}


def test_text_answers_carry_the_request_id(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post("/v1/audio/transcriptions", headers={"X-Request-Id": "mine"},
                             files={"file": ("a.wav", SPEECH)}, data={"response_format": "vtt"})
    assert response.status_code == 200 and response.headers["X-Request-Id"] == "mine"
    assert response.headers["content-type"].startswith("text/vtt")


# ---- bad requests: 400, and the server serves on ---------------------------------------------
def bad_request(create, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        create(model="whisper", **kwargs)
    return caught.value


def test_bad_audio_and_bad_fields_are_400_and_the_server_serves_on(client, offline, server):
    create = client.audio.transcriptions.create
    error = bad_request(create, file=("a.wav", b"not audio, only text" * 20))
    assert "could not decode the audio file" in error.message and error.param == "file"
    error = bad_request(create, file=("a.wav", wav_bytes(np.zeros(0, np.float32), RATE)))
    assert "holds no samples" in error.message
    nan = synthetic_audio(0.5, seed=2)
    nan[100] = np.nan
    error = bad_request(create, file=("a.wav", wav_bytes(nan, RATE, "FLOAT")))
    assert "non-finite" in error.message
    # Over the server's limit (--max-audio-seconds 60), as 8-bit samples at 1 kHz.
    too_long = wav_bytes(np.zeros(61_000, np.float32), 1000, "PCM_U8")
    error = bad_request(create, file=("long.wav", too_long))
    assert "longer than the limit of 60 seconds" in error.message
    error = bad_request(create, file=("a.wav", SPEECH), response_format="xml")
    assert error.param == "response_format"
    assert "'json', 'text', 'verbose_json', 'srt', 'vtt'" in error.message
    error = bad_request(create, file=("a.wav", SPEECH), temperature=1.5)
    assert error.param == "temperature" and "between 0 and 1" in error.message
    error = bad_request(create, file=("a.wav", SPEECH), language="xx")
    assert error.param == "language" and "'de', 'en', 'es', 'fr'" in error.message
    error = bad_request(create, file=("a.wav", SPEECH), timestamp_granularities=["word"])
    assert error.param == "timestamp_granularities"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        missing = http.post("/v1/audio/transcriptions", data={"model": "whisper"},
                            files={"other": ("a.txt", b"x")})
        assert missing.status_code == 400 and "file" in missing.json()["error"]["message"]
        streamed = http.post("/v1/audio/transcriptions", data={"stream": "true"},
                             files={"file": ("a.wav", SPEECH)})
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
        assert http.get("/health").status_code == 200
    expected = offline_segments(offline, SPEECH, prompt_ids(offline))
    assert create(model="whisper", file=("a.wav", SPEECH)).text == join_texts(expected)


def test_a_model_that_is_not_whisper_does_not_serve_audio(whisper_path, tiny_model, offline,
                                                          tmp_path):
    """A pool of a Llama and the Whisper checkpoint: the Llama refuses audio, the
    Whisper model (a pool's engine) transcribes."""
    srv = RemoteServer([str(tiny_model(arch="llama")), str(whisper_path)], *ENGINE_FLAGS,
                       "--served-model-name", "llama", "whisper",
                       log_path=tmp_path / "pool.log")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        with pytest.raises(openai.BadRequestError, match="the model 'llama' does not serve audio"):
            client.audio.transcriptions.create(model="llama", file=("a.wav", SPEECH))
        expected = offline_segments(offline, SPEECH, prompt_ids(offline))
        assert client.audio.transcriptions.create(
            model="whisper", file=("a.wav", SPEECH)).text == join_texts(expected)
    finally:
        assert srv.stop() == 0, srv.log()
