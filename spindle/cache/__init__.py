"""What each layer caches (cache specs), and how layers with one spec form groups."""

from spindle.cache.spec import (AttentionCacheSpec, CacheGroup, CacheLayout, KVCacheConfig,
                                MambaCacheSpec, build_cache_layout)

__all__ = ["AttentionCacheSpec", "MambaCacheSpec", "CacheGroup", "CacheLayout", "KVCacheConfig",
           "build_cache_layout"]
