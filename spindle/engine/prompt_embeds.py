"""Prompts given as embeddings: {"prompt_embeds": tensor [num_tokens, hidden]}.

The engine core schedules token counts, so such a prompt gets placeholder token
ids: the out-of-vocabulary id vocab_size, which no model embeds (PromptEmbedsState
places the embeddings at those positions) and the sampler's penalties ignore
(it is their padding id). The tensor itself travels with the request, on the CPU,
until the runner moves it to the device once.
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.config import EngineConfig

KEY = "prompt_embeds"


def is_prompt_embeds(prompt: Any) -> bool:
    return isinstance(prompt, dict) and KEY in prompt


def prompt_embeds_input(prompt: dict, config: EngineConfig) -> tuple[torch.Tensor, list[int]]:
    """(the checked embeddings as a contiguous CPU tensor, their placeholder ids)."""
    if not config.model.enable_prompt_embeds:
        raise ValueError("prompt_embeds need an engine started with enable_prompt_embeds=True "
                         "(and enable_prefix_caching=False)")
    embeds = prompt[KEY]
    if not isinstance(embeds, torch.Tensor) or not embeds.is_floating_point():
        raise ValueError(f"prompt_embeds must be a floating-point torch.Tensor, got "
                         f"{type(embeds).__name__}")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    hidden = config.model.hf_config.hidden_size
    if embeds.dim() != 2 or embeds.shape[0] < 1 or embeds.shape[1] != hidden:
        raise ValueError(f"prompt_embeds must have shape [num_tokens >= 1, {hidden}], got "
                         f"{tuple(embeds.shape)}")
    embeds = embeds.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError("prompt_embeds holds NaN or infinite values")
    return embeds, [config.model.vocab_size] * embeds.shape[0]
