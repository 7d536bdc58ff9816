"""`spindle transcribe`: audio files to text offline, the server's windows, prompts and
formats; compared with LLM.generate on the same windows (tests/test_server_audio.py's
offline_segments) and with transformers' language detection."""

from __future__ import annotations

import json

import pytest

from spindle import LLM
from spindle.entrypoints.cli import main
from spindle.entrypoints.openai.transcription_formats import join_texts, srt
from spindle.tools.tiny_whisper import synthetic_audio
from test_server_audio import (SPEECH, UPLOAD_RATE, detected_language, offline_segments,
                               prompt_ids, wav_bytes)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("audio")
    first, second = folder / "speech.wav", folder / "other.wav"
    first.write_bytes(SPEECH)
    second.write_bytes(wav_bytes(synthetic_audio(1.5, seed=7, sampling_rate=UPLOAD_RATE),
                                 UPLOAD_RATE))
    return first, second


@pytest.fixture(scope="module")
def offline(tiny_whisper):
    llm = LLM(str(tiny_whisper()), device="cpu", dtype="float32")
    yield llm
    llm.shutdown()


def run(capsys, *argv) -> str:
    assert main(["transcribe", *map(str, argv)]) == 0
    return capsys.readouterr().out


def test_text_and_srt_equal_offline_generate(tiny_whisper, files, offline, capsys):
    path, (first, second) = tiny_whisper(), files
    model = ["--model", path, "--device", "cpu", "--dtype", "float32"]
    french = offline_segments(offline, SPEECH, prompt_ids(offline, language="fr"))
    assert run(capsys, first, *model, "--language", "fr") == join_texts(french) + "\n"
    assert run(capsys, first, *model, "--language", "fr", "--format", "srt") == srt(french)
    # Two files, the language detected on each (transformers' choice), verbose json.
    out = run(capsys, first, second, *model, "--format", "verbose_json").splitlines()
    assert out[0] == f"==> {first} <==" and out[2] == f"==> {second} <=="
    for line, data in ((out[1], SPEECH), (out[3], second.read_bytes())):
        answer = json.loads(line)
        language = detected_language(path, data)
        expected = offline_segments(offline, data, prompt_ids(offline, language, data=data))
        assert answer["language"] == language and answer["text"] == join_texts(expected)


def test_bad_input_is_named(tiny_whisper, tiny_model, files, tmp_path, capsys):
    assert main(["transcribe", str(tmp_path / "missing.wav"), "--model",
                 str(tiny_whisper())]) == 2
    assert "no such audio file" in capsys.readouterr().err
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"not audio" * 10)
    assert main(["transcribe", str(garbage), "--model", str(tiny_whisper())]) == 2
    assert "could not decode the audio file" in capsys.readouterr().err
    assert main(["transcribe", str(files[0]), "--model", str(tiny_model("llama"))]) == 2
    assert "does not transcribe audio" in capsys.readouterr().err
