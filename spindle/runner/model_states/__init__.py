"""Registry of model states: a model class names its kind, the kind names a state.

A per-request input mode that a kind can be extended with (prompt embeddings for
decoders) is its own state, registered as "<kind>+<mode>" and chosen by config.
check_config() runs at config time, so a feature a state cannot serve is refused
before any model is loaded.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

_STATES = {
    "decoder": "spindle.runner.model_states.default:DefaultModelState",
    "decoder+prompt_embeds": "spindle.runner.model_states.prompt_embeds:PromptEmbedsState",
    "encoder": "spindle.runner.model_states.encoder_only:EncoderOnlyModelState",
    "hybrid": "spindle.runner.model_states.mamba_hybrid:MambaHybridModelState",
    "encoder_decoder": "spindle.runner.model_states.encoder_decoder:EncoderDecoderModelState",
}


def register_model_state(kind: str, import_path: str) -> None:
    _STATES[kind] = import_path


def state_key(model_kind: str, config: Any | None) -> str:
    """The registry key of the state serving model_kind under config."""
    if config is not None and getattr(config.model, "enable_prompt_embeds", False):
        return f"{model_kind}+prompt_embeds"
    return model_kind


def model_state_class(model: nn.Module | str, config: Any | None = None) -> type:
    """The state class for a model (or a model kind) under config."""
    kind = model if isinstance(model, str) else getattr(model, "model_kind", "decoder")
    key = state_key(kind, config)
    if key not in _STATES:
        if key != kind and kind in _STATES:
            raise ValueError(f"enable_prompt_embeds is not supported for {kind} models")
        raise ValueError(f"no model state for model kind {key!r}; known: {sorted(_STATES)}")
    module, name = _STATES[key].split(":")
    return getattr(importlib.import_module(module), name)


def check_config(config: Any) -> None:
    """Config-time validation: the model's state exists and serves every configured feature."""
    model_state_class(config.model.model_kind, config).check_config(config)
