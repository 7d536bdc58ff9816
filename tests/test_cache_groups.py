"""Cache specs and groups: how layers group, and how the cache manager allocates, frees
and shares blocks and state slots per group."""

import pytest
import torch

from spindle.cache.spec import (FULL_ATTENTION, MAMBA, SLIDING_WINDOW, AttentionCacheSpec,
                                CacheGroup, MambaCacheSpec, build_cache_layout)
from spindle.engine.kv_cache_manager import NO_HIT, NULL_BLOCK_ID, KVCacheManager
from spindle.engine.request import Request
from spindle.sampling_params import SamplingParams

BS = 4


class FakeLayer:
    def __init__(self, spec):
        self.spec = spec

    def cache_spec(self, dtype):
        return self.spec


def attn(window=None, heads=2):
    return FakeLayer(AttentionCacheSpec(heads, 8, torch.float32, window))


def mamba():
    return FakeLayer(MambaCacheSpec(((6, 3), (2, 4, 5)), (torch.float32, torch.float32)))


def make_request(rid, prompt, max_tokens=64):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens)


def schedule(manager, request, num_new, hits=NO_HIT):
    """What the scheduler does: allocate, then count the tokens as computed."""
    num_hit = hits.num_tokens
    new = manager.allocate_slots(request, num_new, hits)
    if new is not None:
        request.num_computed_tokens += num_hit + num_new
    return new


# ------------------------------------------------------------------ layouts

def test_layers_with_one_spec_form_one_group():
    layers = [attn(), attn(), attn()]
    layout = build_cache_layout(layers, BS, torch.float32)
    assert [g.kind for g in layout.groups] == [FULL_ATTENTION]
    assert layout.group_size == 3 and layout.group_layers == [layers]
    # One block id: a page in each of the three layers' tensors.
    assert layout.block_bytes() == 3 * 2 * BS * 2 * 8 * 4


def test_mixed_attention_kinds_form_equal_groups_sharing_tensors():
    full = [attn(), attn()]
    sliding = [attn(8) for _ in range(4)]
    layers = [full[0], sliding[0], sliding[1], full[1], sliding[2], sliding[3]]
    layout = build_cache_layout(layers, BS, torch.float32)
    assert [(g.kind, g.num_layers) for g in layout.groups] == [
        (FULL_ATTENTION, 2), (SLIDING_WINDOW, 2), (SLIDING_WINDOW, 2)]
    assert layout.group_layers == [full, sliding[:2], sliding[2:]]
    assert layout.group_size == 2  # every block id costs two pages, whichever group holds it
    assert layout.block_bytes() == 2 * 2 * BS * 2 * 8 * 4


def test_mamba_layers_form_a_state_group():
    layers = [mamba(), attn(), mamba(), mamba()]
    layout = build_cache_layout(layers, BS, torch.float32)
    assert [g.kind for g in layout.groups] == [FULL_ATTENTION, MAMBA]
    assert layout.slot_bytes() == 3 * (6 * 3 + 2 * 4 * 5) * 4
    req = layout.requirements()
    assert req.has_paged and req.has_state


def test_attention_pages_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="differ in shape"):
        build_cache_layout([attn(heads=2), attn(8, heads=4)], BS, torch.float32)


def test_blocks_a_sliding_sequence_needs_are_bounded():
    group = CacheGroup(SLIDING_WINDOW, 1, sliding_window=8)
    assert group.blocks_for(4, BS) == 1
    assert group.blocks_for(1000, BS) == 250  # a one-step prefill writes all 1000
    # Steps of one token: the window's 8 positions straddle at most 3 blocks.
    assert group.blocks_for(1000, BS, step_tokens=1) == 3
    assert group.blocks_for(1000, BS, step_tokens=8) == 5
    assert CacheGroup(FULL_ATTENTION, 1).blocks_for(1000, BS) == 250


# ------------------------------------------------------------ sliding window

def sliding_manager(num_blocks=64, window=8, caching=False):
    groups = [CacheGroup(FULL_ATTENTION, 1), CacheGroup(SLIDING_WINDOW, 1, sliding_window=window)]
    return KVCacheManager(num_blocks, BS, caching, groups)


def test_sliding_group_frees_blocks_behind_the_window():
    m = sliding_manager(window=8)
    r = make_request("a", range(10))
    schedule(m, r, 10)
    assert [len(ids) for ids in m.get_block_ids("a")] == [3, 3]
    held_after_prefill = m.num_free_blocks
    for token in range(40):  # decode 40 tokens
        r.append_output_token_ids([token])
        schedule(m, r, 1)
    full, sliding = m.get_block_ids("a")
    assert len(full) == len(sliding) == 13  # 50 tokens
    # The next token (position 50) reads positions 43..50: blocks 10..12 only.
    live = [b for b in sliding if b != NULL_BLOCK_ID]
    assert sliding[:10] == [NULL_BLOCK_ID] * 10 and len(live) == 3
    # The full group grew by 10 blocks; the sliding group freed as many as it took.
    assert m.num_free_blocks == held_after_prefill - 10
    assert m.get_num_blocks("a") == 13 + 3
    m.free(r)
    assert m.num_free_blocks == 64


def test_a_sliding_only_model_holds_a_bounded_number_of_blocks():
    m = KVCacheManager(16, BS, False, [CacheGroup(SLIDING_WINDOW, 2, sliding_window=6)],
                       max_step_tokens=8)
    r = make_request("a", range(7), max_tokens=500)
    schedule(m, r, 7)
    for token in range(300):
        r.append_output_token_ids([token])
        assert schedule(m, r, 1) is not None
        assert m.get_num_blocks("a") <= 3
    assert m.can_ever_fit(10_000)


def test_prefix_hits_need_only_the_window_blocks_of_a_sliding_group():
    m = sliding_manager(window=8, caching=True)
    a = make_request("a", range(21))
    schedule(m, a, 21)  # 5 full blocks cached in both groups
    b = make_request("b", list(range(20)) + [99, 98])
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 20
    full_hits, sliding_hits = hits.blocks
    assert [h.block_id for h in full_hits] == m.get_block_ids("a")[0][:5]
    # Position 20 reads 13..20: blocks 3 and 4 of the sliding group, not 0..2.
    assert sliding_hits[:3] == [None] * 3
    assert [h.block_id for h in sliding_hits[3:]] == m.get_block_ids("a")[1][3:5]
    schedule(m, b, 2, hits)
    assert m.get_block_ids("b")[1][:3] == [NULL_BLOCK_ID] * 3


def test_a_sliding_hit_shrinks_until_its_window_blocks_are_cached():
    m = sliding_manager(window=8, caching=True)
    a = make_request("a", range(21))
    schedule(m, a, 21)
    # Evict a's sliding block 4 from the prefix cache (it is freed, then reused).
    a.append_output_token_ids([0] * 12)
    for _ in range(3):  # move a's window past blocks 3 and 4 ...
        schedule(m, a, 4)
    m.free(a)
    m.block_pool.get_new_blocks(m.num_free_blocks)  # ... and reuse every free block
    assert m.get_computed_blocks(make_request("b", range(22)))[1] == 0


# --------------------------------------------------------------- state slots

def hybrid_manager(num_blocks=32, slots=2):
    groups = [CacheGroup(FULL_ATTENTION, 1), CacheGroup(MAMBA, 3)]
    return KVCacheManager(num_blocks, BS, False, groups, num_state_slots=slots)


def test_each_running_request_holds_one_state_slot():
    m = hybrid_manager(slots=2)
    a, b, c = (make_request(x, range(6)) for x in "abc")
    assert schedule(m, a, 6) is not None and schedule(m, b, 3) is not None
    assert m.get_block_ids("a")[1] != m.get_block_ids("b")[1]
    assert len(m.get_block_ids("a")[1]) == 1
    # A chunk later the slot stays: the state group gets no new ids.
    slot_b = m.get_block_ids("b")[1]
    assert m.new_block_ids(schedule(m, b, 3))[1] == [] and m.get_block_ids("b")[1] == slot_b
    # No slot is left for c: nothing is taken.
    free_blocks = m.num_free_blocks
    assert schedule(m, c, 6) is None and m.num_free_blocks == free_blocks
    m.free(a)  # finished or preempted: the slot returns
    assert schedule(m, c, 6) is not None
    assert len(m.get_block_ids("c")[1]) == 1  # (a's slot, back in the pool)


def test_state_layers_need_slots():
    groups = [CacheGroup(FULL_ATTENTION, 1), CacheGroup(MAMBA, 3)]
    with pytest.raises(ValueError, match="num_state_slots"):
        KVCacheManager(8, BS, False, groups, num_state_slots=0)


def caching_hybrid_manager(slots=4, num_blocks=32):
    groups = [CacheGroup(FULL_ATTENTION, 1), CacheGroup(MAMBA, 3)]
    return KVCacheManager(num_blocks, BS, True, groups, num_state_slots=slots)


def test_a_step_ending_at_a_block_boundary_snapshots_the_state():
    m = caching_hybrid_manager()
    a = make_request("a", range(11))
    # A prefill chunk is cut at the last block boundary it crosses: 11 -> 8 tokens.
    assert m.align_chunk(a, 0, 11) == 8
    assert m.align_chunk(a, 8, 3) == 3  # the rest: nothing to cut
    assert m.align_chunk(a, 8, 1) == 1
    schedule(m, a, 8)
    (running,) = m.get_block_ids("a")[1]
    before, after = m.take_state_copies()
    assert before == [] and len(after) == 1 and after[0][0] == running
    snapshot = after[0][1]
    assert snapshot != running
    b = make_request("b", list(range(8)) + [50, 51, 52])
    # Not in the step that writes it: that step's copies run after its forward.
    assert m.get_computed_blocks(b)[1] == 0
    m.release_held_snapshots()  # the next schedule()
    schedule(m, a, 3)  # ends at 11: no boundary, no snapshot
    assert m.take_state_copies() == ([], [])
    # A request with the same first 8 tokens hits them, and starts from the snapshot.
    hit, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8 and hit.snapshot.block_id == snapshot
    schedule(m, b, 3, hit)
    (b_slot,) = m.get_block_ids("b")[1]
    assert b_slot not in (running, snapshot)
    assert m.take_state_copies() == ([(snapshot, b_slot)], [])
    assert m.prefix_cache_stats.hits == 8


@pytest.mark.parametrize("token_known", [True, False])
def test_a_decode_snapshot_whose_token_is_in_flight_registers_once_it_is_known(token_known):
    """Async scheduling: the step computing position 7 is scheduled while its input
    token (the prefill's output) is still being sampled. The snapshot after it (8
    tokens) is taken then, and offered to the prefix cache at the next schedule(), by
    which the token is known (else it is dropped)."""
    m = caching_hybrid_manager()
    a = make_request("a", range(7))
    schedule(m, a, 7)
    m.take_state_copies()
    a.num_output_placeholders = 1  # position 7's token is being sampled
    m.release_held_snapshots()
    schedule(m, a, 1)
    before, after = m.take_state_copies()
    assert before == [] and len(after) == 1
    free_slots = m.state_pool.num_free_blocks
    if token_known:
        a.num_output_placeholders = 0
        a.append_output_token_ids([42])
    m.release_held_snapshots()  # the next schedule()
    assert m.state_pool.num_free_blocks == free_slots + 1  # held until now either way
    if token_known:  # that step also registers the block of the now known token
        a.num_output_placeholders = 1
        schedule(m, a, 1)
    probe = make_request("p", list(range(7)) + [42, 9])
    hit, num_hit = m.get_computed_blocks(probe)
    assert num_hit == (8 if token_known else 0)
    if token_known:
        assert hit.snapshot.block_id == after[0][1]


def test_no_hit_without_a_snapshot_at_the_boundary():
    m = caching_hybrid_manager()
    a = make_request("a", range(6))
    schedule(m, a, 6)  # one step to 6: no boundary reached at a step's end
    assert m.take_state_copies() == ([], [])
    b = make_request("b", list(range(6)) + [9, 9, 9])
    assert m.get_computed_blocks(b)[1] == 0  # block 0 is cached, but no state at 4


def _manager_state(m: KVCacheManager, rid: str) -> tuple:
    """Everything a step's allocation may change, and the state copies it asked for."""
    return (m.num_free_blocks, m.state_pool.num_free_blocks if m.stateful else 0,
            dict(m._num_hashed), m.get_block_ids(rid), m.take_state_copies(),
            m.block_pool.num_cached_blocks)


def _decoding_request(kind: str) -> tuple[KVCacheManager, Request]:
    """A manager of kind and a request past its prompt, about to decode."""
    if kind == "hybrid":
        m = caching_hybrid_manager(slots=8, num_blocks=64)
    else:
        m = sliding_manager(window=6, caching=kind != "sliding")
    prompt, hits = list(range(20)) + [99, 98], NO_HIT
    if kind == "sliding_hit":  # admitted with a prefix hit: the window's first blocks None
        schedule(m, make_request("first", range(21)), 21)
        hits = m.get_computed_blocks(make_request("a", prompt))[0]
        assert hits.num_tokens == 20 and hits.blocks[1][0] is None
    r = make_request("a", prompt)
    schedule(m, r, len(prompt) - hits.num_tokens, hits)
    m.take_state_copies()
    return m, r


@pytest.mark.parametrize("in_flight", [False, True])
@pytest.mark.parametrize("kind", ["hybrid", "sliding", "sliding_cached", "sliding_hit"])
def test_decode_steps_skip_allocation_only_where_it_would_change_nothing(kind, in_flight):
    """The scheduler skips allocate_slots for a decode step where holds_next_token says
    so. Twin managers take the same steps, one always allocating, the other skipping as
    the scheduler does: they stay equal (blocks, the blocks windows leave behind, state
    snapshots at block boundaries, hashes), and both kinds of step occur. in_flight:
    async scheduling, each step's input token still being sampled when it is scheduled."""
    (always, a), (skipping, s) = _decoding_request(kind), _decoding_request(kind)
    skipped = []
    for step in range(14):
        for m, r in ((always, a), (skipping, s)):
            m.release_held_snapshots()  # (the start of a schedule())
            if in_flight:
                r.num_output_placeholders = 1
            else:
                r.append_output_token_ids([100 + step])
        skipped.append(skipping.holds_next_token(s))
        schedule(always, a, 1)
        if skipped[-1]:
            s.num_computed_tokens += 1
        else:
            schedule(skipping, s, 1)
        assert _manager_state(always, "a") == _manager_state(skipping, "a"), (step, skipped)
        if in_flight:
            for r in (a, s):
                r.num_output_placeholders = 0
                r.append_output_token_ids([100 + step])
    assert any(skipped) and not all(skipped), skipped


def test_a_request_preempted_in_its_snapshot_step_leaves_no_snapshot():
    m = caching_hybrid_manager()
    a = make_request("a", range(9))
    schedule(m, a, 8)
    m.free(a)  # preempted before the step ran
    assert m.take_state_copies() == ([], [])
    m.release_held_snapshots()
    assert m.get_computed_blocks(make_request("b", range(9)))[1] == 0


def test_snapshots_are_evicted_for_running_requests():
    m = caching_hybrid_manager(slots=2)
    a = make_request("a", range(5))
    schedule(m, a, 4)  # a's running slot + one snapshot: both slots used
    assert len(m.take_state_copies()[1]) == 1
    m.release_held_snapshots()
    m.free(a)
    b, c = make_request("b", [7] * 5), make_request("c", [8] * 5)
    assert schedule(m, b, 1) is not None and schedule(m, c, 1) is not None  # evicts it
    assert m.get_computed_blocks(make_request("d", range(5)))[1] == 0
    assert m.reset_prefix_cache() is False  # slots held
    m.free(b), m.free(c)
    assert m.reset_prefix_cache() is True


def test_a_model_of_state_layers_only_needs_no_blocks():
    m = KVCacheManager(0, BS, False, [CacheGroup(MAMBA, 4)], num_state_slots=3)
    r = make_request("a", range(50))
    assert schedule(m, r, 50) == []
    (slot,), = m.get_block_ids("a")
    assert slot in range(3)
    assert m.can_ever_fit(10**6)


def test_a_page_whose_values_are_its_keys_holds_one_plane():
    both = AttentionCacheSpec(1, 40, torch.float32)
    keys_only = AttentionCacheSpec(1, 40, torch.float32, values_are_keys=True)
    assert keys_only.block_bytes(16) * 2 == both.block_bytes(16)
    assert keys_only.page_key != both.page_key  # (never one tensor for the two)
    pages = torch.zeros(keys_only.shape(5, 16))
    seen = keys_only.layer_view(pages)
    assert seen.shape == (2, 5, 16, 1, 40)
    seen[1, 2, 3, 0, 4] = 7.0  # a value written lands on the key
    assert pages[0, 2, 3, 0, 4] == 7.0 and seen[0, 2, 3, 0, 4] == 7.0
    assert both.layer_view(pages) is pages


@pytest.mark.parametrize("values_are_keys", [False, True])
def test_head_major_pages_keep_a_heads_tokens_together(values_are_keys):
    """With head_major a page is allocated [kv heads, block_size, head dim] (one head's
    tokens one run), at the same bytes; the layer still sees [2, blocks, block_size, kv
    heads, head dim], and what it writes there lands in its head's run."""
    token_major = AttentionCacheSpec(4, 8, torch.float32, values_are_keys=values_are_keys)
    spec = AttentionCacheSpec(4, 8, torch.float32, values_are_keys=values_are_keys,
                              head_major=True)
    planes = 1 if values_are_keys else 2
    assert spec.shape(5, 16) == (planes, 5, 4, 16, 8)
    assert spec.block_bytes(16) == token_major.block_bytes(16)
    assert spec.page_key != token_major.page_key  # (never one tensor for the two)
    pages = torch.zeros(spec.shape(5, 16))
    seen = spec.layer_view(pages)
    assert seen.shape == (2, 5, 16, 4, 8)
    seen[planes - 1, 2, 3, 1, 6] = 7.0  # block 2, token 3, head 1, feature 6
    assert pages[planes - 1, 2, 1, 3, 6] == 7.0 and int(pages.count_nonzero()) == 1
    assert seen.data_ptr() == pages.data_ptr()


def test_pages_holding_copies_a_cache_into_another_layout():
    """pages_holding gives new head-major pages with every value of a token-major cache
    where the layer sees it, and refuses a one-plane spec (the values would be lost)."""
    cache = torch.randn(AttentionCacheSpec(3, 8, torch.float32).shape(4, 16))
    spec = AttentionCacheSpec(3, 8, torch.float32, head_major=True)
    seen = spec.pages_holding(cache)
    assert seen.shape == cache.shape and torch.equal(seen, cache)
    assert seen.data_ptr() != cache.data_ptr()
    assert seen.stride(3) == 16 * 8 and seen.stride(2) == 8  # heads first in a page
    keys_only = AttentionCacheSpec(3, 8, torch.float32, values_are_keys=True)
    with pytest.raises(ValueError, match="values_are_keys"):
        keys_only.pages_holding(cache)


def test_only_a_backend_that_reads_by_strides_gets_head_major_pages(monkeypatch):
    """SPINDLE_KV_HEAD_MAJOR=1 reaches the cache spec of a layer on the Triton backend
    (whose kernels read the cache through its strides), not one on torch_sdpa (which
    flattens the pages); anything but 0 or 1 is refused by name."""
    triton = pytest.importorskip("triton")  # noqa: F841 (the backend's module needs it)
    from spindle.attention.layer import Attention

    def spec(backend: str) -> AttentionCacheSpec:
        layer = Attention(4, 8, 8 ** -0.5, num_kv_heads=2, backend=backend)
        return layer.cache_spec(torch.float32)

    assert not spec("triton").head_major
    monkeypatch.setenv("SPINDLE_KV_HEAD_MAJOR", "1")
    assert spec("triton").head_major
    assert not spec("torch_sdpa").head_major
    monkeypatch.setenv("SPINDLE_KV_HEAD_MAJOR", "yes")
    with pytest.raises(ValueError, match="SPINDLE_KV_HEAD_MAJOR must be 0 or 1"):
        spec("triton")
