"""KVCacheManager: block allocation per request and the prefix cache."""

import pytest

from spindle.engine.kv_cache_manager import (NO_HIT, ROOT_BLOCK_HASH, KVCacheManager,
                                             hash_block_tokens)
from spindle.engine.request import Request
from spindle.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, prompt, max_tokens: int = 8) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens)


def compute(manager: KVCacheManager, request: Request, num_new: int | None = None,
            hits=NO_HIT):
    """What the scheduler does: allocate, then count the tokens as computed. The
    manager has one (full-attention) group here: returns that group's new blocks."""
    num_hit = hits.num_tokens if hits else 0
    if num_new is None:
        num_new = request.num_tokens - request.num_computed_tokens - num_hit
    new_blocks = manager.allocate_slots(request, num_new, hits)
    if new_blocks is None:
        return None
    request.num_computed_tokens += num_hit + num_new
    return new_blocks[0]


def admit(manager: KVCacheManager, request: Request):
    """Prefix lookup + allocation of the whole remaining prompt (group 0's blocks)."""
    hits, num_hit = manager.get_computed_blocks(request)
    return compute(manager, request, hits=hits), (hits.blocks[0] if hits else []), num_hit


def ids(manager: KVCacheManager, rid: str) -> list[int]:
    """The block ids of the one group."""
    return manager.get_block_ids(rid)[0]


# ----------------------------------------------------------------- hashing

def test_hash_is_deterministic_and_chained():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3, 4])
    assert isinstance(a, bytes) and len(a) == 32
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert a != hash_block_tokens(None, [4, 3, 2, 1])
    # Same tokens after different parents do not collide.
    p1, p2 = hash_block_tokens(None, [9, 9, 9, 9]), hash_block_tokens(None, [8, 8, 8, 8])
    assert hash_block_tokens(p1, [1, 2, 3, 4]) != hash_block_tokens(p2, [1, 2, 3, 4])
    assert hash_block_tokens(p1, [1, 2, 3, 4]) != a
    # Token boundaries matter (no concatenation ambiguity).
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])


def test_request_block_hashes_cover_full_blocks_only_and_grow():
    m = KVCacheManager(8, BS)
    r = make_request("a", range(10))
    m.get_computed_blocks(r)
    assert len(r.block_hashes) == 2
    assert r.block_hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert r.block_hashes[1] == hash_block_tokens(r.block_hashes[0], [4, 5, 6, 7])
    r.append_output_token_ids([10, 11])
    m.get_computed_blocks(r)
    assert len(r.block_hashes) == 3
    assert r.block_hashes[2] == hash_block_tokens(r.block_hashes[1], [8, 9, 10, 11])


# -------------------------------------------------------------- allocation

def test_allocate_block_counts_and_ids():
    m = KVCacheManager(8, BS)
    r = make_request("a", range(9))
    blocks = compute(m, r, 5)
    assert len(blocks) == 2
    assert ids(m, "a") == [0, 1]
    assert compute(m, r, 3) == []  # 8 tokens still fit in 2 blocks
    assert len(compute(m, r, 1)) == 1  # the 9th token needs a third block
    assert ids(m, "a") == [0, 1, 2]
    assert m.num_free_blocks == 5
    assert m.usage == pytest.approx(3 / 8)
    assert ids(m, "unknown") == []


def test_allocate_fails_without_side_effects():
    m = KVCacheManager(3, BS)
    a = make_request("a", range(8))
    compute(m, a)
    b = make_request("b", range(100, 109))
    assert m.allocate_slots(b, 9) is None
    assert m.num_free_blocks == 1
    assert ids(m, "b") == []
    assert m.prefix_cache_stats.requests == 1  # the failed attempt is not counted
    assert len(m.allocate_slots(b, 4)[0]) == 1


def test_allocate_rejects_unknown_tokens_and_bad_args():
    m = KVCacheManager(8, BS)
    r = make_request("a", range(5))
    with pytest.raises(ValueError):
        m.allocate_slots(r, 6)  # only 5 known tokens: never hash a placeholder
    with pytest.raises(ValueError):
        m.allocate_slots(r, -1)
    compute(m, r, 4)
    other = make_request("b", range(5))
    hits, _ = m.get_computed_blocks(other)
    assert len(hits.blocks[0]) == 1
    with pytest.raises(ValueError):
        m.allocate_slots(r, 1, hits)  # hits only at admission


def test_only_blocks_full_of_computed_tokens_are_cached():
    m = KVCacheManager(8, BS)
    a = make_request("a", range(10))
    compute(m, a, 6)  # chunk: tokens 0..5 -> only block 0 is full
    assert m.block_pool.num_cached_blocks == 1
    probe = make_request("p", range(10))
    assert m.get_computed_blocks(probe)[1] == 4
    compute(m, a, 4)  # tokens 6..9 -> block 1 full, block 2 holds 2 tokens
    assert m.block_pool.num_cached_blocks == 2
    assert m.get_computed_blocks(make_request("p2", range(10)))[1] == 8
    # Decode: the sampled token is known only once appended; then block 2 fills.
    a.append_output_token_ids([10])
    compute(m, a, 1)
    assert m.block_pool.num_cached_blocks == 2
    a.append_output_token_ids([11])
    compute(m, a, 1)  # token 11 computed -> block 2 = [8, 9, 10, 11] full
    assert m.block_pool.num_cached_blocks == 3
    assert m.block_pool.get_cached_block(a.block_hashes[2]).block_id == ids(m, "a")[2]


# ------------------------------------------------------------- prefix hits

def test_prefix_hit_across_requests():
    m = KVCacheManager(16, BS)
    a = make_request("a", list(range(10)))
    compute(m, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    new_blocks, hits, num_hit = admit(m, b)
    assert num_hit == 8
    assert [h.block_id for h in hits] == ids(m, "a")[:2]
    assert ids(m, "b")[:2] == ids(m, "a")[:2]
    assert len(new_blocks) == 1 and new_blocks[0].block_id not in ids(m, "a")
    assert all(h.ref_cnt == 2 for h in hits)
    assert b.num_computed_tokens == 11


def test_partial_block_prefix_does_not_hit():
    m = KVCacheManager(16, BS)
    compute(m, make_request("a", range(12)))
    # Shares 6 tokens: one full block + half of the second.
    b = make_request("b", list(range(6)) + [77] * 6)
    _, num_hit = m.get_computed_blocks(b)
    assert num_hit == 4
    # Shares 3 tokens: not even one full block.
    c = make_request("c", [0, 1, 2, 99, 4, 5, 6, 7])
    assert m.get_computed_blocks(c)[1] == 0


def test_same_block_tokens_after_different_prefix_do_not_hit():
    m = KVCacheManager(16, BS)
    a = make_request("a", [1, 1, 1, 1, 5, 6, 7, 8, 0])
    compute(m, a)
    b = make_request("b", [2, 2, 2, 2, 5, 6, 7, 8, 0])
    assert m.get_computed_blocks(b)[1] == 0
    assert a.block_hashes[1] != b.block_hashes[1]


def test_all_tokens_hit_recomputes_last_block():
    m = KVCacheManager(16, BS)
    compute(m, make_request("a", range(12)))
    # Exactly 3 full blocks, all cached: drop the last block, recompute its 4 tokens.
    b = make_request("b", range(12))
    new_blocks, hits, num_hit = admit(m, b)
    assert num_hit == 8 and len(hits) == 2
    assert len(new_blocks) == 1
    # 13 tokens: all 3 full blocks hit, the 13th token is recomputed.
    c = make_request("c", list(range(12)) + [5])
    _, num_hit = m.get_computed_blocks(c)
    assert num_hit == 12
    # A one-block prompt never hits.
    assert m.get_computed_blocks(make_request("d", range(4)))[1] == 0


def test_no_lookup_once_tokens_are_computed():
    m = KVCacheManager(16, BS)
    compute(m, make_request("a", range(12)))
    b = make_request("b", range(12))
    b.num_computed_tokens = 4
    assert m.get_computed_blocks(b)[1] == 0


def test_free_is_tail_first_and_head_blocks_survive():
    m = KVCacheManager(3, BS)
    a = make_request("a", range(12))
    compute(m, a, 12)  # holds all 3 blocks, all cached
    a_ids = ids(m, "a")
    m.free(a)
    assert m.num_free_blocks == 3 and ids(m, "a") == []
    # An unrelated one-block request evicts a's *last* block.
    x = make_request("x", [90, 91, 92])
    assert [b.block_id for b in compute(m, x)] == [a_ids[2]]
    # a's first two blocks are still cached.
    b = make_request("b", list(range(8)) + [70])
    _, hits, num_hit = admit(m, b)
    assert num_hit == 8 and [h.block_id for h in hits] == a_ids[:2]
    m.free(a)  # freeing a request with no blocks is a no-op


def test_hits_on_free_blocks_count_against_free_space():
    m = KVCacheManager(4, BS)
    a = make_request("a", range(9))
    compute(m, a)  # 3 blocks, 2 cached
    m.free(a)
    # b hits a's 2 cached (free) blocks and needs 3 more: 2 + 3 > 4 free.
    b = make_request("b", list(range(8)) + list(range(100, 109)))
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8
    assert m.allocate_slots(b, 9, hits) is None
    assert all(h.ref_cnt == 0 for h in hits.blocks[0]) and m.num_free_blocks == 4
    # Needing only 2 more fits exactly, and must not hand out the hit blocks.
    new_blocks = m.allocate_slots(b, 8, hits)
    assert new_blocks is not None and len(new_blocks[0]) == 2
    assert not {x.block_id for x in new_blocks[0]} & {h.block_id for h in hits.blocks[0]}
    assert m.num_free_blocks == 0


def test_shared_blocks_ref_counts():
    m = KVCacheManager(8, BS)
    a = make_request("a", range(9))
    compute(m, a)
    b = make_request("b", range(9))
    admit(m, b)
    shared = ids(m, "a")[:2]
    assert ids(m, "b")[:2] == shared
    assert [m.block_pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    m.free(a)
    assert [m.block_pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert m.num_free_blocks == 8 - 3
    m.free(b)
    assert m.num_free_blocks == 8


def test_preempted_request_hits_its_own_blocks_including_outputs():
    m = KVCacheManager(8, BS)
    r = make_request("a", range(6))
    compute(m, r)
    for tok in (6, 7, 8):  # decode 3 tokens
        r.append_output_token_ids([tok])
        compute(m, r, 1)
    # tokens 0..8 known, 0..7 computed: blocks 0 and 1 full and cached.
    m.free(r)
    r.num_computed_tokens = 0
    hits, num_hit = m.get_computed_blocks(r)
    assert num_hit == 8  # the second block holds prompt and output tokens
    assert r.num_tokens - num_hit == 1


def test_prefix_cache_stats():
    m = KVCacheManager(16, BS)
    compute(m, make_request("a", range(10)))
    admit(m, make_request("b", range(10)))
    stats = m.prefix_cache_stats
    assert stats.requests == 2
    assert stats.queries == 20
    assert stats.hits == 8
    assert stats.hit_rate == pytest.approx(0.4)


def test_reset_prefix_cache():
    m = KVCacheManager(8, BS)
    a = make_request("a", range(9))
    compute(m, a)
    assert m.reset_prefix_cache() is False
    assert m.get_computed_blocks(make_request("b", range(9)))[1] == 8
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(make_request("c", range(9)))[1] == 0


def test_caching_disabled():
    m = KVCacheManager(8, BS, enable_caching=False)
    a = make_request("a", range(9))
    compute(m, a)
    b = make_request("b", range(9))
    assert m.get_computed_blocks(b)[1] == 0
    assert a.block_hashes == [] and m.block_pool.num_cached_blocks == 0
    assert m.prefix_cache_stats.queries == 0
    m.free(a)
    assert m.num_free_blocks == 8


def test_concurrent_identical_prompts_keep_one_cache_entry():
    """Two requests compute the same block in the same step (no hit for the second
    because it was admitted with hits=()): the duplicate stays unhashed and its
    reuse cannot evict the first one's entry."""
    m = KVCacheManager(8, BS)
    a, b = make_request("a", range(5)), make_request("b", range(5))
    compute(m, a)
    compute(m, b)  # no lookup: computes block 0 again
    a0, b0 = (m.block_pool.blocks[ids(m, x)[0]] for x in "ab")
    assert a0.block_hash is not None and b0.block_hash is None
    m.free(b)
    m.block_pool.get_new_blocks(m.num_free_blocks)
    assert m.block_pool.get_cached_block(a.block_hashes[0]) is a0


def test_lookup_stops_at_the_first_miss_even_if_later_blocks_are_cached():
    m = KVCacheManager(4, BS)
    a = make_request("a", range(13))
    compute(m, a)  # 4 blocks; the first 3 full and cached
    m.free(a)  # free queue (LRU first): a3, a2, a1, a0
    pool = m.block_pool
    a1, a2 = (pool.get_cached_block(h) for h in a.block_hashes[1:3])
    pool.touch([a1, a2])
    reused = pool.get_new_blocks(2)  # a3 and a0: evicts a's first block only
    pool.free_blocks(reused)
    pool.free_blocks([a1, a2])
    assert pool.get_cached_block(a.block_hashes[0]) is None
    assert pool.get_cached_block(a.block_hashes[1]) is a1
    b = make_request("b", range(13))
    assert m.get_computed_blocks(b)[1] == 0


def test_free_offers_the_block_finished_by_an_in_flight_token():
    """Async scheduling: the block holding a request's last computed token was scheduled
    while that token was being sampled, so it could not be hashed then; free() hashes
    it once the token is known, and a follow-up turn hits the whole history."""
    m = KVCacheManager(8, BS)
    a = make_request("a", range(7))
    compute(m, a)  # block 0 full and cached; block 1 holds 3 tokens
    a.num_output_placeholders = 1  # the token at position 7 is being sampled...
    compute(m, a, 1)  # ...and fed to the step computing position 7
    assert m.block_pool.num_cached_blocks == 1  # block 1's last token is unknown
    a.num_output_placeholders = 0
    a.append_output_token_ids([42])  # sampled; the request then finishes
    m.free(a)
    assert m.block_pool.num_cached_blocks == 2
    follow_up = make_request("c", list(range(7)) + [42, 1, 2, 3])
    assert m.get_computed_blocks(follow_up)[1] == 8


@pytest.mark.parametrize("caching", [False, True])
def test_holds_next_token_only_where_allocate_slots_would_do_nothing(caching):
    """The scheduler skips allocate_slots for a decode step when holds_next_token says
    so: then allocating one more token must return no blocks and change nothing."""
    m = KVCacheManager(16, BS, enable_caching=caching)
    r = make_request("a", range(6), max_tokens=20)
    assert not m.holds_next_token(r)  # holds nothing yet
    admit(m, r)
    seen = {True: 0, False: 0}
    for step in range(12):
        r.append_output_token_ids([100 + step])
        holds = m.holds_next_token(r)
        seen[holds] += 1
        before = (m.num_free_blocks, dict(m._num_hashed), ids(m, "a"))
        new = compute(m, r, 1)
        if holds:
            assert new == [] and (m.num_free_blocks, dict(m._num_hashed), ids(m, "a")) == before
        else:
            assert new or m._num_hashed != before[1], "it said no, yet nothing changed"
    assert seen[True] and seen[False]
