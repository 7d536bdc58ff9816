"""Head geometry shared by attention layers and backends."""

from __future__ import annotations

from typing import Any


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
