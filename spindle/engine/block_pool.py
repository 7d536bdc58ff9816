"""The pool of physical KV cache blocks: ref counts, the LRU free queue and the
prefix-cache map (block hash -> block).

Pure bookkeeping: a block is an id into the runner's KV cache tensors; nothing
here touches device memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class KVCacheBlock:
    """One physical block of block_size token slots.

    ref_cnt: how many running requests hold the block (0: it is in the free queue).
    block_hash: the chained hash of the block's tokens once the block is full and
    registered in the prefix cache; None otherwise.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class BlockPool:
    """Owns every KVCacheBlock; hands them out and takes them back.

    Invariants:
      * A block is in the free queue iff its ref_cnt == 0.
      * The free queue is in LRU order: get_new_blocks() takes from the head (least
        recently freed), free_blocks() appends to the tail. Free blocks that still
        carry a hash are cached: a prefix hit may take them back (touch()) from
        anywhere in the queue in O(1) until they are reused and their hash evicted.
      * block.block_hash is not None iff the cache map holds block.block_hash -> block
        (so at most one block per hash; a duplicate full block simply stays unhashed).
      * Only full blocks whose tokens' KV is (or is being) written get a hash; that is
        the caller's (KVCacheManager's) responsibility.
      * When enable_caching is False no block ever gets a hash.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in LRU order (head = next to be reused).
        self._free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free blocks included: they are evictable)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take num_blocks from the head of the free queue, evicting their hashes.

        Returns blocks with ref_cnt == 1. Raises ValueError if fewer are free.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only "
                             f"{self.num_free_blocks} are free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block, in the given order; blocks reaching 0
        join the tail of the free queue (keeping their hash: still cached).

        Callers pass a request's blocks in reverse so its tail blocks (the least
        likely to be shared) are evicted before its head blocks.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"freeing {block!r} which no request holds")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each (prefix-hit) block, taking it off the
        free queue if nobody held it."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[bytes]) -> int:
        """Register blocks[i] under block_hashes[i] in the prefix cache.

        Each block must be held (ref_cnt > 0) and full of computed tokens. A block
        that already has this hash is left alone; one whose hash already maps to
        another block (the same tokens computed twice concurrently) stays unhashed.
        Returns how many blocks were newly registered. No-op without caching.
        """
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        if not self.enable_caching:
            return 0
        registered = 0
        for block, block_hash in zip(blocks, block_hashes):
            if block.ref_cnt <= 0:
                raise ValueError(f"caching {block!r} which no request holds")
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise ValueError(f"{block!r} is already cached under another hash")
                continue
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            registered += 1
        return registered

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is held (else the
        running requests' blocks would lose their registration mid-flight):
        returns False and changes nothing in that case."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
