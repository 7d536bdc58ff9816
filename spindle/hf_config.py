"""config.json -> transformers' config object, with transformers imported on first use.

The config is transformers' own (AutoConfig), so its defaults, derived fields and rope
handling are whatever the installed transformers does; spindle keeps no copy of them.
Importing transformers here, not at module level, keeps `from spindle import LLM` free
of it. docs/benchmarks.md ("Reading the HF config and tokenizer") measures what this
costs against the plain-data reading spindle once had.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def load_hf_config(path: str | os.PathLike, raw: dict[str, Any] | None = None) -> Any:
    """AutoConfig.from_pretrained(path). raw: path/config.json, when the caller has read
    it already (its checks are then not repeated). Raises ValueError for a config.json
    that is not a JSON object or that transformers cannot read."""
    if raw is None:
        read_config_json(Path(path))  # a clear error before transformers' own
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for an unknown model_type
        raise ValueError(f"transformers cannot read {Path(path) / 'config.json'}: {e}") from e


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
