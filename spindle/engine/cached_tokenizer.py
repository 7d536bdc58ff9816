"""The engine's tokenizer without transformers: transformers' tokenizer as it built it,
kept as plain data, and the few methods the engine calls on it.

A transformers 5 fast tokenizer (TokenizersBackend) does its work in a
`tokenizers.Tokenizer` (Rust) that it builds at load time, sometimes from its class's
own code rather than tokenizer.json. `encode` and `decode` of the plain classes are
that backend's calls plus a little Python. tokenizer_state() keeps the backend as
built (its JSON) with the Python-side attributes those calls read; CachedTokenizer
answers from them exactly as transformers' object would, so a later start needs
neither transformers' import nor its loading (start_cache.py).

Only a tokenizer whose class keeps transformers' own encode/decode paths qualifies
(no subclass overrides, a clean-up rule this module knows); any other stays
transformers' object (why: logged). Truncation and padding baked into a backend
(sentence-transformers' tokenizer.json often has them) are dropped, as transformers
drops them on every call that does not ask for them; `__call__` with truncation=True
(the embedding path) truncates as transformers' does.

Chat templates render as transformers renders them: the same sandboxed jinja
environment and helpers, the same message normalisation, the special tokens as
template variables. Options the engine never passes (tools given as functions,
documents, continue_final_message, assistant masks, batches of conversations) go to
transformers' own tokenizer, loaded on first need (`hf_tokenizer`), which is also
what `LLM.get_tokenizer()` returns. tests/test_cached_tokenizer.py compares every
method with transformers on real and tiny tokenizers.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Mapping
from datetime import datetime
from typing import Any

# The text clean-up transformers applies after decoding, when asked for it (by default
# the tokenizer's clean_up_tokenization_spaces; not for BPE models).
_CLEAN_UPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
              (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_BPE_CLEAN_UP_FLAG = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
# Names a message's reasoning may come under; templates read reasoning_content (and
# gpt-oss's, thinking).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers' bound above which model_max_length means "no limit".
_LARGE_INTEGER = int(1e20)
# apply_chat_template options that only transformers' tokenizer handles here.
_DELEGATED_OPTIONS = ("tools", "documents", "continue_final_message",
                      "return_assistant_tokens_mask", "return_tensors", "padding",
                      "truncation", "max_length", "tokenizer_kwargs",
                      "sanitize_control_tokens")


# ------------------------------------------------------------------ capturing transformers'
def why_not_cacheable(tokenizer: Any) -> str | None:
    """None when tokenizer_state(tokenizer) keeps all its encode/decode behaviour, else
    the reason it does not."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase as Base
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as Backend
    except ImportError:
        return "its transformers has no TokenizersBackend (transformers 5 has)"
    if not isinstance(tokenizer, Backend):
        return f"{type(tokenizer).__name__} is not a fast (tokenizers) tokenizer"
    inherited = {"encode": Base, "decode": Base, "__call__": Base, "apply_chat_template": Base,
                 "get_chat_template": Base, "convert_tokens_to_ids": Base,
                 "clean_up_tokenization": Base, "_get_padding_truncation_strategies": Base,
                 "_encode_plus": Backend, "_decode": Backend,
                 "set_truncation_and_padding": Backend, "convert_ids_to_tokens": Backend,
                 "_convert_token_to_id_with_added_voc": Backend, "get_vocab": Backend,
                 "__len__": Backend}
    for name, owner in inherited.items():
        if getattr(type(tokenizer), name, None) is not getattr(owner, name, None):
            return f"{type(tokenizer).__name__} has its own {name}"
    backend = tokenizer.backend_tokenizer
    if bool(tokenizer.split_special_tokens) != backend.encode_special_tokens:
        return "its split_special_tokens differs from its backend's"
    if _clean_up_blocked(tokenizer) is None:
        return "its decode clean-up rule is not one this module knows"
    return None


def _clean_up_blocked(tokenizer: Any) -> bool | None:
    """Whether transformers 5's _decode skips the clean-up for this tokenizer even when
    asked for it (it does for BPE models, unless a flag forces it); None when that flag
    is missing (another transformers: its rule is unknown here)."""
    if type(tokenizer.backend_tokenizer.model).__name__ != "BPE":
        return False
    flag = getattr(tokenizer, _BPE_CLEAN_UP_FLAG, None)
    return None if flag is None else not flag


def tokenizer_state(tokenizer: Any) -> dict[str, Any]:
    """What CachedTokenizer needs of transformers' tokenizer, as plain data (call
    why_not_cacheable first). Drops the truncation and padding its backend may carry,
    as transformers' first call without them would."""
    tokenizer.backend_tokenizer.no_truncation()
    tokenizer.backend_tokenizer.no_padding()
    added = [(index, token.content, token.single_word, token.lstrip, token.rstrip,
              token.normalized, token.special)
             for index, token in tokenizer.added_tokens_decoder.items()]
    return {
        "backend": tokenizer.backend_tokenizer.to_str(),
        "class_name": type(tokenizer).__name__,
        "name_or_path": tokenizer.name_or_path,
        "chat_template": tokenizer.chat_template,
        "special_tokens_map": dict(tokenizer.special_tokens_map),
        "special_token_ids": {name: getattr(tokenizer, name) for name in
                              ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")},
        "all_special_tokens": list(tokenizer.all_special_tokens),
        "all_special_ids": list(tokenizer.all_special_ids),
        "added_tokens": added,
        "split_special_tokens": bool(tokenizer.split_special_tokens),
        "clean_up_default": bool(tokenizer.clean_up_tokenization_spaces),
        "clean_up_blocked": bool(_clean_up_blocked(tokenizer)),
        "length": len(tokenizer),
        "model_max_length": tokenizer.model_max_length,
        "truncation_side": tokenizer.truncation_side,
    }


# ------------------------------------------------------------------ the engine's tokenizer
class CachedTokenizer:
    """transformers' tokenizer as the engine uses it, from tokenizer_state()'s data.
    Thread-safe: the backend's calls are, and nothing here changes after __init__
    except the lazily built extras (under a lock)."""

    def __init__(self, state: dict[str, Any], path: str, backend: Any = None) -> None:
        """backend: the tokenizers.Tokenizer of state["backend"] when the caller has it
        (transformers' own, on a first start: parsing the JSON again takes a quarter of
        a second for a 150k vocabulary). It must be nobody else's: transformers'
        tokenizer changes its backend's truncation and padding in place."""
        from tokenizers import AddedToken

        self._state = state
        self._path = path
        self._backend = self._backend_copy() if backend is None else backend
        self._lock = threading.Lock()
        self._split_backend: Any = None  # the backend with the other split_special_tokens
        self._truncating: dict[int, Any] = {}  # max_length -> a backend that truncates
        self._hf_tokenizer: Any = None
        self._templates: dict[str, Any] = {}
        self.name_or_path = state["name_or_path"]
        self.chat_template = state["chat_template"]
        self.special_tokens_map = dict(state["special_tokens_map"])
        self.split_special_tokens = state["split_special_tokens"]
        self.model_max_length = state["model_max_length"]
        self.all_special_tokens = list(state["all_special_tokens"])
        self.all_special_ids = list(state["all_special_ids"])
        for name, value in state["special_token_ids"].items():
            setattr(self, name, value)
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            setattr(self, name, self.special_tokens_map.get(name))
        self.added_tokens_decoder = {
            index: AddedToken(content, single_word=single, lstrip=lstrip, rstrip=rstrip,
                              normalized=normalized, special=special)
            for index, content, single, lstrip, rstrip, normalized, special
            in state["added_tokens"]}

    def _backend_copy(self) -> Any:
        """A tokenizers.Tokenizer of its own, built from the kept JSON (the variants
        with other settings are copies: the engine's backend is shared by threads)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self._state["backend"])

    def __repr__(self) -> str:
        return (f"CachedTokenizer({self._state['class_name']} of {self.name_or_path!r}, "
                f"{len(self)} tokens)")

    def __len__(self) -> int:
        return self._state["length"]

    @property
    def backend_tokenizer(self) -> Any:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    @property
    def hf_tokenizer(self) -> Any:
        """transformers' own tokenizer of the same files, loaded on first use."""
        with self._lock:
            if self._hf_tokenizer is None:
                from spindle.engine.tokenizer_loader import auto_tokenizer

                self._hf_tokenizer = auto_tokenizer(self._path)
            return self._hf_tokenizer

    # -------------------------------------------------------------- encoding
    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True,
               split_special_tokens: bool | None = None) -> list[int]:
        for name, value in (("text", text), ("text_pair", text_pair)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a str, got {type(value).__name__} "
                                 "(the engine's tokenizer encodes one text at a time)")
        item = (text, text_pair) if text_pair else text
        backend = self._backend_for(split_special_tokens)
        (encoding,) = backend.encode_batch([item], add_special_tokens=add_special_tokens)
        return encoding.ids

    def _backend_for(self, split_special_tokens: bool | None) -> Any:
        if split_special_tokens is None or split_special_tokens == self.split_special_tokens:
            return self._backend
        with self._lock:
            if self._split_backend is None:
                self._split_backend = self._backend_copy()
                self._split_backend.encode_special_tokens = split_special_tokens
            return self._split_backend

    def __call__(self, text: str | list[str], truncation: bool | None = None,
                 max_length: int | None = None, add_special_tokens: bool = True,
                 **kwargs: Any) -> Any:
        """{"input_ids": ids} of a text or list of texts, truncated as transformers'
        __call__ truncates (longest first, on the tokenizer's truncation side, to
        max_length or else model_max_length). Other options go to transformers'
        tokenizer (hf_tokenizer), which returns its BatchEncoding."""
        if kwargs or truncation not in (None, True, False):
            return self.hf_tokenizer(text, truncation=truncation, max_length=max_length,
                                     add_special_tokens=add_special_tokens, **kwargs)
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise ValueError("text must be a str or a list of str (the engine's tokenizer "
                             "encodes texts, not pre-tokenized words)")
        if max_length is not None and truncation is None:
            truncation = True  # (transformers: a max_length alone truncates)
        if truncation and max_length is None:
            limit = self.model_max_length
            max_length = limit if limit is not None and limit <= _LARGE_INTEGER else None
        backend = self._truncating_backend(max_length) if truncation and max_length else self._backend
        ids = [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        return {"input_ids": ids[0] if isinstance(text, str) else ids}

    def _truncating_backend(self, max_length: int) -> Any:
        with self._lock:
            backend = self._truncating.get(max_length)
            if backend is None:
                backend = self._truncating[max_length] = self._backend_copy()
                backend.enable_truncation(max_length, stride=0, strategy="longest_first",
                                          direction=self._state["truncation_side"])
            return backend

    # -------------------------------------------------------------- decoding
    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str | list[str]:
        token_ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
        if isinstance(token_ids, (list, tuple)) and token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces)
                    for ids in token_ids]
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self._state["clean_up_default"]
        if clean_up_tokenization_spaces and not self._state["clean_up_blocked"]:
            for before, after in _CLEAN_UPS:
                text = text.replace(before, after)
        return text

    def convert_ids_to_tokens(self, ids: int | list[int],
                              skip_special_tokens: bool = False) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skipped = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skipped]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            index = self._backend.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    # -------------------------------------------------------------- chat templates
    def get_chat_template(self, chat_template: str | None = None) -> str:
        """The template to render: the argument (a template, or the name of one of the
        tokenizer's), else the tokenizer's own (its "default" when it has several)."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if "default" not in own:
                    raise ValueError("this tokenizer has several chat templates and none is "
                                     f"named 'default': pass one of {sorted(own)}")
                return own["default"]
        elif chat_template is None:
            if own is None:
                raise ValueError("this tokenizer has no chat template; pass chat_template=")
            return own
        return chat_template

    def apply_chat_template(self, conversation: Any, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs: Any) -> str | list[int] | Any:
        """transformers' apply_chat_template for one conversation: the text, or with
        tokenize=True its ids (no special tokens added: the template writes them)."""
        wants_dict = tokenize and kwargs.get("return_dict", True)
        if (wants_dict or _is_batch(conversation)
                or any(kwargs.get(name) for name in _DELEGATED_OPTIONS)):
            return self.hf_tokenizer.apply_chat_template(
                conversation, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs)
        for name in (*_DELEGATED_OPTIONS, "return_dict"):  # (options set to "no", not
            kwargs.pop(name, None)                          # template variables)
        template = self.get_chat_template(chat_template)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        chat = _alias_reasoning_fields(_plain_data(_normalize_messages(conversation)))
        variables = _plain_data({**self.special_tokens_map, **kwargs})
        text = self._compiled(template).render(messages=chat, tools=None, documents=None,
                                               add_generation_prompt=add_generation_prompt,
                                               **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _compiled(self, template: str) -> Any:
        with self._lock:
            compiled = self._templates.get(template)
            if compiled is None:
                compiled = self._templates[template] = chat_environment().from_string(template)
            return compiled


def _is_batch(conversation: Any) -> bool:
    return (isinstance(conversation, (list, tuple)) and bool(conversation)
            and (isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")))


# ------------------------------------------------------------------ rendering, as transformers
def chat_environment() -> Any:
    """A sandboxed jinja environment with what transformers gives chat templates:
    trim_blocks and lstrip_blocks, loop controls, a {% generation %} tag (rendered as
    its body), tojson that keeps non-ASCII characters and takes indent / separators /
    sort_keys, raise_exception, strftime_now, and dict / namespace that refuse
    underscore names."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2 >= 3.1.6 (older versions have known "
                          f"sandbox escapes), found {jinja2.__version__}: pip install -U jinja2")

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"got {name!r}")

    class DictMaker:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict:
            return dict.fromkeys(*args)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=DictMaker(), namespace=Namespace)
    return env


def _normalize_messages(conversation: Any) -> list[dict]:
    """The messages as dicts (objects with model_dump, dataclasses), keys whose value
    is None dropped (templates handle a missing key, not a None)."""
    messages = _as_dicts(getattr(conversation, "messages", conversation))
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, dataclasses or pydantic models, "
                            f"got {message!r}")
        out.append({key: value for key, value in message.items() if value is not None})
    return out


def _as_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _as_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def _plain_data(value: Any) -> Any:
    """value rebuilt from JSON types only (what a template may see); anything else
    becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):  # subclasses back to their base type
        if isinstance(value, kind):
            return kind(value) if kind is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {_plain_data(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(item) for item in value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return _plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list) -> list:
    """A message's reasoning under every name templates read it by."""
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[key] for key in _REASONING_FIELDS
                              if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out
