"""The bytes each token of a vocabulary stands for, and a walk of all of them at once
through a byte automaton.

Structured outputs work on UTF-8 bytes, not on text: a byte-level BPE token may hold
half a character, and a SentencePiece byte-fallback token (<0x0A>) one byte. The bytes
come from the tokenizer's backend (a `tokenizers.Tokenizer`, which transformers' fast
tokenizers and spindle's CachedTokenizer both expose):

- a ByteLevel decoder (GPT-2, Llama 3, Qwen): each character of a token is one byte,
  through GPT-2's printable byte alphabet;
- otherwise (SentencePiece-style: Llama 2, Mistral, Gemma): "▁" is a space and
  "<0xHH>" the byte HH; every other character is its UTF-8.

Special tokens stand for no bytes (None): they never continue a structured output.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

_SPIECE_SPACE = "\u2581"


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from the printable character standing for a byte to the byte: the
    printable ASCII and Latin-1 bytes stand for themselves, the others for 256 + n."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def token_byte_strings(backend: Any) -> list[bytes | None]:
    """Per token id of backend (a tokenizers.Tokenizer), the bytes it decodes to, or
    None for a special token or an id with no token."""
    spec = json.loads(backend.to_str())
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    added = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
    byte_level = _has_byte_level_decoder(spec.get("decoder"))
    alphabet = byte_level_alphabet() if byte_level else {}
    out: list[bytes | None] = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        if token_id in special:
            out.append(None)
        elif token_id in added:  # (added tokens are kept as plain text)
            out.append(added[token_id].encode())
        else:
            token = backend.id_to_token(token_id)
            out.append(None if token is None else
                       _byte_level_bytes(token, alphabet) if byte_level else
                       _sentencepiece_bytes(token))
    return out


def _has_byte_level_decoder(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level_decoder(d) for d in decoder.get("decoders", []) or [])


def _byte_level_bytes(token: str, alphabet: dict[str, int]) -> bytes:
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:  # not in the byte alphabet: a plain-text token
        return token.encode()


def _sentencepiece_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace(_SPIECE_SPACE, " ").encode()


class TokenVocab:
    """A vocabulary's byte strings as arrays, to walk every token through an automaton
    in a few numpy operations (one per byte position) instead of a loop per token.

    Tokens are kept sorted by length, longest first, so that position j of the walk
    only touches the tokens longer than j (a prefix of that order)."""

    def __init__(self, byte_strings: list[bytes | None], vocab_size: int) -> None:
        """vocab_size: the logits' width. It may exceed the tokenizer's (padding rows,
        never allowed); tokens past it cannot be sampled and are left out."""
        self.vocab_size = vocab_size
        usable = [(i, b) for i, b in enumerate(byte_strings[:vocab_size]) if b]
        usable.sort(key=lambda item: -len(item[1]))
        self.token_ids = np.array([i for i, _ in usable], dtype=np.int64)
        lengths = np.array([len(b) for _, b in usable], dtype=np.int64)
        width = int(lengths[0]) if len(usable) else 0
        self.bytes = np.zeros((len(usable), width), dtype=np.uint8)
        for row, (_, data) in enumerate(usable):
            self.bytes[row, :len(data)] = np.frombuffer(data, dtype=np.uint8)
        # active[j]: how many tokens (a prefix of the order) are longer than j.
        self.active = np.searchsorted(-lengths, -np.arange(width), side="left")

    def walk(self, transitions: np.ndarray, byte_classes: np.ndarray, state: int) -> np.ndarray:
        """The state each token leads to from state (-1: the automaton dies on it), in
        this vocabulary's token order. transitions: [states, classes], -1 for none.

        Byte position j steps only the tokens still alive and longer than j: from a
        state between JSON's punctuation most of a vocabulary dies at its first byte."""
        states = np.full(len(self.token_ids), state, dtype=np.int32)
        walking = np.arange(len(self.token_ids))  # ascending, so longest first
        for j, longer in enumerate(self.active.tolist()):
            walking = walking[:np.searchsorted(walking, longer)]
            if not len(walking):
                break
            stepped = transitions[states[walking], byte_classes[self.bytes[walking, j]]]
            states[walking] = stepped
            walking = walking[stepped >= 0]
        return states
