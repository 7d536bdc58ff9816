"""Which cache blocks and state slots each request holds, per cache group, and the
prefix cache over them.

The model's caching layers form groups (spindle/cache/spec.py). Every paged group
(full attention, sliding window) draws block ids from one BlockPool: a block id
costs the same memory in whichever group holds it. A request keeps one block list
per paged group; the token at position p lives in slot p % block_size of the
group's block p // block_size. A sliding-window group frees the blocks wholly
before the window of the request's next token as the request moves on; their list
entries become None (the runner never reads them; messages carry NULL_BLOCK_ID).
A mamba group holds a fixed-size state per sequence: the request takes one state
slot (the same slot id in every mamba layer) for as long as it runs.

Prefix caching with state groups: a hit at position p needs every state layer's
state after p tokens. Slots of a second kind, snapshots, keep them: when a step ends
a request's computation at a block boundary (the scheduler aligns prefill chunks to
boundaries, see align_chunk), the request's state is copied into a snapshot slot
registered under that boundary's block hash. Running slots and snapshots share one
pool of state slots; snapshots no request holds are evictable, least recently used
first, like free cached blocks. A request admitted with a hit copies the snapshot
into its own running slot before its first step. The copies travel in the
SchedulerOutput (state_copies_before / state_copies_after). A new snapshot is
registered, and a snapshot read by a hit released, only at the next schedule():
steps run in order on the device, so from then on every copy of the earlier step
comes before anything a later step does (a request admitted in the same step must
not copy a snapshot that step has yet to write).

Full blocks are identified by a chained hash of their tokens (and, through the
parent hash, of every token before them), separately per group, so two requests
with the same first k * block_size tokens can share those blocks. A request whose
keys and values differ for the same tokens chains from a root of its own
(request_root_hash): one served with a LoRA adapter (per adapter), or one whose tokens
rotate by LongRoPE's long factors (Request.rope_long).

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
from dataclasses import dataclass, field
from typing import Sequence

from spindle.cache.spec import FULL_ATTENTION, CacheGroup
from spindle.engine.block_pool import BlockPool, KVCacheBlock
from spindle.engine.request import Request

# Parent hash of a request's first block.
ROOT_BLOCK_HASH: bytes = hashlib.sha256(b"spindle-prefix-cache-root-v1").digest()
# The id a message carries for a block a sliding-window group freed (never read).
NULL_BLOCK_ID = 0

# Per paged group, a request's blocks in token order (None: freed, outside the window).
GroupBlocks = list[list[KVCacheBlock | None]]


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """sha256(parent_hash || token ids as little-endian int64) of one full block.

    parent_hash is the previous block's hash, or None (ROOT_BLOCK_HASH) for the
    first block, so equal tokens after different prefixes hash differently.
    """
    parent = ROOT_BLOCK_HASH if parent_hash is None else parent_hash
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def request_root_hash(request: Request) -> bytes | None:
    """The parent hash of request's first block: None (ROOT_BLOCK_HASH) for the base
    model's keys and values; another root for an adapter's, the long factors', or a
    cache salt's (a tenant's blocks shared only within it)."""
    if not request.rope_long and request.lora_request is None and request.cache_salt is None:
        return None
    h = hashlib.sha256(ROOT_BLOCK_HASH)
    if request.rope_long:
        h.update(b"long-rope")
    if request.lora_request is not None:
        h.update(request.lora_request.cache_key)
    if request.cache_salt is not None:
        h.update(b"salt\0" + request.cache_salt.encode())
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


@dataclass
class PrefixHit:
    """A prefix-cache hit: per paged group its blocks (None where a sliding window
    needs none), the state snapshot serving the state groups, and its tokens."""

    blocks: GroupBlocks = field(default_factory=list)
    snapshot: KVCacheBlock | None = None
    num_tokens: int = 0

    def __bool__(self) -> bool:
        return self.num_tokens > 0


NO_HIT = PrefixHit()


class KVCacheManager:
    """Allocates blocks and state slots to requests and maintains the prefix cache.

    Invariants:
      * _req_blocks[rid][g] holds exactly cdiv(tokens allocated for, block_size)
        entries for paged group g, in token order; entries of a sliding-window group
        wholly before the window of the request's next token are None (freed). The
        first _num_hashed[rid] entries of each group are full of computed tokens and
        have been offered to the prefix cache (freed ones before that).
      * A request with state groups holds one slot (_req_slot[rid]) while it holds
        anything at all.
      * request.block_hashes[i] == hash of full block i of request.all_token_ids
        (only maintained when caching is enabled; extended lazily whenever the
        manager looks at the request — token ids are append-only, so earlier
        hashes never change).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: Sequence[CacheGroup] | None = None, num_state_slots: int = 0,
                 max_step_tokens: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # Most tokens one step computes for a request (what a sliding-window group must
        # hold at once beside its window).
        self.max_step_tokens = max_step_tokens
        self.groups = list(groups) if groups is not None else [CacheGroup(FULL_ATTENTION, 1)]
        self.paged = [i for i, g in enumerate(self.groups) if g.is_paged]
        # Positions in self.paged of the sliding-window groups (the ones that free blocks).
        self._windowed = [i for i, g in enumerate(self.paged)
                          if self.groups[g].sliding_window is not None]
        self.stateful = [i for i, g in enumerate(self.groups) if not g.is_paged]
        if self.stateful and num_state_slots < 1:
            raise ValueError("a model with state (mamba) layers needs num_state_slots >= 1")
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Running slots and snapshots (spindle/engine/kv_cache_manager.py docstring).
        self.state_pool = BlockPool(num_state_slots if self.stateful else 0, enable_caching)
        self._req_blocks: dict[str, GroupBlocks] = {}
        self._req_slot: dict[str, KVCacheBlock] = {}
        self._num_hashed: dict[str, int] = {}
        self._state_copies_before: list[tuple[int, int]] = []
        # request id -> (running slot id, snapshot, the request, its tokens at the
        # snapshot), copied after the step being scheduled; registered in the prefix
        # cache at the next schedule(), once the copy comes before anything a later
        # step does and the tokens it covers are known (see _register_snapshot).
        self._state_copies_after: dict[str, tuple[int, KVCacheBlock, Request, int]] = {}
        self._pending_snapshots: list[tuple[KVCacheBlock, Request, int]] = []
        self._held_snapshots: list[KVCacheBlock] = []  # until the next schedule()
        self.prefix_cache_stats = PrefixCacheStats()
        self._max_fit_tokens = self._largest_fitting_sequence()
        # (A decode step ending at a block boundary keeps a state snapshot when this
        # is set: see holds_next_token.)
        self._snapshots_kept = bool(self.stateful) and enable_caching

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
        """Whether one sequence of num_tokens tokens fits in the whole cache."""
        return num_tokens <= self._max_fit_tokens

    def holds_next_token(self, request: Request) -> bool:
        """Whether a step computing one more token of request (no lookahead) needs
        nothing of allocate_slots: the request holds the blocks, no block becomes
        full unhashed, no window leaves a block behind (windows move on a block at a
        time) and no state snapshot is due (only where the step ends at a block
        boundary, as _snapshot_state says). Most requests of most decode steps; the
        scheduler then skips allocate_slots (which would return no new blocks and
        change nothing)."""
        total = request.num_computed_tokens + 1
        if self._snapshots_kept and total % self.block_size == 0:
            return False
        held = self._req_blocks.get(request.request_id)
        if held is None:
            return False
        if self._windowed and self._window_left_a_block(held, request.num_computed_tokens):
            return False
        needed = -(-total // self.block_size)
        for blocks in held:
            if needed > len(blocks):
                return False
        if not self.enable_caching:
            return True
        known = min(total, len(request.all_token_ids))
        return known // self.block_size <= self._num_hashed.get(request.request_id, 0)

    def _blocks_for_sequence(self, num_tokens: int) -> int:
        return sum(self.groups[g].blocks_for(num_tokens, self.block_size, self.max_step_tokens)
                   for g in self.paged)

    def _largest_fitting_sequence(self) -> int:
        """The most tokens one sequence may have and fit in the whole cache (the
        blocks it needs grow with its length; sliding windows alone: no bound), found
        once so that the scheduler's check of every request every step is one compare."""
        low, high = 0, 1 << 62
        while low < high:
            mid = (low + high + 1) // 2
            if self._blocks_for_sequence(mid) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    # ---------------------------------------------------------------- prefix hits
    def get_computed_blocks(self, request: Request) -> tuple[PrefixHit, int]:
        """The longest cached prefix of request's tokens that every group can serve,
        and the number of tokens it covers.

        At most (num_tokens - 1) tokens are reported as hits: when every token
        hits, the last block is dropped so the last token still goes through the
        model (its logits are needed to sample). A sliding-window group needs only
        the blocks within the window of the first recomputed token (the others are
        None); state groups need a snapshot at the hit's end. Does not take
        references: pass the hit to allocate_slots(). (NO_HIT, 0) without caching or
        for a request that already has computed tokens.
        """
        if not self.enable_caching or request.num_computed_tokens > 0:
            return NO_HIT, 0
        self._update_block_hashes(request)
        num_blocks = (request.num_tokens - 1) // self.block_size
        for g in self.paged:
            if self.groups[g].sliding_window is None:
                num_blocks = min(num_blocks, self._cached_chain_length(request, g, num_blocks))
        while num_blocks > 0:
            snapshot = self._snapshot_at(request, num_blocks) if self.stateful else None
            if snapshot is not None or not self.stateful:
                blocks = [self._hit_blocks(request, g, num_blocks) for g in self.paged]
                if all(b is not None for b in blocks):
                    hit = PrefixHit(blocks, snapshot, num_blocks * self.block_size)
                    return hit, hit.num_tokens
            num_blocks -= 1
        return NO_HIT, 0

    def _snapshot_at(self, request: Request, num_blocks: int) -> KVCacheBlock | None:
        key = self._group_key(request.block_hashes[num_blocks - 1], self.stateful[0])
        return self.state_pool.get_cached_block(key)

    def _cached_chain_length(self, request: Request, group: int, limit: int) -> int:
        for i, block_hash in enumerate(request.block_hashes[:limit]):
            if self.block_pool.get_cached_block(self._group_key(block_hash, group)) is None:
                return i
        return limit

    def _hit_blocks(self, request: Request, group: int,
                    num_blocks: int) -> list[KVCacheBlock | None] | None:
        """Group's blocks for a hit of num_blocks blocks; None if one it needs is gone."""
        first_needed = self._first_needed_block(group, num_blocks * self.block_size)
        blocks: list[KVCacheBlock | None] = [None] * first_needed
        for block_hash in request.block_hashes[first_needed:num_blocks]:
            block = self.block_pool.get_cached_block(self._group_key(block_hash, group))
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def _first_needed_block(self, group: int, position: int) -> int:
        """The first block a token at position (and every later one) reads in group."""
        window = self.groups[group].sliding_window
        if window is None:
            return 0
        return max(0, position - window + 1) // self.block_size

    # ---------------------------------------------------------------- allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       hit: PrefixHit = NO_HIT, num_lookahead_tokens: int = 0
                       ) -> GroupBlocks | None:
        """Make request hold enough blocks (per paged group) for
        request.num_computed_tokens + hit tokens + num_new_tokens tokens, and a state
        slot where the model has state groups; hit is a prefix hit from
        get_computed_blocks() (only for a request holding nothing yet;
        request.num_computed_tokens must not include them yet). When the tokens up
        to the end of this step end at a block boundary, state groups also keep a
        snapshot there (prefix caching).

        Returns the newly allocated blocks per paged group (hits excluded; possibly
        empty lists), or None and changes nothing (beyond freeing blocks that left a
        window) when too few blocks or slots are free.

        Then registers in the prefix cache every block made full by the tokens up to
        request.num_computed_tokens + hits + num_new_tokens: those tokens are either
        computed already or scheduled this step (see the module docstring), and they
        are all known token ids (the total may not exceed request.num_tokens).

        num_lookahead_tokens: slots past those tokens, allocated but never hashed (the
        draft tokens a speculative step verifies, and the ones a draft model writes).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        held = self._req_blocks.get(rid)
        is_new = held is None
        if hit and not is_new:
            raise ValueError(f"request {rid} already holds blocks: prefix hits can only "
                             "be taken at admission")
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        start = request.num_computed_tokens + hit.num_tokens
        total = start + num_new_tokens
        num_tokens = len(request.all_token_ids)
        if total > num_tokens + request.num_output_placeholders:
            raise ValueError(f"request {rid}: cannot allocate for {total} tokens, it has "
                             f"only {num_tokens} known tokens")
        known = min(total, num_tokens)  # only known token ids are ever hashed
        end_of_step, total = total, total + num_lookahead_tokens
        if held is not None:
            if self._windowed:
                self._free_outside_windows(rid, held, start)
            if self._holds_enough(rid, held, total, known):
                self._snapshot_state(request, end_of_step)
                return [[] for _ in self.paged]  # the common decode step
        hits = hit.blocks if hit else [[] for _ in self.paged]
        lengths = [len(h) for h in held] if held is not None else [len(h) for h in hits]
        num_needed = [max(0, _cdiv(total, self.block_size) - n) for n in lengths]
        num_revived = sum(1 for group in hits for b in group if b is not None and b.ref_cnt == 0)
        if sum(num_needed) + num_revived > self.block_pool.num_free_blocks:
            return None
        if is_new and self.stateful:
            revived = hit.snapshot is not None and hit.snapshot.ref_cnt == 0
            if self.state_pool.num_free_blocks < 1 + revived:
                return None

        if is_new:
            self._admit(request, hit)
        blocks = self._req_blocks[rid]
        new_blocks = []
        for i, n in enumerate(num_needed):
            fresh = self.block_pool.get_new_blocks(n)
            blocks[i].extend(fresh)
            new_blocks.append(fresh)
        self._cache_full_blocks(request, known // self.block_size)
        self._snapshot_state(request, end_of_step)
        return new_blocks

    def _admit(self, request: Request, hit: PrefixHit) -> None:
        rid = request.request_id
        self._record_admission(request, hit.num_tokens)
        blocks = hit.blocks if hit else [[] for _ in self.paged]
        for group in blocks:
            self.block_pool.touch(b for b in group if b is not None)
        self._req_blocks[rid] = [list(group) for group in blocks]
        self._num_hashed[rid] = hit.num_tokens // self.block_size
        if self.stateful:
            if hit.snapshot is not None:
                self.state_pool.touch([hit.snapshot])  # held until its copy has run
                self._held_snapshots.append(hit.snapshot)
            (slot,) = self.state_pool.get_new_blocks(1)
            self._req_slot[rid] = slot
            if hit.snapshot is not None:
                self._state_copies_before.append((hit.snapshot.block_id, slot.block_id))

    def _snapshot_state(self, request: Request, total: int) -> None:
        """Keep the request's state after `total` tokens as a prefix-cache entry when
        that is a block boundary not kept yet (best effort: skipped when no slot is
        free). Its last token may still be being sampled (async scheduling feeds it
        to this step on the device): the entry is registered once it is known."""
        if (not self.stateful or not self.enable_caching or total % self.block_size
                or total == 0):
            return
        if total <= request.num_tokens:
            self._update_block_hashes(request)
            key = self._snapshot_key(request, total)
            if self.state_pool.get_cached_block(key) is not None or any(
                    t <= r.num_tokens and self._snapshot_key(r, t) == key
                    for _, _, r, t in self._state_copies_after.values()):
                return
        if self.state_pool.num_free_blocks < 1:
            return
        (snapshot,) = self.state_pool.get_new_blocks(1)
        self._state_copies_after[request.request_id] = (
            self._req_slot[request.request_id].block_id, snapshot, request, total)

    def _snapshot_key(self, request: Request, total: int) -> bytes:
        """The prefix-cache key of the state after request's first total tokens."""
        return self._group_key(request.block_hashes[total // self.block_size - 1],
                               self.stateful[0])

    def _register_snapshot(self, snapshot: KVCacheBlock, request: Request, total: int) -> None:
        """Offer a written snapshot to the prefix cache, when the tokens it covers are
        all known by now (a request that stopped may have sampled no more), and no
        other snapshot holds the same state."""
        if total > request.num_tokens:
            return
        self._update_block_hashes(request)
        key = self._snapshot_key(request, total)
        if self.state_pool.get_cached_block(key) is None:
            self.state_pool.cache_full_blocks([snapshot], [key])

    def align_chunk(self, request: Request, start: int, num_new: int) -> int:
        """With state snapshots, end a chunk of several tokens at the last block
        boundary it crosses (the state is kept at the end of a step only), unless
        that leaves nothing to compute; the rest follows in the next step."""
        if not (self.stateful and self.enable_caching) or num_new <= 1:
            return num_new
        aligned = (start + num_new) // self.block_size * self.block_size
        return aligned - start if aligned > start else num_new

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The state-slot copies (src, dst) of the step being scheduled: before its
        forward (snapshot -> running slot) and after it (running slot -> snapshot)."""
        after = [(src, snapshot.block_id) for src, snapshot, _, _
                 in self._state_copies_after.values()]
        self._pending_snapshots.extend((snapshot, request, total) for _, snapshot, request, total
                                       in self._state_copies_after.values())
        before = self._state_copies_before
        self._state_copies_before, self._state_copies_after = [], {}
        return before, after

    def release_held_snapshots(self) -> None:
        """At the start of a schedule(): the copies of earlier steps come first on
        the device, so the snapshots they wrote may serve hits from now on, and the
        snapshots they read may be reused."""
        pending, self._pending_snapshots = self._pending_snapshots, []
        for snapshot, request, total in pending:
            self._register_snapshot(snapshot, request, total)
        held, self._held_snapshots = self._held_snapshots, []
        self.state_pool.free_blocks(held + [snapshot for snapshot, _, _ in pending])

    def _free_outside_windows(self, rid: str, held: GroupBlocks, position: int) -> None:
        """Free the sliding-window blocks no token from position on will read."""
        for i in self._windowed:
            blocks = held[i]
            first_needed = self._window_cut(i, blocks, position)
            freed = [b for b in blocks[:first_needed] if b is not None]
            if freed:
                for j in range(first_needed):
                    blocks[j] = None
                self.block_pool.free_blocks(reversed(freed))

    def _window_left_a_block(self, held: GroupBlocks, position: int) -> bool:
        """Whether _free_outside_windows(position) would free a block. It frees all
        the blocks before a window's first needed one, and prefix hits leave those
        out, so the freed blocks of a group are a prefix: the last one before the
        first needed tells."""
        for i in self._windowed:
            blocks = held[i]
            first_needed = self._window_cut(i, blocks, position)
            if first_needed and blocks[first_needed - 1] is not None:
                return True
        return False

    def _window_cut(self, i: int, blocks: list, position: int) -> int:
        """How many of blocks (paged group i's, a request's) no token from position on
        reads: those before the window's first needed block."""
        return min(self._first_needed_block(self.paged[i], position), len(blocks))

    def _holds_enough(self, rid: str, held: GroupBlocks, total: int, known: int) -> bool:
        """Whether held blocks cover total tokens and no block newly became full."""
        needed = _cdiv(total, self.block_size)
        for blocks in held:
            if needed > len(blocks):
                return False
        return not self.enable_caching or known // self.block_size <= self._num_hashed.get(rid, 0)

    def free(self, request: Request) -> None:
        """Release every block and the state slot of request, tail first (its last
        blocks are evicted first). No-op for a request holding none.

        Blocks its computed tokens filled are offered to the prefix cache first: under
        async scheduling the last block's final token was still being sampled when
        that block was scheduled, so it could not be hashed then (a follow-up turn
        would miss it)."""
        rid = request.request_id
        if rid in self._req_blocks:
            computed = min(request.num_computed_tokens, request.num_tokens)
            self._cache_full_blocks(request, computed // self.block_size)
        groups = self._req_blocks.pop(rid, None)
        self._num_hashed.pop(rid, None)
        slot = self._req_slot.pop(rid, None)
        if slot is not None:
            self.state_pool.free_blocks([slot])
        pending = self._state_copies_after.pop(rid, None)
        if pending is not None:
            # Preempted in the step that was to take its snapshot: the step will not
            # compute its tokens, so the snapshot is dropped unregistered.
            self.state_pool.free_blocks([pending[1]])
        for blocks in groups or ():
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def no_new_block_ids(self) -> list[list[int]]:
        """new_block_ids() of an allocation that added nothing: an empty list per group."""
        return [[] for _ in self.groups]

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """Per group: the block ids of a paged group (NULL_BLOCK_ID where freed), or
        [slot] for a state group; empty lists for a request holding nothing."""
        held = self._req_blocks.get(request_id)
        out: list[list[int]] = []
        paged = iter(held or [[] for _ in self.paged])
        for group in self.groups:
            if group.is_paged:
                out.append([NULL_BLOCK_ID if b is None else b.block_id for b in next(paged)])
            else:
                slot = self._req_slot.get(request_id)
                out.append([] if slot is None else [slot.block_id])
        return out

    def new_block_ids(self, new_blocks: GroupBlocks) -> list[list[int]]:
        """allocate_slots()'s result as ids per group (state groups: none new)."""
        if not any(new_blocks):  # the common decode step
            return self.no_new_block_ids()
        paged = iter(new_blocks)
        return [[b.block_id for b in next(paged)] if group.is_paged else []
                for group in self.groups]

    def get_num_blocks(self, request_id: str) -> int:
        """Blocks request holds in all paged groups (freed ones not counted)."""
        return sum(1 for blocks in self._req_blocks.get(request_id, ())
                   for b in blocks if b is not None)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash and state snapshot; False (nothing done) while
        any block or slot is held."""
        self.release_held_snapshots()
        if self.state_pool.num_free_blocks != self.state_pool.num_blocks:
            return False
        return self.block_pool.reset_prefix_cache() and self.state_pool.reset_prefix_cache()

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
        hashes = request.block_hashes[start:num_full_blocks]
        for i, g in enumerate(self.paged):
            pairs = [(b, self._group_key(h, g))
                     for b, h in zip(self._req_blocks[rid][i][start:num_full_blocks], hashes)
                     if b is not None]
            if pairs:
                self.block_pool.cache_full_blocks([b for b, _ in pairs], [k for _, k in pairs])
        self._num_hashed[rid] = num_full_blocks

    @staticmethod
    def _group_key(block_hash: bytes, group: int) -> bytes:
        """A block's prefix-cache key in group (the plain hash in group 0)."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i > 0 else request_root_hash(request)
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))
