"""Prompts in, validated token ids out: everything about a prompt that is checked
before its request reaches the engine core.

LLMEngine.add_request runs it on the caller's thread; AsyncLLM runs it in its
tokenizer threads, so the engine's thread never tokenizes and keeps stepping.
It is thread-safe: it reads the config and uses the tokenizer read-only (the
settings transformers writes into a tokenizer on its first use are written by
warm_up(), before any concurrent use).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Union

from spindle.config import EngineConfig
from spindle.engine.pooling_inputs import encode_texts, tokenize_for_pooling
from spindle.engine.prompt_embeds import is_prompt_embeds, prompt_embeds_input
from spindle.engine.prompt_length import PromptLengthBound, count_then_encode
from spindle.multimodal.processor import MM_KEY, AudioFeatures, has_media
from spindle.pooling_params import PoolingParams

PromptType = Union[str, list[int], dict[str, Any]]


def cache_salt_of(prompt: Any) -> str | None:
    """A prompt dict's cache_salt (a non-empty string), or None."""
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


class PromptTooLongError(ValueError):
    """A prompt that leaves no room for one generated token within max_model_len
    (servers answer it with code "context_length_exceeded")."""


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt made by InputProcessor.process: checked, and ready for the core."""

    text: str | None
    token_ids: list[int]
    embeds: Any = None  # prompt embeddings; token_ids are then placeholders
    # What the model's encoder reads (an encoder-decoder's audio features [mels, frames]).
    encoder_inputs: Any = None
    # The prompt dict's cache_salt: its prefix-cache blocks are shared only with
    # requests of the same salt (KVCacheManager's request_root_hash).
    cache_salt: str | None = None


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.length_bound = PromptLengthBound(tokenizer)
        # Encoder-decoder models (Whisper): every prompt carries audio, made into the
        # encoder's features here (spindle/multimodal/processor.py).
        self.audio = (AudioFeatures(config.model.model)
                      if config.model.model_kind == "encoder_decoder" else None)

    def is_pooling(self, params: Any) -> bool:
        return isinstance(params, PoolingParams) or self.config.model.task == "embed"

    def warm_up(self) -> None:
        """Tokenize once, so that the settings transformers writes into the tokenizer
        on first use are written now, before threads share it."""
        if self.config.model.task == "embed" and self.config.pooler is not None:
            encode_texts(self.tokenizer, ["warm up"], self.config)
        else:
            self.tokenizer.encode("warm up")

    def process(self, prompt: PromptType | ProcessedPrompt, params: Any = None) -> ProcessedPrompt:
        """The prompt of a request with params (SamplingParams or PoolingParams):
        tokenized and checked; ValueError naming the problem."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        salt = cache_salt_of(prompt)
        if salt is not None:
            if self.is_pooling(params):
                raise ValueError("cache_salt is for generate requests (an embedding request "
                                 "shares no cached prefix)")
            return dataclasses.replace(self._process(prompt, params), cache_salt=salt)
        return self._process(prompt, params)

    def _process(self, prompt: PromptType, params: Any) -> ProcessedPrompt:
        if self.is_pooling(params):
            return ProcessedPrompt(*tokenize_for_pooling(self.tokenizer, prompt, self.config))
        if self.audio is not None:
            return self._process_with_audio(prompt)
        if has_media(prompt):
            raise ValueError(f"{MM_KEY} is not supported by {self.config.model.architecture} "
                             "(a text-only model)")
        if is_prompt_embeds(prompt):
            if params is not None and getattr(params, "prompt_logprobs", None) is not None:
                raise ValueError("prompt_logprobs needs a prompt of token ids or text: a "
                                 "prompt given as embeddings has no tokens to score")
            embeds, placeholder_ids = prompt_embeds_input(prompt, self.config)
            return ProcessedPrompt(None, placeholder_ids, embeds)
        return ProcessedPrompt(*self._tokenize(prompt))

    def _process_with_audio(self, prompt: PromptType) -> ProcessedPrompt:
        """An encoder-decoder's prompt: {"prompt": text or "prompt_token_ids": ids (the
        decoder's start; default: the model's decoder start token), "multi_modal_data":
        {"audio": (waveform, sample_rate)}}."""
        arch = self.config.model.architecture
        if not has_media(prompt):
            raise ValueError(f"{arch} needs audio: pass a prompt dict with "
                             f"'{MM_KEY}': {{'audio': (waveform, sample_rate)}}")
        features = self.audio(prompt[MM_KEY])
        decoder = {k: v for k, v in prompt.items() if k != MM_KEY}
        if "prompt_token_ids" not in decoder and "prompt" not in decoder:
            start = getattr(self.config.model.hf_config, "decoder_start_token_id", None)
            if start is None:
                raise ValueError(f"a prompt for {arch} needs 'prompt' or 'prompt_token_ids' "
                                 "(its config names no decoder_start_token_id)")
            decoder["prompt_token_ids"] = [start]
        if "prompt_token_ids" in decoder:
            text, token_ids = self._tokenize(decoder)
        else:
            text = decoder["prompt"]
            if not isinstance(text, str) or not text:
                raise ValueError("prompt must be a non-empty string")
            # The decoder prompt is Whisper's own tokens: no tokenizer-added prefix.
            token_ids = self._check_token_ids(self.encode(text, add_special_tokens=False))
        return ProcessedPrompt(text, token_ids, encoder_inputs=features)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self._check_token_ids(self.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return None, self._check_token_ids(list(prompt))
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, "
                         f"got {type(prompt).__name__}")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a text prompt. One far over max_model_len is refused from
        its length in characters, before it is tokenized, when the tokenizer allows
        a sound bound (see prompt_length.py); else from its token count, before the
        ids are built."""
        max_len = self.config.model.max_model_len
        if len(text) >= max_len:  # (a shorter text has a bound below max_len)
            at_least = self.length_bound.min_tokens(text)
            if at_least >= max_len:
                raise self._too_long(at_least,
                                     f"at least {at_least} tokens ({len(text)} characters)")
        return count_then_encode(self.tokenizer, text, add_special_tokens, self.check_length)

    def check_length(self, num_tokens: int) -> None:
        if num_tokens >= self.config.model.max_model_len:
            raise self._too_long(num_tokens, f"{num_tokens} tokens")

    def _too_long(self, num_tokens: int, length: str) -> PromptTooLongError:
        max_len = self.config.model.max_model_len
        return PromptTooLongError(
            f"prompt is {length} long, but max_model_len is {max_len}: it must be at most "
            f"{max_len - 1} tokens to leave room for one generated token")

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("prompt is empty (no tokens)")
        self.check_length(len(token_ids))  # first: a long list is refused without a loop
        vocab = self.config.model.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        return token_ids
