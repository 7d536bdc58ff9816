"""Attention backend registry.

A backend is a class constructed as ``cls(num_heads, head_dim, scale, num_kv_heads,
sliding_window=None, logits_soft_cap=None, sinks=None, alibi_slopes=None,
attention_chunk_size=None)`` (a backend without a feature refuses it there, by name;
sinks: a tensor of one logit per query head, read at each call; alibi_slopes: one
float32 ALiBi slope per query head, attention/alibi.py; attention_chunk_size: chunked
local attention, attention/chunked.py) whose instances provide

* ``forward(q, k, v, kv_cache, attn_metadata) -> out`` with q [T, num_heads, head_dim],
  k and v [T, num_kv_heads, head_dim], kv_cache a tensor
  [2, num_blocks, block_size, num_kv_heads, head_dim] or None (then attention runs among
  the step's new tokens only and nothing is stored), attn_metadata an AttentionMetadata
  or None (None: all tokens form one causal sequence), and out [T, num_heads, head_dim].
* optionally ``fuses_qk_transform = True``: forward then also takes
  ``qk_transform=`` (a ``layers.rotary.QKNormRope``: q/k norm + rotary not yet
  applied) and applies it itself; for other backends ``Attention.forward`` applies it
  before calling them.

Adding a backend is one new module plus one ``register_backend`` line below (imports are
lazy, so a backend may depend on packages that only exist on some machines).
"""

from __future__ import annotations

import importlib
from typing import Any

DEFAULT_BACKEND = "torch_sdpa"
# The attention of batch_invariant=True (batch_invariant.py): chosen by that flag.
BATCH_INVARIANT_BACKEND = "batch_invariant"

# name -> class, or "module:Class" for lazy import.
_BACKENDS: dict[str, Any] = {}


def register_backend(name: str, cls: Any) -> None:
    """Register cls (a class, or a "module:Class" string imported on first use) as name."""
    _BACKENDS[name] = cls


def registered_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str | None = None) -> type:
    name = name or DEFAULT_BACKEND
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: "
                         f"{', '.join(registered_backends())}")
    cls = _BACKENDS[name]
    if isinstance(cls, str):
        module_name, _, class_name = cls.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        _BACKENDS[name] = cls
    return cls


register_backend("torch_sdpa", "spindle.attention.backends.torch_sdpa:TorchSDPABackend")
register_backend("triton", "spindle.attention.backends.triton_attn:TritonAttentionBackend")
register_backend(BATCH_INVARIANT_BACKEND,
                 "spindle.attention.backends.batch_invariant:BatchInvariantBackend")
