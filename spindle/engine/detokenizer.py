"""Incremental detokenization and stop-string detection for one sample.

Fast (Rust) tokenizers decode one token at a time through tokenizers'
DecodeStream, primed with the end of the prompt so that spacing and multi-byte
characters come out exactly as a full decode would produce them. Other
tokenizers fall back to decoding the whole output each step (correct, slower).
A sample whose text is read only at its end (an offline batch) and that has no stop
string to watch is decoded once, when its text is read.
"""

from __future__ import annotations

from typing import Any

from spindle.sampling_params import SamplingParams

_PRIME_TOKENS = 6  # prompt tokens fed to the stream first, for context-dependent decoders


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams,
                 text_at_end: bool = False) -> None:
        """text_at_end: the text is read only once the sample ends (an offline batch).
        Without stop strings to watch, add_token() then only keeps the id and the text
        is decoded once, when read: per-token work off the engine's step loop."""
        self.tokenizer = tokenizer
        self.params = params
        self._text = ""
        self.token_ids: list[int] = []
        self._stops = list(params.stop or [])
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._deferred = text_at_end and not self._stops
        self._decoded = 0  # (deferred) how many tokens _text reflects
        self._stream = None
        self._prime: list[int] = []
        self._pending = False  # the stream holds bytes of an incomplete character
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._backend = backend
            self._prime = self._whole_characters(list(prompt_token_ids[-_PRIME_TOKENS:]))
            if not self._deferred:
                from tokenizers.decoders import DecodeStream

                self._stream = DecodeStream(ids=self._prime,
                                            skip_special_tokens=params.skip_special_tokens)

    def _whole_characters(self, prime: list[int]) -> list[int]:
        """prime without its last tokens while they end inside a character: bytes of
        the prompt's would otherwise join the output's (the stream then even emits the
        prompt's text as output)."""
        skip = self.params.skip_special_tokens
        while prime and self.tokenizer.decode(prime, skip_special_tokens=skip).endswith("\ufffd"):
            prime = prime[:-1]
        return prime

    @property
    def output_text(self) -> str:
        if self._deferred and self._decoded != len(self.token_ids):
            self._text = self._decode_whole()
            self._decoded = len(self.token_ids)
        return self._text

    def add_token(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed, if any."""
        self.token_ids.append(token_id)
        if self._deferred:
            return None
        before = len(self._text)
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
            self._pending = piece is None
            if piece:
                self._text += piece
        else:
            self._text = self.tokenizer.decode(
                self.token_ids, skip_special_tokens=self.params.skip_special_tokens)
        return self._check_stop(before) if self._stops else None

    def finish(self) -> None:
        """Flush what the stream holds back for an incomplete character: a full
        decode renders it as a replacement character, and so must we."""
        if not (self._stream is not None and self._pending):
            return
        self._text = self._decode_whole()
        self._pending = False

    def _decode_whole(self) -> str:
        """The output's text as a full decode gives it: decoded after the prompt's last
        tokens (so that spacing is as in context), less their own text."""
        skip = self.params.skip_special_tokens
        if not self._prime:
            return self.tokenizer.decode(self.token_ids, skip_special_tokens=skip)
        base = self.tokenizer.decode(self._prime, skip_special_tokens=skip)
        full = self.tokenizer.decode(self._prime + self.token_ids, skip_special_tokens=skip)
        if full.startswith(base):
            return full[len(base):]
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=skip)

    def _check_stop(self, previous_len: int) -> str | None:
        # A stop string may straddle the previous text and the new piece.
        start = max(0, previous_len - self._max_stop_len + 1)
        found_at, found = None, None
        for stop in self._stops:
            idx = self._text.find(stop, start)
            if idx != -1 and (found_at is None or idx < found_at):
                found_at, found = idx, stop
        if found is None:
            return None
        end = found_at + len(found) if self.params.include_stop_str_in_output else found_at
        self._text = self._text[:end]
        return found
