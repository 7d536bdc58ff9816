"""How long a text prompt is in tokens, found out as cheaply as possible.

A prompt far over max_model_len should be refused before it is tokenized:
min_tokens() gives a sound lower bound on a text's token count from its length in
characters, and count_then_encode() checks the exact count before the token ids
are turned into Python objects (which, for millions of tokens, holds the GIL for
a long time).

The bound. Every token covers at most L characters of the normalized text, L the
longest token (in characters of its vocabulary entry, or bytes for byte-level
vocabularies, which are at least as many). So tokens >= normalized chars / L. This
holds only when nothing is dropped on the way: the model must be BPE with every
character representable (byte-level, byte fallback, or one unknown token per
character), pre-tokenizers must not remove characters (whitespace splitting does),
and normalizers must not remove them. Composing normalizers (NFC, NFKC) turn at
most 4 characters into one (the longest canonical decomposition), and leave ASCII
alone. For any other tokenizer, there is no bound (min_tokens() returns 0).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

# Normalizers that never shorten a text, and the ones that compose (shorten it by a
# factor of at most 4, and not at all when it is ASCII).
_NON_SHRINKING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_MAX_COMPOSED = 4
# Pre-tokenizers that keep every character (when their behavior is not "Removed").
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits",
                                     "Punctuation", "UnicodeScripts"})


class PromptLengthBound:
    """A sound lower bound on the number of tokens of a text, from its length.

    Built lazily (reading the vocabulary takes tens of milliseconds for a large
    one), the first time a text long enough to matter is measured; thread-safe.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._limits_found: tuple[int, int] | None = None  # (L, composition factor)
        self._built = False

    def min_tokens(self, text: str) -> int:
        """At least this many tokens (0 when the tokenizer allows no bound)."""
        limits = self._limits()
        if limits is None:
            return 0
        longest, factor = limits
        chars = len(text) if factor == 1 or text.isascii() else len(text) // factor
        return chars // longest

    def _limits(self) -> tuple[int, int] | None:
        if not self._built:
            with self._lock:
                if not self._built:
                    self._limits_found = _bound_limits(self._tokenizer)
                    self._built = True
        return self._limits_found


def count_then_encode(tokenizer: Any, text: str, add_special_tokens: bool,
                      check_count: Callable[[int], None]) -> list[int]:
    """tokenizer.encode(text, add_special_tokens=...), calling check_count(number of
    tokens) first; check_count raises to refuse. For a plain fast tokenizer the
    count is known before the ids become a Python list (the tokenizer's Rust code
    runs without the GIL; the list does not); otherwise after."""
    backend = _plain_backend(tokenizer)
    if backend is None:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        check_count(len(ids))
        return ids
    # (encode_batch releases the GIL; encode, for a single text, does not.)
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    (encoding,) = encode([text], add_special_tokens=add_special_tokens)
    check_count(len(encoding))
    return encoding.ids


def _plain_backend(tokenizer: Any) -> Any:
    """The tokenizers.Tokenizer that tokenizer.encode would call as it is, or None
    when encode does more (a subclass of its own, a setting it would first change)."""
    from spindle.engine.cached_tokenizer import CachedTokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    if isinstance(tokenizer, CachedTokenizer):  # its encode is the backend's, by design
        unchanged = getattr(tokenizer.encode, "__func__", None) is CachedTokenizer.encode
        return backend if unchanged else None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if (getattr(tokenizer.encode, "__func__", None) is not PreTrainedTokenizerBase.encode
            or getattr(tokenizer._encode_plus, "__func__", None)
            is not TokenizersBackend._encode_plus):
        return None
    if getattr(tokenizer, "split_special_tokens", False) != backend.encode_special_tokens:
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    return backend


def _bound_limits(tokenizer: Any) -> tuple[int, int] | None:
    """(longest token in characters, composition factor), or None: no sound bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    factor = _normalizer_factor(_state(backend.normalizer))
    pre_tokenizer = _state(backend.pre_tokenizer)
    if factor is None or not _keeps_characters(pre_tokenizer):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    if not _covers_every_character(backend.model, vocab, _is_byte_level(pre_tokenizer)):
        return None
    longest = max((len(token) for token in vocab), default=0)
    return (longest, factor) if longest > 0 else None


def _state(component: Any) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_factor(state: dict | None) -> int | None:
    """How many characters at most become one; None if characters may be removed."""
    if state is None:
        return 1
    kind = state.get("type")
    if kind == "Sequence":
        factor = 1
        for part in state.get("normalizers", []):
            part_factor = _normalizer_factor(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind in _COMPOSING_NORMALIZERS:
        return _MAX_COMPOSED
    if kind in _NON_SHRINKING_NORMALIZERS:
        return 1
    if kind == "Replace":
        pattern = state.get("pattern", {})
        if "String" in pattern and len(state.get("content", "")) >= len(pattern["String"]):
            return 1
    return None


def _keeps_characters(state: dict | None) -> bool:
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in state.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and state.get("behavior") != "Removed"


def _is_byte_level(state: dict | None) -> bool:
    if state is None:
        return False
    if state.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in state.get("pretokenizers", []))
    return state.get("type") == "ByteLevel"


def _covers_every_character(model: Any, vocab: dict[str, int], byte_level: bool) -> bool:
    """Whether every character of a text becomes part of some token: BPE silently
    drops a character it has no token for when there is no unknown token, and fuses
    a run of unknown characters into one token when fuse_unk is set."""
    if byte_level:
        from tokenizers.pre_tokenizers import ByteLevel

        return all(c in vocab for c in ByteLevel.alphabet())
    if getattr(model, "byte_fallback", False):
        return True
    return getattr(model, "unk_token", None) is not None and not getattr(model, "fuse_unk", True)
