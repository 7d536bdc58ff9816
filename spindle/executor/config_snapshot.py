"""The engine config as sent to worker processes: the HF config becomes plain data.

Unpickling a transformers config object imports transformers (1 to 4 s of CPU time
on a 2-core CPU, depending on its version: docs/benchmarks.md). Workers read the HF
config only through attributes (getattr), so they get a ConfigSnapshot instead: the
same attribute values, including class-level defaults and attribute_map aliases, with
nested configs snapshotted too, and no transformers import to load it. It copies the
attributes of whatever config object the engine holds, so it keeps no table of
transformers' own and follows any version of it.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
from typing import Any

import torch

from spindle.config import EngineConfig

__all__ = ["ConfigSnapshot", "config_for_workers", "snapshot_hf_config"]

_PLAIN = (bool, int, float, str, type(None), torch.dtype)


class ConfigSnapshot(types.SimpleNamespace):
    """The plain-data attributes of a transformers config (read-only by convention)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() if isinstance(v, ConfigSnapshot) else v
                for k, v in vars(self).items()}


def config_for_workers(config: EngineConfig) -> EngineConfig:
    """config with its HF config replaced by a ConfigSnapshot (already one: unchanged)."""
    hf_config = config.model.hf_config
    if isinstance(hf_config, ConfigSnapshot) or hf_config is None:
        return config
    model = dataclasses.replace(config.model, hf_config=snapshot_hf_config(hf_config))
    return config.replace(model=model)


def snapshot_hf_config(hf_config: Any) -> ConfigSnapshot:
    values: dict[str, Any] = {}
    for cls in reversed(type(hf_config).__mro__):  # class defaults, most derived last
        for name, value in vars(cls).items():
            if not name.startswith("__") and _is_data(value):
                values[name] = _snapshot_value(value)
    for name, value in vars(hf_config).items():
        if _is_data(value):
            values[name] = _snapshot_value(value)
    with warnings.catch_warnings():  # aliases of deprecated names may warn on access
        warnings.simplefilter("ignore")
        for alias in (getattr(hf_config, "attribute_map", None) or {}):
            try:
                values[alias] = _snapshot_value(getattr(hf_config, alias))
            except AttributeError:
                pass
    return ConfigSnapshot(**values)


def _is_data(value: Any) -> bool:
    return _is_config(value) or _is_plain(value)


def _is_config(value: Any) -> bool:
    # Nested transformers configs (text_config, vision_config, ...), without importing it.
    return hasattr(value, "to_dict") and hasattr(value, "__dict__") and not isinstance(value, type)


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_is_data(v) for v in value)
    if isinstance(value, dict):
        return all(_is_plain(k) and _is_data(v) for k, v in value.items())
    return False


def _snapshot_value(value: Any) -> Any:
    if _is_config(value) and not isinstance(value, ConfigSnapshot):
        return snapshot_hf_config(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(_snapshot_value(v) for v in value)
    if isinstance(value, dict):
        return {k: _snapshot_value(v) for k, v in value.items()}
    return value
