"""Which KV cache blocks each request holds, and the prefix cache over them.

A request's token at position p lives in slot p % block_size of its block
p // block_size. Full blocks are identified by a chained hash of their tokens (and,
through the parent hash, of every token before them), so two requests with the
same first k * block_size tokens can share those k blocks.

Timing contract with the runner: a block is registered in the prefix cache as soon
as its tokens are *scheduled* (allocate_slots for the step that computes them), not
when the forward pass has run. This is safe because (1) steps execute in the order
they are scheduled and (2) within one forward pass every layer writes all of the
step's new KV into the cache before its attention reads the cache, so a request
that hits a block scheduled in the same step reads it after it was written.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

from spindle.engine.block_pool import BlockPool, KVCacheBlock
from spindle.engine.request import Request

# Parent hash of a request's first block.
ROOT_BLOCK_HASH: bytes = hashlib.sha256(b"spindle-prefix-cache-root-v1").digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """sha256(parent_hash || token ids as little-endian int64) of one full block.

    parent_hash is the previous block's hash, or None (ROOT_BLOCK_HASH) for the
    first block, so equal tokens after different prefixes hash differently.
    """
    parent = ROOT_BLOCK_HASH if parent_hash is None else parent_hash
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted once per admission of a request (first time or after preemption)."""

    requests: int = 0
    queries: int = 0  # tokens looked up (the request's num_tokens at admission)
    hits: int = 0  # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates blocks to requests and maintains the prefix cache.

    Invariants:
      * _req_blocks[rid] holds exactly cdiv(tokens allocated for, block_size) blocks,
        in token order; the first _num_hashed[rid] of them are full of computed
        tokens and have been offered to the prefix cache.
      * request.block_hashes[i] == hash of full block i of request.all_token_ids
        (only maintained when caching is enabled; extended lazily whenever the
        manager looks at the request — token ids are append-only, so earlier
        hashes never change).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_hashed: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens tokens fits in the whole cache."""
        return _cdiv(num_tokens, self.block_size) <= self.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached full blocks that prefixes request's tokens,
        and the number of tokens they cover.

        At most (num_tokens - 1) tokens are reported as hits: when every token
        hits, the last block is dropped so the last token still goes through the
        model (its logits are needed to sample). Does not take references: pass
        the blocks to allocate_slots(). ([], 0) without caching or for a request
        that already has computed tokens.
        """
        if not self.enable_caching or request.num_computed_tokens > 0:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()
                       ) -> list[KVCacheBlock] | None:
        """Make request hold enough blocks for
        request.num_computed_tokens + len(new_computed_blocks) * block_size + num_new_tokens
        tokens, where new_computed_blocks are prefix hits from get_computed_blocks()
        (only for a request holding no blocks yet; request.num_computed_tokens must
        not include them yet).

        Returns the newly allocated blocks (hits excluded; possibly []), or None
        and changes nothing when too few blocks are free.

        Then registers in the prefix cache every block made full by the tokens up to
        request.num_computed_tokens + hits + num_new_tokens: those tokens are either
        computed already or scheduled this step (see the module docstring), and they
        are all known token ids (the total may not exceed request.num_tokens).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        is_new = rid not in self._req_blocks
        held = self._req_blocks.get(rid, [])
        if new_computed_blocks and not is_new:
            raise ValueError(f"request {rid} already holds blocks: prefix hits can only "
                             "be taken at admission")
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        if total > request.num_tokens + request.num_output_placeholders:
            raise ValueError(f"request {rid}: cannot allocate for {total} tokens, it has "
                             f"only {request.num_tokens} known tokens")
        known = min(total, request.num_tokens)  # only known token ids are ever hashed
        if not is_new and not new_computed_blocks and self._holds_enough(rid, held, total, known):
            return []  # the common decode step: room in the last block, nothing to cache
        num_needed = max(0, _cdiv(total, self.block_size) - len(held) - len(new_computed_blocks))
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed + num_revived > self.block_pool.num_free_blocks:
            return None

        if is_new:
            self._record_admission(request, num_hit_tokens)
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        blocks = self._req_blocks.setdefault(rid, [])
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        if is_new:
            self._num_hashed[rid] = len(new_computed_blocks)
        self._cache_full_blocks(request, known // self.block_size)
        return new_blocks

    def _holds_enough(self, rid: str, held: list[KVCacheBlock], total: int, known: int) -> bool:
        """Whether held blocks cover total tokens and no block newly became full."""
        if _cdiv(total, self.block_size) > len(held):
            return False
        return not self.enable_caching or known // self.block_size <= self._num_hashed.get(rid, 0)

    def free(self, request: Request) -> None:
        """Release every block of request, tail first (its last blocks are evicted
        first). No-op for a request holding none."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_num_blocks(self, request_id: str) -> int:
        return len(self._req_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (nothing done) while any block is held."""
        return self.block_pool.reset_prefix_cache()

    def _record_admission(self, request: Request, num_hit_tokens: int) -> None:
        if not self.enable_caching:
            return
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens

    def _cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        start = self._num_hashed[rid]
        if num_full_blocks <= start:
            return
        self._update_block_hashes(request)
        blocks = self._req_blocks[rid]
        self.block_pool.cache_full_blocks(blocks[start:num_full_blocks],
                                          request.block_hashes[start:num_full_blocks])
        self._num_hashed[rid] = num_full_blocks

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i > 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))
