"""config.json -> the HF config spindle serves, read by transformers (imported on use)
or, on a later start, from the start cache as plain data.

The config is transformers' own (AutoConfig), so its defaults, derived fields and rope
handling are whatever the installed transformers does; spindle keeps no copy of them.
Importing transformers here, not at module level, keeps `from spindle import LLM` free
of it. What spindle keeps of the config is a ConfigSnapshot: its attribute values as
plain data, which worker processes unpickle without transformers and which the start
cache (start_cache.py) stores, keyed by the path, config.json's bytes and transformers'
version,
so that a later start of the same checkpoint imports no transformers for its config.
docs/benchmarks.md ("Reading the HF config and tokenizer", "A start without
transformers") measures both.
"""

from __future__ import annotations

import json
import os
import types
import warnings
from pathlib import Path
from typing import Any

import torch

from spindle import start_cache

__all__ = ["ConfigSnapshot", "load_hf_config", "read_config_json", "snapshot_hf_config"]


def load_hf_config(path: str | os.PathLike, raw: dict[str, Any] | None = None) -> Any:
    """The config of path/config.json: a ConfigSnapshot of AutoConfig's, from the start
    cache when an earlier start stored it (with the cache off, AutoConfig's object
    itself). raw: path/config.json, when the caller has read it already (its checks
    are then not repeated). Raises ValueError for a config.json that is not a JSON
    object or that transformers cannot read."""
    path = Path(path)
    if raw is None:
        read_config_json(path)  # a clear error before transformers' own
    if not start_cache.enabled():
        return _auto_config(path)
    # (The path too: transformers records it in the config, as _name_or_path, and a hub
    # cache's commit hash from it.)
    key = start_cache.entry_key("config", [str(path), (path / "config.json").read_bytes(),
                                           start_cache.package_version("transformers")])
    snapshot = start_cache.load(key)
    if not isinstance(snapshot, ConfigSnapshot):
        snapshot = snapshot_hf_config(_auto_config(path))
        start_cache.store(key, snapshot)
    return snapshot


def _auto_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for an unknown model_type
        raise ValueError(f"transformers cannot read {path / 'config.json'}: {e}") from e


def read_config_json(path: Path) -> dict[str, Any]:
    """path/config.json as a dict; ValueError naming the file when it is not a JSON object."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{file} is not a JSON object")
    return raw


# ------------------------------------------------------------------ the config as plain data
_PLAIN = (bool, int, float, str, type(None), torch.dtype)


class ConfigSnapshot(types.SimpleNamespace):
    """The plain-data attributes of a transformers config: the same values, including
    class-level defaults and attribute_map aliases, with nested configs snapshotted
    too. Spindle reads HF configs only through attributes, so this serves wherever
    transformers' object would. It copies the attributes of whatever config object it
    is given, so it keeps no table of transformers' own and follows any version of it.
    Read-only by convention, except where spindle derives the served config from the
    checkpoint's (registry.text_model_config)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() if isinstance(v, ConfigSnapshot) else v
                for k, v in vars(self).items()}


def snapshot_hf_config(hf_config: Any) -> ConfigSnapshot:
    if isinstance(hf_config, ConfigSnapshot):
        return hf_config
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
