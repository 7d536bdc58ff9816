"""The scoped forward context: what one forward pass needs besides its tensors.

Attention layers read the step's attention metadata from here instead of taking it
as an argument through every model class. The context is set with
``with forward_context(metadata):`` around exactly one forward pass and is cleared
on exit, so nothing leaks between steps, engines or tests (reset_forward_context()
exists for tests that want to be certain).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class ForwardContext:
    """attn_metadata: one metadata object every caching layer reads, or a list with
    one entry per cache group (spindle/cache/spec.py), indexed by a layer's
    cache_group; None for a cache-less run."""

    attn_metadata: Any
    # LoRA: the step's adapters (lora/layers.py LoRAStep); None where the engine serves
    # none, or the step uses none.
    lora: Any = None

    def for_group(self, group: int) -> Any:
        """The metadata of one cache group (the one object when there is no list)."""
        if isinstance(self.attn_metadata, (list, tuple)):
            return self.attn_metadata[group]
        return self.attn_metadata


class _ContextHolder(threading.local):
    current: ForwardContext | None = None


_holder = _ContextHolder()


@contextlib.contextmanager
def forward_context(attn_metadata: Any, lora: Any = None) -> Iterator[ForwardContext]:
    previous = _holder.current
    _holder.current = ForwardContext(attn_metadata=attn_metadata, lora=lora)
    try:
        yield _holder.current
    finally:
        _holder.current = previous


def get_forward_context() -> ForwardContext:
    if _holder.current is None:
        raise RuntimeError("no forward context: run the model inside `with forward_context(...)`")
    return _holder.current


def current_lora() -> Any:
    """The step's adapters (a LoRAStep), or None: none served, none used by the step, or
    no forward pass running."""
    return None if _holder.current is None else _holder.current.lora


def reset_forward_context() -> None:
    _holder.current = None
