"""The pool of physical KV cache blocks: ref counts, the free blocks (those holding
nothing reused last-freed first, cached ones in LRU order) and the prefix-cache map
(block hash -> block).

Pure bookkeeping: a block is an id into the runner's KV cache tensors; nothing
here touches device memory.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class KVCacheBlock:
    """One physical block of block_size token slots.

    ref_cnt: how many running requests hold the block (0: it is free).
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
      * A block is free (in _free_plain or _free_cached) iff its ref_cnt == 0.
      * Free blocks without a hash hold nothing anyone can ask for again. They are in
        _free_plain, and get_new_blocks() takes the most recently freed of them first:
        its memory is the warmest, and on the CPU a block never written yet costs page
        faults on its first write (the cache is allocated untouched), so cycling
        through every block of a large cache first made each step pay for new pages.
        Never-used blocks start there in id order (block 0 first).
      * Free blocks that carry a hash are cached: a prefix hit may take them back
        (touch()) from anywhere until they are reused and their hash evicted. They are
        in _free_cached in LRU order, and get_new_blocks() takes them only when no
        plain block is left, the least recently freed first.
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
        # block_id -> block; popitem() takes the last inserted (the most recently freed).
        self._free_plain: dict[int, KVCacheBlock] = {
            b.block_id: b for b in reversed(self.blocks)}
        # block_id -> block, in LRU order (head = next to be reused).
        self._free_cached: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free blocks included: they are evictable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take num_blocks free blocks: plain ones last-freed first, then cached ones
        least recently freed first, evicting their hashes.

        Returns blocks with ref_cnt == 1. Raises ValueError if fewer are free.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only "
                             f"{self.num_free_blocks} are free")
        out = []
        for _ in range(num_blocks):
            if self._free_plain:
                _, block = self._free_plain.popitem()
            else:
                _, block = self._free_cached.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block, in the given order; blocks reaching 0
        become free (keeping their hash: still cached).

        Callers pass a request's blocks in reverse so its tail blocks (the least
        likely to be shared) are evicted before its head blocks.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"freeing {block!r} which no request holds")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_set(block)[block.block_id] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each (prefix-hit) block, taking it off the
        free blocks if nobody held it."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_set(block)[block.block_id]
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
        self._free_plain.update(self._free_cached)
        self._free_cached.clear()
        return True

    def _free_set(self, block: KVCacheBlock) -> dict[int, KVCacheBlock]:
        """Where block sits (or goes) while free: by whether it carries a hash."""
        return self._free_plain if block.block_hash is None else self._free_cached

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
