"""Turning embedding prompts into core requests: truncating tokenization and checks.

Text is tokenized the way sentence-transformers does it: special tokens added,
truncated to the pooler's max_seq_len (sentence_bert_config.json's max_seq_length
when the checkpoint has one), lower-cased first when that config says so. An
empty string is a valid input (it is its special tokens). Prompts given as token
ids are taken as they are, but must fit the model and one step's token budget,
since a pooling request always runs whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from spindle.config import EngineConfig
from spindle.pooling_params import PoolingParams
from spindle.sampling_params import SamplingParams

# What a pooling request carries where a generating one has its sampling params:
# the runner's per-request bookkeeping expects some, and nothing samples with them.
POOLING_SAMPLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def check_pooling_params(config: EngineConfig, params: Any) -> PoolingParams:
    """The request's PoolingParams; ValueError unless this engine embeds."""
    if config.model.task != "embed":
        raise ValueError(f"this engine runs task={config.model.task!r}: embedding requests "
                         "need an engine started with task='embed'")
    if params is None:
        return PoolingParams()
    if not isinstance(params, PoolingParams):
        raise ValueError(f"this engine runs task='embed': pass PoolingParams (or use "
                         f"LLM.embed()), got {type(params).__name__}")
    return dataclasses.replace(params)  # validated again (its fields may have changed)


def tokenize_for_pooling(tokenizer: Any, prompt: Any, config: EngineConfig) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one embedding prompt: a string, a list of token
    ids, or a dict with 'prompt_token_ids' and/or 'prompt'."""
    if isinstance(prompt, dict):
        if "prompt_embeds" in prompt:
            raise ValueError("prompt_embeds are not supported for embedding requests")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _check_ids(list(prompt["prompt_token_ids"]), config)
        if "prompt" not in prompt:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        return prompt, _check_ids(encode_texts(tokenizer, [prompt], config)[0], config)
    if isinstance(prompt, (list, tuple)):
        return None, _check_ids(list(prompt), config)
    raise ValueError(f"an embedding prompt must be a string, a list of token ids or a dict, "
                     f"got {type(prompt).__name__}")


def pretokenize(tokenizer: Any, prompts: Sequence[Any], config: EngineConfig) -> list[Any]:
    """prompts with every string replaced by {'prompt', 'prompt_token_ids'}, all
    strings tokenized in one batched call (much faster than one call each)."""
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        return list(prompts)
    encoded = iter(encode_texts(tokenizer, texts, config))
    return [{"prompt": p, "prompt_token_ids": next(encoded)} if isinstance(p, str) else p
            for p in prompts]


def encode_texts(tokenizer: Any, texts: list[str], config: EngineConfig) -> list[list[int]]:
    pooler = config.pooler
    if pooler.do_lower_case:
        texts = [t.lower() for t in texts]
    return tokenizer(texts, truncation=True, max_length=pooler.max_seq_len)["input_ids"]


def _check_ids(token_ids: list[int], config: EngineConfig) -> list[int]:
    if not token_ids:
        raise ValueError("prompt is empty (no tokens)")
    vocab = config.model.vocab_size
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
    limit = min(config.model.max_model_len, config.scheduler.max_num_batched_tokens)
    if len(token_ids) > limit:
        raise ValueError(f"embedding prompt is {len(token_ids)} tokens long, more than "
                         f"{limit} (max_model_len and max_num_batched_tokens: an embedding "
                         "prompt runs whole in one step)")
    return token_ids
