"""Head geometry and score options shared by attention layers and backends."""

from __future__ import annotations

from typing import Any

import torch

from spindle.attention.alibi import check_alibi_slopes
from spindle.attention.chunked import chunk_as_window


def set_head_geometry(obj: Any, num_heads: int, head_dim: int, scale: float,
                      num_kv_heads: int) -> None:
    """Validate and store num_heads, head_dim, scale and num_kv_heads on obj."""
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    obj.num_heads = num_heads
    obj.head_dim = head_dim
    obj.scale = scale
    obj.num_kv_heads = num_kv_heads


def set_score_options(obj: Any, num_heads: int, sliding_window: int | None,
                      logits_soft_cap: float | None, sinks: torch.Tensor | None,
                      alibi_slopes: torch.Tensor | None,
                      attention_chunk_size: int | None) -> None:
    """Validate and store what a paged backend applies to a layer's scores: the window
    it reads within (``sliding_window``, a chunked layer's chunk size: attention/
    chunked.py) and ``chunk``, ``logits_soft_cap`` (scores become cap * tanh(s / cap),
    Gemma 2), ``sinks`` (a logit per query head in every denominator, gpt-oss) and
    ``alibi_slopes`` (one per query head, attention/alibi.py)."""
    sliding_window, obj.chunk = chunk_as_window(sliding_window, attention_chunk_size)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
    obj.sliding_window = sliding_window
    obj.logits_soft_cap = logits_soft_cap
    obj.sinks = sinks
    obj.alibi_slopes = check_alibi_slopes(alibi_slopes, num_heads)
