"""Cache specs: what a layer keeps between steps, declared by the layer itself.

A layer that caches something has a ``cache_spec()`` method returning one of:

* ``AttentionCacheSpec``: paged keys and values, ``block_size`` tokens per block;
  with ``sliding_window`` W, a token attends to the W newest positions only (itself
  included), so blocks wholly before the window can be freed as decoding moves on.
  With ``values_are_keys`` the layer's values are its keys (multi-head latent
  attention: both are the latent), so a page holds the keys only and the layer sees
  them twice (a stride-0 view), at half the memory. With ``head_major`` a page keeps
  each KV head's tokens together ([kv heads, block_size, head dim] instead of
  [block_size, kv heads, head dim]); the layer still sees [2, blocks, block_size, kv
  heads, head dim], as a strided view, so only a backend that reads the cache through
  its strides may ask for it (the Triton one, under SPINDLE_KV_HEAD_MAJOR=1).
* ``MambaCacheSpec``: a fixed-size state per sequence (a state-space layer's conv
  and SSM states): one state slot per running sequence, whatever its length.
* ``CrossAttentionCacheSpec``: an encoder-decoder's cross-attention keys and values,
  computed once from the encoder's output when the request starts and read by every
  decoder step: also a fixed size per sequence (the encoder's positions), so also a
  state slot, held for the life of the request.

``build_cache_layout`` groups the layers. Attention layers with one spec form a kind;
each kind's layers are cut into groups of ``group_size`` layers (the smallest kind's
layer count), and layer j of every attention group shares tensor j: one block id then
costs the same memory whichever group holds it, so all attention groups draw from one
block pool and memory flows to the group that needs it. Each group keeps its own
block table per request. State layers (Mamba, cross-attention) with one spec form one
group, with one state tensor set per layer indexed by slot; a request's slot id indexes
every state group.

The engine sees only ``CacheGroup`` (plain data); the runner binds tensors to layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
MAMBA = "mamba"
CROSS_ATTENTION = "cross_attention"
# Kinds whose layers keep a fixed-size state per sequence (one slot), not paged blocks.
STATE_KINDS = (MAMBA, CROSS_ATTENTION)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AttentionCacheSpec:
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None
    values_are_keys: bool = False
    head_major: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def kind(self) -> str:
        return FULL_ATTENTION if self.sliding_window is None else SLIDING_WINDOW

    @property
    def page_key(self) -> tuple:
        """Layers whose pages have one shape and layout can share a tensor."""
        return (self.num_kv_heads, self.head_dim, self.dtype, self.values_are_keys,
                self.head_major)

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The tensor to allocate: keys and values, or keys only (values_are_keys);
        a page's tokens before its heads, or its heads first (head_major)."""
        planes = 1 if self.values_are_keys else 2
        if self.head_major:
            return (planes, num_blocks, self.num_kv_heads, block_size, self.head_dim)
        return (planes, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def layer_view(self, pages: torch.Tensor) -> torch.Tensor:
        """What the layer reads as its kv_cache, [2, blocks, block_size, kv heads, head
        dim] whatever the allocation: with values_are_keys, the one plane seen as both
        (writes of the values then land on the keys, which the layer makes equal); with
        head_major, the heads and tokens of a page swapped back (a strided view)."""
        view = pages.expand(2, *pages.shape[1:]) if self.values_are_keys else pages
        return view.transpose(2, 3) if self.head_major else view

    def block_bytes(self, block_size: int) -> int:
        return math.prod(self.shape(1, block_size)) * _itemsize(self.dtype)

    def pages_holding(self, view: torch.Tensor) -> torch.Tensor:
        """New pages in this spec's layout holding the values of a layer view [2, blocks,
        block_size, kv heads, head dim], returned as their own layer view: one cache in
        another layout, for comparing layouts (tests, benchmarks)."""
        if self.values_are_keys:
            raise ValueError("pages_holding: a values_are_keys spec keeps one plane; "
                             "copying two into it would lose the values")
        _, blocks, block_size = view.shape[:3]
        pages = torch.empty(self.shape(blocks, block_size), dtype=self.dtype,
                            device=view.device)
        return self.layer_view(pages).copy_(view)


@dataclass(frozen=True)
class MambaCacheSpec:
    """Per-sequence state tensors of one layer: shapes[i] (without the slot dimension)
    in dtypes[i]. For Mamba2: the conv state and the SSM state."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise ValueError("a MambaCacheSpec needs one dtype per state shape, and a state")

    kind = MAMBA

    def slot_bytes(self) -> int:
        return sum(math.prod(s) * _itemsize(d) for s, d in zip(self.shapes, self.dtypes))


@dataclass(frozen=True)
class CrossAttentionCacheSpec(MambaCacheSpec):
    """One cross-attention layer's keys and values over the encoder's positions:
    shapes ((positions, kv_heads, head_dim),) * 2, a state slot per sequence."""

    kind = CROSS_ATTENTION

    @staticmethod
    def of(positions: int, num_kv_heads: int, head_dim: int,
           dtype: torch.dtype) -> "CrossAttentionCacheSpec":
        shape = (positions, num_kv_heads, head_dim)
        return CrossAttentionCacheSpec((shape, shape), (dtype, dtype))


CacheSpec = AttentionCacheSpec | MambaCacheSpec


@dataclass(frozen=True)
class CacheGroup:
    """One group of layers, as the engine's cache manager sees it (plain data)."""

    kind: str  # FULL_ATTENTION | SLIDING_WINDOW | MAMBA | CROSS_ATTENTION
    num_layers: int
    sliding_window: int | None = None

    @property
    def is_paged(self) -> bool:
        return self.kind not in STATE_KINDS

    def blocks_for(self, num_tokens: int, block_size: int, step_tokens: int | None = None) -> int:
        """Blocks one sequence of num_tokens tokens holds at most in this group, when a
        step computes at most step_tokens of its tokens (None: all at once)."""
        if not self.is_paged:
            return 0
        full = _cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return full
        # A step's tokens are all written, and its first token reads the
        # sliding_window - 1 positions before it; a block more may straddle the start.
        step = num_tokens if step_tokens is None else min(step_tokens, num_tokens)
        return min(full, _cdiv(self.sliding_window - 1 + step, block_size) + 1)


@dataclass(frozen=True)
class KVCacheConfig:
    """What the engine decided: block ids shared by the paged groups, and state slots
    for the state groups (0 when the model has none)."""

    num_blocks: int
    num_state_slots: int = 0


@dataclass
class CacheLayout:
    """This rank's layers by group, and what one block / one state slot costs."""

    groups: list[CacheGroup]
    group_layers: list[list[Any]]  # the layer modules of each group, in model order
    group_specs: list[CacheSpec]
    group_size: int = 0  # attention layers per paged group (tensors shared across groups)
    block_size: int = 16
    attention_page: AttentionCacheSpec | None = None

    @property
    def paged_groups(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.is_paged]

    @property
    def state_groups(self) -> list[int]:
        """The groups of state layers (Mamba, cross-attention): one slot per sequence."""
        return [i for i, g in enumerate(self.groups) if not g.is_paged]

    def block_bytes(self) -> int:
        """Bytes one block id costs: a page in each of the group_size shared tensors."""
        if self.attention_page is None:
            return 0
        return self.group_size * self.attention_page.block_bytes(self.block_size)

    def slot_bytes(self) -> int:
        """Bytes one state slot costs across every state layer."""
        return sum(self.group_specs[g].slot_bytes() * len(self.group_layers[g])
                   for g in self.state_groups)

    def requirements(self) -> "CacheRequirements":
        return CacheRequirements(tuple(self.groups), self.block_bytes(), self.slot_bytes())

    def describe(self) -> str:
        parts = []
        for group, layers in zip(self.groups, self.group_layers):
            window = f" window {group.sliding_window}" if group.sliding_window else ""
            parts.append(f"{group.kind}{window} x{len(layers)}")
        return ", ".join(parts) if parts else "no cache"


def build_cache_layout(layers: Sequence[Any], block_size: int, dtype: torch.dtype) -> CacheLayout:
    """Group the caching layers (modules with cache_spec(dtype)), in model order."""
    specs = [(layer, layer.cache_spec(dtype)) for layer in layers]
    specs = [(layer, spec) for layer, spec in specs if spec is not None]
    attention: dict[AttentionCacheSpec, list[Any]] = {}
    mamba: dict[MambaCacheSpec, list[Any]] = {}
    for layer, spec in specs:
        target = attention if isinstance(spec, AttentionCacheSpec) else mamba
        target.setdefault(spec, []).append(layer)
    layout = CacheLayout(groups=[], group_layers=[], group_specs=[], block_size=block_size)
    if attention:
        page_keys = {spec.page_key for spec in attention}
        if len(page_keys) > 1:
            raise ValueError("attention layers whose KV pages differ in shape (kv heads, head "
                             "dim, dtype, values as keys or head-major layout: "
                             f"{sorted(map(str, page_keys))}) are not supported")
        layout.group_size = min(len(ls) for ls in attention.values())
        layout.attention_page = next(iter(attention))
        for spec, ls in attention.items():
            for start in range(0, len(ls), layout.group_size):
                chunk = ls[start:start + layout.group_size]
                layout.groups.append(CacheGroup(spec.kind, len(chunk), spec.sliding_window))
                layout.group_layers.append(chunk)
                layout.group_specs.append(spec)
    for spec, ls in mamba.items():
        layout.groups.append(CacheGroup(spec.kind, len(ls)))
        layout.group_layers.append(ls)
        layout.group_specs.append(spec)
    return layout


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheRequirements:
    """What one rank's cache needs, for the engine to size it: the groups, the bytes
    one block id costs (all paged groups share the ids) and one state slot costs."""

    groups: tuple[CacheGroup, ...] = ()
    block_bytes: int = 0
    slot_bytes: int = 0

    @property
    def has_paged(self) -> bool:
        return any(g.is_paged for g in self.groups)

    @property
    def has_state(self) -> bool:
        return any(not g.is_paged for g in self.groups)

    def blocks_per_sequence(self, num_tokens: int, block_size: int,
                            step_tokens: int | None = None) -> int:
        """Block ids one sequence of num_tokens tokens holds at most, over all groups,
        when a step computes at most step_tokens of its tokens."""
        return sum(g.blocks_for(num_tokens, block_size, step_tokens) for g in self.groups)

    def signature(self) -> tuple:
        """What must agree across ranks for them to share block ids and slots."""
        return tuple((g.kind, g.sliding_window) for g in self.groups)
