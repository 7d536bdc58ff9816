"""BlockPool: free blocks (plain ones last-freed first, cached ones LRU), ref counts,
the hash -> block map."""

import pytest

from spindle.engine.block_pool import BlockPool, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def check_invariants(pool: BlockPool) -> None:
    free = {**pool._free_plain, **pool._free_cached}
    assert len(free) == len(pool._free_plain) + len(pool._free_cached)  # in one only
    assert all(b.ref_cnt == 0 for b in free.values())
    assert all(b.ref_cnt > 0 for b in pool.blocks if b.block_id not in free)
    assert all(b.block_hash is None for b in pool._free_plain.values())
    assert all(b.block_hash is not None for b in pool._free_cached.values())
    for block_hash, block in pool._cached.items():
        assert block.block_hash == block_hash
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool._cached)


def test_initial_state():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    assert pool.get_usage() == 0.0
    assert pool.num_cached_blocks == 0
    check_invariants(pool)


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockPool(-1)
    empty = BlockPool(0)  # a model whose layers are all state layers has no paged blocks
    assert empty.get_usage() == 0.0 and empty.get_new_blocks(0) == []
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    assert pool.num_free_blocks == 2


def test_get_new_blocks_in_order_with_ref_cnt_one():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.get_usage() == pytest.approx(0.75)
    assert pool.get_new_blocks(0) == []
    check_invariants(pool)


def test_plain_blocks_are_reused_last_freed_first():
    pool = BlockPool(4)
    b = pool.get_new_blocks(4)
    pool.free_blocks([b[2], b[0]])
    pool.free_blocks([b[3]])
    pool.free_blocks([b[1]])
    assert ids(pool.get_new_blocks(4)) == [1, 3, 0, 2]
    check_invariants(pool)


def test_freed_blocks_go_before_never_used_ones():
    # A block written before is reused before one never written (on the CPU the
    # latter's pages are not mapped yet).
    pool = BlockPool(4)
    b = pool.get_new_blocks(2)
    pool.free_blocks(reversed(b))
    assert ids(pool.get_new_blocks(4)) == [0, 1, 2, 3]
    check_invariants(pool)


def test_cached_blocks_are_evicted_last_in_lru_order():
    pool = BlockPool(5)
    b = pool.get_new_blocks(5)
    pool.cache_full_blocks(b[:3], [h(0), h(1), h(2)])
    pool.free_blocks([b[1], b[0], b[3], b[2], b[4]])
    # Plain blocks first (last freed first), then cached ones, least recently freed
    # first, each losing its hash.
    assert ids(pool.get_new_blocks(3)) == [4, 3, 1]
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(0)) is b[0] and pool.get_cached_block(h(2)) is b[2]
    assert ids(pool.get_new_blocks(2)) == [0, 2]
    assert pool.num_cached_blocks == 0
    check_invariants(pool)


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError):
        pool.free_blocks([b])
    check_invariants(pool)


def test_shared_block_freed_only_at_zero():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 2
    check_invariants(pool)


def test_cache_and_lookup():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_blocks([a, b], [h(1), h(2)]) == 2
    assert pool.get_cached_block(h(1)) is a
    assert pool.get_cached_block(h(2)) is b
    assert pool.get_cached_block(h(3)) is None
    # Idempotent for the same hash; another hash for a hashed block is an error.
    assert pool.cache_full_blocks([a], [h(1)]) == 0
    with pytest.raises(ValueError):
        pool.cache_full_blocks([a], [h(9)])
    with pytest.raises(ValueError):
        pool.cache_full_blocks([a, b], [h(1)])
    check_invariants(pool)


def test_caching_a_free_block_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.cache_full_blocks([pool.blocks[0]], [h(1)])


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h(1)])
    assert pool.cache_full_blocks([b], [h(1)]) == 0
    assert b.block_hash is None
    assert pool.get_cached_block(h(1)) is a
    # Freeing and reusing the duplicate must not evict the original's entry.
    pool.free_blocks([b])
    pool.get_new_blocks(3)
    assert pool.get_cached_block(h(1)) is a
    check_invariants(pool)


def test_freed_cached_block_stays_cached_until_reused():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(0), h(1), h(2)])
    pool.free_blocks(reversed(blocks))
    assert pool.num_cached_blocks == 3
    assert pool.get_cached_block(h(0)) is blocks[0]
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[2]  # freed first => evicted first
    assert reused.block_hash is None
    assert pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(0)) is blocks[0]
    check_invariants(pool)


def test_touch_takes_cached_block_off_the_middle_of_the_free_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [h(i) for i in range(4)])
    pool.free_blocks(blocks)  # queue: 0 1 2 3
    hit = pool.get_cached_block(h(1))
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.num_free_blocks == 3
    assert ids(pool.get_new_blocks(3)) == [0, 2, 3]
    assert pool.get_cached_block(h(1)) is hit  # still cached, now held
    check_invariants(pool)


def test_touch_held_block_only_bumps_ref_cnt():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b, b])
    assert b.ref_cnt == 3
    assert pool.num_free_blocks == 1


def test_reset_prefix_cache():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(0), h(1)])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(0)) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(h(0)) is None
    assert pool.num_free_blocks == 3
    check_invariants(pool)


def test_caching_disabled_is_a_no_op():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    assert pool.cache_full_blocks([b], [h(1)]) == 0
    assert b.block_hash is None
    assert pool.get_cached_block(h(1)) is None


def test_block_repr():
    assert "id=3" in repr(KVCacheBlock(3))
