"""Switches read from the environment (measuring knobs for options that stay off until
measured): on/off ones take "1" or "0", numeric ones an integer in their range; anything
else is refused with the variable's name."""

from __future__ import annotations

import os
from typing import Mapping


def integer(name: str, raw: str, low: int, high: int | None = None) -> int:
    """raw, the text of environment variable name, as an integer of at least low (and
    at most high), or a ValueError that names the variable (measuring knobs that take a
    number)."""
    value = int(raw) if raw.strip().isdigit() else low - 1
    if high is not None and not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}, got {raw!r}")
    if value < low:
        wanted = "a positive integer" if low == 1 else f"an integer of at least {low}"
        raise ValueError(f"{name} must be {wanted}, got {raw!r}")
    return value


def on_off(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    raw = environ.get(name)
    if raw is None:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"
