"""On/off switches read from the environment (measuring knobs for options that stay
off until measured): "1" or "0", anything else refused with the variable's name."""

from __future__ import annotations

import os
from typing import Mapping


def on_off(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    raw = environ.get(name)
    if raw is None:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"
