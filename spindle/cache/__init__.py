"""What each layer caches (cache specs), and how layers with one spec form groups."""

from spindle.cache.spec import (AttentionCacheSpec, CacheGroup, CacheLayout, CacheRequirements,
                                CrossAttentionCacheSpec, KVCacheConfig, MambaCacheSpec,
                                build_cache_layout)

__all__ = ["AttentionCacheSpec", "MambaCacheSpec", "CrossAttentionCacheSpec", "CacheGroup",
           "CacheLayout", "KVCacheConfig", "CacheRequirements", "build_cache_layout"]
