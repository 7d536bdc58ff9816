"""Whisper's decoder prompt: the token ids a transcription or translation starts from.

Whisper's convention: an optional previous-text prompt (<|startofprev|> and the text's
tokens), then <|startoftranscript|>, the language (<|en|>), the task (<|transcribe|> or
<|translate|>) and <|notimestamps|>. English-only checkpoints (is_multilingual false)
take no language or task token. The ids come from the checkpoint's
generation_config.json where it names them, else from the tokenizer's vocabulary.
"""

from __future__ import annotations

import re
from typing import Any

# The language of a request that names none, where it is not detected (English-only
# checkpoints; the server detects it on multilingual ones).
DEFAULT_LANGUAGE = "en"
TASKS = ("transcribe", "translate")
_LANGUAGE_TOKEN = re.compile(r"^<\|([a-z]{2,3})\|>$")


def decoder_prompt_ids(tokenizer: Any, generation_config: dict[str, Any], language: str | None,
                       task: str, prompt: str | None,
                       max_prompt_tokens: int | None = None) -> list[int]:
    """The decoder prompt of one audio window; ValueError for an unknown language or task.

    language None means DEFAULT_LANGUAGE ("en"). prompt: text the transcription should
    follow on from (style, spelling of names), encoded with a leading space and no
    special tokens; special-token strings in it stay plain text. Only its last
    max_prompt_tokens tokens are kept (Whisper keeps half its context for them).
    """
    tokens = _SpecialTokens(tokenizer, generation_config)
    ids = tokens.previous_text(prompt, max_prompt_tokens)
    ids.append(tokens.get("decoder_start_token_id", "<|startoftranscript|>"))
    ids += tokens.language_and_task(language, task)
    ids.append(tokens.get("no_timestamps_token_id", "<|notimestamps|>"))
    return ids


def language_token_ids(tokenizer: Any, generation_config: dict[str, Any]) -> dict[str, int]:
    """The checkpoint's language tokens by code ({"en": id, ...}): generation_config's
    lang_to_id, else every <|xx|> token of the vocabulary; {} for an English-only one."""
    if not is_multilingual(tokenizer, generation_config):
        return {}
    names = generation_config.get("lang_to_id") or {
        token: token_id for token, token_id in tokenizer.get_vocab().items()}
    return {m.group(1): int(names[token]) for token in names
            if (m := _LANGUAGE_TOKEN.match(token))}


def language_detection(tokenizer: Any, generation_config: dict[str, Any], samples: Any,
                       sampling_rate: int) -> tuple[dict, Any, dict[int, str]] | None:
    """Whisper's language detection on one window, as an engine request: (the prompt,
    its SamplingParams, language code by token id). The request's one greedy token,
    after <|startoftranscript|> alone and among the language tokens only, names the
    language. None for an English-only checkpoint (nothing to detect)."""
    from spindle.sampling_params import SamplingParams

    languages = language_token_ids(tokenizer, generation_config)
    if not languages:
        return None
    start = _SpecialTokens(tokenizer, generation_config).get("decoder_start_token_id",
                                                             "<|startoftranscript|>")
    prompt = {"prompt_token_ids": [start],
              "multi_modal_data": {"audio": (samples, sampling_rate)}}
    params = SamplingParams(temperature=0.0, max_tokens=1,
                            allowed_token_ids=sorted(languages.values()))
    return prompt, params, {token_id: code for code, token_id in languages.items()}


def is_multilingual(tokenizer: Any, generation_config: dict[str, Any]) -> bool:
    """Whether the checkpoint takes language and task tokens: its generation config's
    is_multilingual; without one, whether it has a language token map or <|en|>."""
    if "is_multilingual" in generation_config:
        return bool(generation_config["is_multilingual"])
    return bool(generation_config.get("lang_to_id")) or _vocab_id(tokenizer, "<|en|>") is not None


class _SpecialTokens:
    """The special token ids of one checkpoint, looked up as a prompt needs them."""

    def __init__(self, tokenizer: Any, generation_config: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.config = generation_config

    def get(self, config_key: str, token: str) -> int:
        """The id generation_config[config_key] names, else token's in the vocabulary."""
        return _id_or_token(self.tokenizer, self.config.get(config_key), token, config_key)

    def previous_text(self, prompt: str | None, max_tokens: int | None) -> list[int]:
        if prompt is None or not prompt.strip():
            return []
        text_ids = list(self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False,
                                              split_special_tokens=True))
        if max_tokens is not None:
            text_ids = text_ids[len(text_ids) - max_tokens:] if max_tokens > 0 else []
        return [self.get("prev_sot_token_id", "<|startofprev|>"), *text_ids]

    def language_and_task(self, language: str | None, task: str) -> list[int]:
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(map(repr, TASKS))}, got {task!r}")
        code = DEFAULT_LANGUAGE if language is None else language.strip().lower()
        if not is_multilingual(self.tokenizer, self.config):
            if code != "en" or task != "transcribe":
                raise ValueError(f"this checkpoint is English-only: it transcribes English and "
                                 f"nothing else (got language {code!r}, task {task!r})")
            return []
        return [self._language_id(code), self._task_id(task)]

    def _language_id(self, code: str) -> int:
        lang_to_id = self.config.get("lang_to_id") or {}
        token = f"<|{code}|>"
        token_id = lang_to_id.get(token) if lang_to_id else _vocab_id(self.tokenizer, token)
        if token_id is None or not _LANGUAGE_TOKEN.match(token):
            raise ValueError(f"language must be one of {', '.join(map(repr, self._languages()))}"
                             f" (an ISO-639-1 code), got {code!r}")
        return token_id

    def _task_id(self, task: str) -> int:
        task_to_id = self.config.get("task_to_id") or {}
        return _id_or_token(self.tokenizer, task_to_id.get(task), f"<|{task}|>", "task_to_id")

    def _languages(self) -> list[str]:
        names = self.config.get("lang_to_id") or self.tokenizer.get_vocab()
        return sorted(m.group(1) for m in map(_LANGUAGE_TOKEN.match, names) if m)


def _id_or_token(tokenizer: Any, configured: Any, token: str, config_key: str) -> int:
    if isinstance(configured, int) and not isinstance(configured, bool):
        return configured
    token_id = _vocab_id(tokenizer, token)
    if token_id is None:
        raise ValueError(f"this checkpoint has no {token} token (neither its "
                         f"generation_config.json's {config_key} nor its vocabulary has it): "
                         "is it a Whisper checkpoint?")
    return token_id


def _vocab_id(tokenizer: Any, token: str) -> int | None:
    """The id of token in the vocabulary (special tokens included), None if absent."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
        return None  # (absent tokens map to the unknown token's id, or None)
    return token_id
