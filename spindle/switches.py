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


# SPINDLE_* variables that choose no kernel variant (secrets, paths, logging, serving):
# a kernel plan's fingerprint leaves them out (kernel_switch_settings).
NO_KERNEL_EFFECT = frozenset({
    "SPINDLE_API_KEY", "SPINDLE_LOG_LEVEL", "SPINDLE_SERVER_DEV_MODE", "SPINDLE_START_CACHE",
    "SPINDLE_START_CACHE_DIR", "SPINDLE_CPU_KERNELS_DIR", "SPINDLE_GGUF_CACHE",
    "SPINDLE_COMPILE_AHEAD", "SPINDLE_CUDA_EARLY_START"})


def kernel_switch_settings(environ: Mapping[str, str] = os.environ) -> str:
    """The SPINDLE_* settings of this process that may change which kernel variants an
    engine launches (every one not in NO_KERNEL_EFFECT, unknown ones included), as one
    line: part of a kernel plan's fingerprint (runner/kernel_plan.py), so that a start
    under other switches does not load a plan made without them."""
    return ";".join(f"{name}={value}" for name, value in sorted(environ.items())
                    if name.startswith("SPINDLE_") and name not in NO_KERNEL_EFFECT)
