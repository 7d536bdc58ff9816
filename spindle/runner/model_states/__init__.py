"""Registry of model states: a model class names its kind, the kind names a state."""

from __future__ import annotations

import importlib

from torch import nn

_STATES = {
    "decoder": "spindle.runner.model_states.default:DefaultModelState",
}


def register_model_state(kind: str, import_path: str) -> None:
    _STATES[kind] = import_path


def model_state_class(model: nn.Module) -> type:
    kind = getattr(model, "model_kind", "decoder")
    if kind not in _STATES:
        raise ValueError(f"no model state for model kind {kind!r}; known: {sorted(_STATES)}")
    module, name = _STATES[kind].split(":")
    return getattr(importlib.import_module(module), name)
