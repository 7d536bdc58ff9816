"""Incremental detokenization and stop-string detection for one sample.

Fast (Rust) tokenizers decode one token at a time through tokenizers'
DecodeStream, primed with the end of the prompt so that spacing and multi-byte
characters come out exactly as a full decode would produce them. Other
tokenizers fall back to decoding the whole output each step (correct, slower).
"""

from __future__ import annotations

from typing import Any

from spindle.sampling_params import SamplingParams

_PRIME_TOKENS = 6  # prompt tokens fed to the stream first, for context-dependent decoders


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.token_ids: list[int] = []
        self._stops = list(params.stop or [])
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._stream = None
        self._prime: list[int] = []
        self._pending = False  # the stream holds bytes of an incomplete character
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._prime = list(prompt_token_ids[-_PRIME_TOKENS:])
            self._stream = DecodeStream(ids=self._prime,
                                        skip_special_tokens=params.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed, if any."""
        self.token_ids.append(token_id)
        before = len(self.output_text)
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
            self._pending = piece is None
            if piece:
                self.output_text += piece
        else:
            self.output_text = self.tokenizer.decode(
                self.token_ids, skip_special_tokens=self.params.skip_special_tokens)
        return self._check_stop(before) if self._stops else None

    def finish(self) -> None:
        """Flush what the stream holds back for an incomplete character: a full
        decode renders it as a replacement character, and so must we."""
        if not (self._stream is not None and self._pending):
            return
        skip = self.params.skip_special_tokens
        base = self.tokenizer.decode(self._prime, skip_special_tokens=skip)
        full = self.tokenizer.decode(self._prime + self.token_ids, skip_special_tokens=skip)
        if full.startswith(base):
            self.output_text = full[len(base):]
        else:
            self.output_text = self.tokenizer.decode(self.token_ids, skip_special_tokens=skip)
        self._pending = False

    def _check_stop(self, previous_len: int) -> str | None:
        # A stop string may straddle the previous text and the new piece.
        start = max(0, previous_len - self._max_stop_len + 1)
        found_at, found = None, None
        for stop in self._stops:
            idx = self.output_text.find(stop, start)
            if idx != -1 and (found_at is None or idx < found_at):
                found_at, found = idx, stop
        if found is None:
            return None
        end = found_at + len(found) if self.params.include_stop_str_in_output else found_at
        self.output_text = self.output_text[:end]
        return found
