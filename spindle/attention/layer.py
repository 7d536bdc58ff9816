"""The attention layer the models use: KV-cache bookkeeping lives here, the math in a
backend chosen from the registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from spindle.attention.backends.registry import get_backend
from spindle.attention.chunked import chunk_as_window
from spindle.cache.spec import AttentionCacheSpec
from spindle.forward_context import get_forward_context

if TYPE_CHECKING:
    from spindle.layers.rotary import QKNormRope


class Attention(nn.Module):
    """Multi-head (grouped-query) attention over the paged KV cache.

    forward(q [T, H*D], k [T, H_kv*D], v [T, H_kv*D], qk_transform=None) -> [T, H*D],
    for the flat batch of tokens described by the forward context's AttentionMetadata.

    ``self.kv_cache`` is this layer's cache [2, num_blocks, block_size, H_kv, D] (a
    strided view where its backend asked for head-major pages: cache/spec.py),
    assigned by the model runner once the cache is allocated. While it is None (the
    memory-profiling forward) attention runs among each request's new tokens only and
    nothing is stored.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 backend: str | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, values_are_keys: bool = False,
                 sinks: torch.Tensor | None = None,
                 alibi_slopes: torch.Tensor | None = None,
                 attention_chunk_size: int | None = None) -> None:
        """values_are_keys: forward's v is always its k (multi-head latent attention's
        latent), so the cache keeps one plane (AttentionCacheSpec.values_are_keys).
        sinks: a learned logit per query head [num_heads] (gpt-oss's attention sinks),
        in every softmax's denominator and attending to nothing: the owner's parameter,
        which the backend reads at each call (so loads and sleep's swaps show).
        alibi_slopes: ALiBi's slope per query head [num_heads] (attention/alibi.py),
        kept as this module's buffer (outside the checkpoint). attention_chunk_size:
        chunked local attention (attention/chunked.py; Llama 4), cached as a sliding
        window of that size."""
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # A query at position p sees keys at positions > p - sliding_window (None: all).
        self.sliding_window = sliding_window
        # ... or those of its chunk, from floor(p / chunk) * chunk (None: no chunks).
        chunk_as_window(sliding_window, attention_chunk_size)  # (checked)
        self.attention_chunk_size = attention_chunk_size
        # Scores become cap * tanh(scores / cap) before masking (None: no cap).
        self.logits_soft_cap = logits_soft_cap
        self.values_are_keys = values_are_keys
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must be one logit per head ({num_heads}), got "
                             f"{tuple(sinks.shape)}")
        self._sinks = (sinks,)  # (in a tuple: the owner registers the parameter, not this)
        if alibi_slopes is not None:
            alibi_slopes = alibi_slopes.to(torch.float32)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.backend_name = backend
        self.impl = self._make_impl(backend)
        self.kv_cache: torch.Tensor | None = None
        # Which cache group's metadata this layer reads (set by the runner).
        self.cache_group = 0

    def _make_impl(self, backend: str | None):
        extra = {} if self.alibi_slopes is None else {"alibi_slopes": self.alibi_slopes}
        if self.attention_chunk_size is not None:
            extra["attention_chunk_size"] = self.attention_chunk_size
        return get_backend(backend)(self.num_heads, self.head_dim, self.scale,
                                    self.num_kv_heads, sliding_window=self.sliding_window,
                                    logits_soft_cap=self.logits_soft_cap, sinks=self._sinks[0],
                                    **extra)

    def cache_spec(self, dtype: torch.dtype) -> AttentionCacheSpec:
        """What this layer caches: paged keys and values (spindle/cache/spec.py), in
        the page layout its backend asks for (token-major unless it says otherwise)."""
        window = self.sliding_window or self.attention_chunk_size  # (chunked.py)
        return AttentionCacheSpec(self.num_kv_heads, self.head_dim, dtype, window,
                                  self.values_are_keys,
                                  getattr(self.impl, "pages_head_major", False))

    def use_backend(self, name: str) -> None:
        """Switch the math to another registered backend (the runner picks the
        platform's default, or the user's choice, after the model is built)."""
        self.backend_name = name
        self.impl = self._make_impl(name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                qk_transform: QKNormRope | None = None) -> torch.Tensor:
        """qk_transform: the q/k norm + rotary still to be applied to q and k (in place).
        A backend whose class sets ``fuses_qk_transform`` takes it as a keyword and
        folds it into its own kernels (Triton: one decode launch does rotary, KV store
        and attention); for any other backend it is applied here first."""
        if self.values_are_keys and v is not k:
            raise ValueError("this attention caches its keys as its values too: pass v = k")
        attn_metadata = get_forward_context().for_group(self.cache_group)
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if qk_transform is not None and getattr(self.impl, "fuses_qk_transform", False):
            out = self.impl.forward(q, k, v, self.kv_cache, attn_metadata,
                                    qk_transform=qk_transform)
        else:
            if qk_transform is not None:
                qk_transform.apply_(q, k)
            out = self.impl.forward(q, k, v, self.kv_cache, attn_metadata)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, scale={self.scale:.4g}, "
                f"sliding_window={self.sliding_window}, "
                f"backend={type(self.impl).__name__}")
