"""Exact hit lengths, exact block ids, exact eviction order on tiny caches."""

import pytest

from xllm_vmm.kvcache.hashing import block_hashes
from xllm_vmm.kvcache.prefix import PrefixCache, PrefixCacheError
from tests.prefix.fakes import FakeAllocator, FakeGroup, Runner

BS = 4


def make(bps=4, slots=8, budget=8, groups=("attn",), hybrid=False):
    fg = {g: FakeGroup(blocks_per_slot=bps, num_slots=slots) for g in groups}
    alloc = FakeAllocator(fg, budget)
    prefix = PrefixCache(alloc.allocator, {g: 32 for g in groups}, BS, hybrid=hybrid)
    alloc.policy = prefix
    return alloc, prefix, Runner(alloc, prefix, BS)


def toks(*blocks, tail=1):
    """Token list made of whole blocks named by ints, plus ``tail`` extra tokens."""
    out = []
    for b in blocks:
        out += [b * 100 + i for i in range(BS)]
    return out + [7] * tail


def test_complete_blocks_are_cached_after_release_and_reused_by_id():
    alloc, prefix, run = make()
    a = run.start(toks(1, 2, 3))
    assert a.blocks["attn"] == [0, 1, 2, 3] and a.hit == 0
    run.compute(a)
    run.finish(a)
    # the 3 complete blocks stay cached, the partial 4th is freed
    assert sorted(alloc.groups["attn"].cached) == [0, 1, 2]
    assert 3 not in alloc.groups["attn"].ref
    assert prefix.stats.cached_blocks == 3 and prefix.stats.cached_bytes == 96
    b = run.start(toks(1, 2, 9))
    assert b.hit == 2 and b.blocks["attn"][:2] == [0, 1]
    assert alloc.groups["attn"].ref[0] == 1 and alloc.groups["attn"].cached == {2}
    s = prefix.stats
    assert (s.queries, s.hits, s.hit_blocks, s.hit_tokens) == (2, 1, 2, 8)
    assert s.query_tokens == 24


def test_shared_blocks_are_referenced_not_copied():
    alloc, prefix, run = make()
    a = run.start(toks(1, 2))
    run.compute(a)
    b = run.start(toks(1, 2, 5))  # a is still running: its blocks are live and shared
    assert b.hit == 2 and b.blocks["attn"][:2] == a.blocks["attn"][:2]
    assert alloc.groups["attn"].ref[0] == 2
    run.finish(a)
    assert alloc.groups["attn"].ref[0] == 1 and prefix.num_evictable("attn") == 0
    run.compute(b)
    run.finish(b)
    assert prefix.num_evictable("attn") == 3


def test_full_prompt_hit_leaves_one_token_to_compute():
    alloc, prefix, run = make()
    a = run.start(toks(1, 2, tail=0))
    run.compute(a)
    run.finish(a)
    b = run.start(toks(1, 2, tail=0))
    assert b.hit == 1  # max_blocks = (8 - 1) // 4


def test_plain_lru_order_is_release_order_tail_first():
    alloc, prefix, run = make(bps=8, slots=1, budget=1)
    a = run.start(toks(1, 2, 3, tail=0))
    run.compute(a)
    run.finish(a)
    b = run.start(toks(4, 5, tail=0))
    run.compute(b)
    run.finish(b)
    # a released [2,1,0] (tail first), then b released [4,3]
    assert prefix.lru_order("attn") == [2, 1, 0, 4, 3]
    assert prefix.evict("attn", 2, prefer_slot_emptying=False) == [2, 1]
    assert prefix.stats.evictions == 2
    # the hashes of evicted blocks are gone; a's first block is still a hit
    hs = block_hashes(toks(1, 2, 3, tail=0), BS)
    assert prefix.lookup(hs, record=False).num_blocks == 1


def test_a_hit_moves_blocks_to_the_most_recent_end():
    alloc, prefix, run = make(bps=8, slots=1, budget=1)
    a = run.start(toks(1, 2, tail=0))
    run.compute(a)
    run.finish(a)
    b = run.start(toks(3, 4, tail=0))
    run.compute(b)
    run.finish(b)
    assert prefix.lru_order("attn") == [1, 0, 3, 2]
    c = run.start(toks(1, 9))  # hits block 0 only
    assert c.hit == 1
    run.compute(c)
    run.finish(c)
    # c released [its new blocks..., 0]: 0 is now most recent
    assert prefix.lru_order("attn") == [1, 3, 2, 4, 0]


def test_allocation_under_budget_evicts_lru_and_retries():
    alloc, prefix, run = make(bps=2, slots=4, budget=2)
    a = run.start(toks(1, 2, tail=0))  # slot 0: blocks 0, 1
    run.compute(a)
    run.finish(a)
    b = run.start(toks(3, 4, tail=0))  # slot 1: blocks 2, 3
    run.compute(b)
    run.finish(b)
    assert alloc.mapped_total() == 2
    c = run.start(toks(5, 6, tail=0))  # budget full: evict a whole slot (the oldest: slot 0)
    assert c.blocks["attn"] == [0, 1]
    assert prefix.stats.evictions == 2 and prefix.stats.evicted_slots_emptied == 1
    assert ("attn", 0) in alloc.released_slots
    assert prefix.lookup(block_hashes(toks(1, 2, tail=0), BS), record=False).num_blocks == 0
    assert prefix.lookup(block_hashes(toks(3, 4, tail=0), BS), record=False).num_blocks == 2


def _scattered():
    """Slot 0: live block 0 + cached 1..3 (oldest); slot 1: cached 4..7 (newer)."""
    alloc, prefix, run = make(bps=4, slots=2, budget=2)
    a = run.start(toks(1, 2, 3, 4, tail=0))
    run.compute(a)
    run.finish(a)
    b = run.start(toks(5, 6, 7, 8, tail=0))
    run.compute(b)
    run.finish(b)
    prefix.touch("attn", 0)  # a request holds block 0 again
    assert prefix.lru_order("attn") == [3, 2, 1, 7, 6, 5, 4]
    return alloc, prefix


def _evict_and_free(alloc, prefix, n, prefer):
    return prefix.evict("attn", n, prefer_slot_emptying=prefer)  # frees them itself


def test_plain_lru_eviction_frees_no_page_when_survivors_are_scattered():
    alloc, prefix = _scattered()
    assert _evict_and_free(alloc, prefix, 2, prefer=False) == [3, 2]
    assert alloc.released_slots == [] and alloc.mapped_total() == 2


def test_slot_emptying_eviction_gives_up_a_whole_slot_first():
    alloc, prefix = _scattered()
    assert _evict_and_free(alloc, prefix, 2, prefer=True) == [4, 5, 6, 7]  # slot 1 whole
    assert alloc.released_slots == [("attn", 1)] and alloc.mapped_total() == 1
    assert prefix.stats.evicted_slots_emptied == 1
    # nothing emptiable left: falls back to LRU
    assert _evict_and_free(alloc, prefix, 1, prefer=True) == [3]


def test_pinned_blocks_are_never_evicted_and_return_to_lru_after_unpin():
    alloc, prefix, run = make(bps=8, slots=1, budget=1)
    a = run.start(toks(1, 2, tail=0))
    run.compute(a)
    run.finish(a)
    prefix.pin("attn", 1)
    assert prefix.num_evictable("attn") == 1
    assert prefix.evict("attn", 5, prefer_slot_emptying=False) == [0]
    assert prefix.is_cached("attn", 1)
    prefix.unpin("attn", 1)
    assert prefix.lru_order("attn") == [1]
    with pytest.raises(ValueError, match="not pinned"):
        prefix.unpin("attn", 1)


def test_pinned_unpublished_block_survives_release_until_unpinned():
    alloc, prefix, run = make()
    a = run.start(toks(1, 2))
    prefix.pin("attn", 0)  # e.g. a restore writes block 0
    prefix.release(a.blocks)  # cancelled before computing: nothing was published
    assert alloc.groups["attn"].ref == {0: 0}
    assert prefix.num_evictable("attn") == 0
    prefix.unpin("attn", 0)  # copy finished (failed): nothing keeps it, freed at once
    assert prefix.lru_order("attn") == []
    assert alloc.groups["attn"].ref == {} and alloc.mapped_total() == 0


def test_duplicate_publish_keeps_first_block_and_frees_duplicate():
    alloc, prefix, run = make()
    a = run.start(toks(1, 2))
    b = run.start(toks(1, 2))  # both miss: computed twice
    run.compute(a)
    run.compute(b)
    assert prefix.stats.duplicate_publishes == 2
    run.finish(b)
    assert sorted(alloc.groups["attn"].ref) == [0, 1, 2]  # b's blocks all freed
    run.finish(a)
    assert sorted(alloc.groups["attn"].cached) == [0, 1]


def test_two_groups_hit_together_and_eviction_in_one_withdraws_both():
    alloc, prefix, run = make(groups=("attn", "draft"))
    a = run.start(toks(1, 2))
    run.compute(a)
    run.finish(a)
    assert prefix.lookup(block_hashes(toks(1, 2), BS), record=False).blocks == {
        "attn": (0, 1), "draft": (0, 1)}
    assert prefix.evict("draft", 1, prefer_slot_emptying=False) == [1]
    # the hash of block 1 is gone from both groups; attn's block 1 is freed with it
    assert prefix.lookup(block_hashes(toks(1, 2), BS), record=False).num_blocks == 1
    assert prefix.lru_order("attn") == [0]
    assert sorted(alloc.groups["attn"].ref) == [0]


def test_hybrid_hit_stops_at_last_checkpoint():
    alloc, prefix, run = make(hybrid=True)
    a = run.start(toks(1, 2, 3, 4))
    hs = a.hashes
    for i in range(4):
        alloc.write_block("attn", a.blocks["attn"][i], b"x")
    prefix.publish(a.blocks, hs, checkpoints={1: ("state-after-block-1", 100)})
    run.finish(a)
    hit = prefix.lookup(hs)
    assert hit.num_blocks == 2 and hit.checkpoint == "state-after-block-1"
    assert prefix.stats.checkpoint_bytes == 100
    # without a checkpoint at or before the match, nothing is usable
    assert prefix.lookup(block_hashes(toks(1, tail=0), BS), record=False).num_blocks == 0
    prefix.evict("attn", 4, prefer_slot_emptying=False)
    assert prefix.stats.checkpoint_bytes == 0


def test_reset_frees_cached_blocks_and_keeps_referenced_ones():
    alloc, prefix, run = make()
    a = run.start(toks(1, 2))
    run.compute(a)
    run.finish(a)
    b = run.start(toks(3, 4))
    run.compute(b)
    assert prefix.reset() == 2  # a's two cached blocks
    assert prefix.stats.cached_blocks == 0 and prefix.stats.indexed_hashes == 0
    run.finish(b)  # unpublished now: freed on release
    assert alloc.groups["attn"].ref == {} and alloc.mapped_total() == 0


def test_publish_needs_every_group():
    alloc, prefix, run = make(groups=("attn", "draft"))
    with pytest.raises(PrefixCacheError, match="missing 'draft'"):
        prefix.publish({"attn": [0]}, [123])


def test_stats_as_dict_has_operator_fields():
    alloc, prefix, run = make()
    d = prefix.stats.as_dict()
    for k in ("queries", "hits", "hit_tokens", "evictions", "cached_blocks", "cached_bytes",
              "hit_rate"):
        assert k in d


def test_acquire_chain_is_lookup_then_acquire_with_the_same_ids_counters_and_lru():
    alloc, prefix, run = make()
    a = run.start(toks(1, 2, 3))
    run.compute(a)
    run.finish(a)  # blocks 0, 1, 2 cached, LRU tail first: 2, 1, 0
    assert prefix.lru_order("attn") == [2, 1, 0]
    hs = block_hashes(toks(1, 2, 9), BS)
    before = prefix.stats.as_dict()
    got = prefix.acquire_chain(hs, max_blocks=3)
    assert got == [0, 1]  # block 3's hash (9) is not indexed: the chain stops there
    assert alloc.groups["attn"].ref[0] == 1 and alloc.groups["attn"].ref[1] == 1
    assert prefix.lru_order("attn") == [2]  # revived blocks left the LRU
    s = prefix.stats
    assert (s.queries - before["queries"], s.hits - before["hits"],
            s.hit_blocks - before["hit_blocks"], s.hit_tokens - before["hit_tokens"]) == (1, 1, 2, 8)
    assert prefix.acquire_chain(hs, max_blocks=1) == [0]  # capped; a live block: ref 2
    assert alloc.groups["attn"].ref[0] == 2
    assert prefix.acquire_chain(hs, max_blocks=0) == []
    alloc.allocator.check_invariants()


def test_acquire_chain_refuses_several_groups_and_hybrid_caches():
    _, prefix, _ = make(groups=("attn", "draft"))
    with pytest.raises(PrefixCacheError, match="one-group"):
        prefix.acquire_chain([], 0)
    _, prefix, _ = make(hybrid=True)
    with pytest.raises(PrefixCacheError, match="checkpoints"):
        prefix.acquire_chain([], 0)


def test_a_refused_publish_changes_nothing():
    alloc, prefix, run = make()
    a = run.start(toks(1, 2, 3))
    table = a.blocks["attn"]
    hs = block_hashes(toks(1, 2, 3), BS)
    prefix.publish({"attn": table}, hs[1:2], first_block=1)  # block 1 under hash 1
    snapshot = (dict(prefix._groups["attn"].hash_to_block), prefix.stats.indexed_hashes)
    # block 1 again, now under hash 0 (content changed): refused after hash 0 -> block 0 ok
    bad = [hs[0], hs[2]]
    with pytest.raises(PrefixCacheError, match="request block 1 is already published"):
        prefix.publish({"attn": [table[0], table[1]]}, bad, first_block=0)
    assert (dict(prefix._groups["attn"].hash_to_block), prefix.stats.indexed_hashes) == snapshot
    assert not alloc.allocator.is_retained("attn", table[0])
    with pytest.raises(PrefixCacheError, match="has no block id"):
        prefix.publish({"attn": table[:2]}, hs, first_block=0)
    assert prefix.stats.indexed_hashes == snapshot[1]
