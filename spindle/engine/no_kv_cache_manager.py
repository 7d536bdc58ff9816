"""The KV cache manager of a model without a KV cache (encoder-only models).

It has KVCacheManager's interface and holds nothing: every allocation succeeds
with no blocks, there are no prefix hits, and any request fits. The scheduler
uses it when the engine found zero KV blocks to allocate, so its budget logic
(tokens per step, seats) stays the same for every model.
"""

from __future__ import annotations

from spindle.engine.kv_cache_manager import NO_HIT, PrefixCacheStats
from spindle.engine.request import Request


class NoKVCacheManager:
    num_blocks = 0
    num_free_blocks = 0
    usage = 0.0
    enable_caching = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.prefix_cache_stats = PrefixCacheStats()

    def can_ever_fit(self, num_tokens: int) -> bool:
        return True

    def holds_next_token(self, request: Request) -> bool:
        return True

    def get_computed_blocks(self, request: Request):
        return NO_HIT, 0

    def align_chunk(self, request: Request, start: int, num_new: int) -> int:
        return num_new

    def take_state_copies(self) -> tuple[list, list]:
        return [], []

    def release_held_snapshots(self) -> None:
        return None

    def allocate_slots(self, request: Request, num_new_tokens: int, hit=NO_HIT,
                       num_lookahead_tokens: int = 0) -> list:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return []

    def free(self, request: Request) -> None:
        return None

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return []

    def new_block_ids(self, new_blocks) -> list[list[int]]:
        return []

    def no_new_block_ids(self) -> list[list[int]]:
        return []

    def get_num_blocks(self, request_id: str) -> int:
        return 0

    def reset_prefix_cache(self) -> bool:
        return True
