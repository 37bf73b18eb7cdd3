"""Compaction through the manager under the prefix cache: moved blocks keep their bytes, the
index and LRU follow the move (``PrefixCache.on_move``), the manager rewrites the request's
block table in place, pinned blocks stay put."""

import pytest

from tests.prefix.real import BS, MiB, Stack, flat_layout, toks

DRIVERS = ["host", "acl-emu"]


@pytest.fixture(params=DRIVERS)
def kind(request):
    return request.param


def _sparse(s):
    """Slot 0 keeps only a's first block (7, cached); slot 1 holds a's blocks 8, 9 (cached)."""
    filler = s.mgr.allocate("filler", 7 * BS)["attn"]
    assert filler == list(range(7))
    a = s.start(toks(1, 2, 3))  # 13 tokens: 4 blocks, 7 | 8 9 10
    assert a.blocks["attn"] == [7, 8, 9, 10]
    s.compute(a)
    s.finish(a)  # 7, 8, 9 cached (published); 10 (partial) freed
    s.mgr.free("filler")  # never committed: freed
    assert s.pool.mapped_bytes == 8 * MiB
    return a


def test_moved_cached_block_is_byte_exact_and_a_hit_returns_the_new_id(kind):
    s = Stack(kind, flat_layout(), budget=16 * MiB, max_tokens=4 * 8 * BS)
    try:
        a = _sparse(s)
        before = s.read("attn", 7)
        assert before == s.expected("attn", a.hashes[0])
        c = s.mgr.compact()
        assert c.moves == {"attn": {7: 10}} and c.released_slots == {"attn": (0,)}
        assert c.bytes_copied == 2 * BS * (1 << 16) and c.bytes_released == 4 * MiB
        assert s.pool.mapped_bytes == 4 * MiB  # slot 0 released at once
        assert s.read("attn", 10) == before
        assert s.prefix.block_of("attn", a.hashes[0]) == 10
        assert s.prefix.hash_of("attn", 7) is None and s.prefix.hash_of("attn", 10) == a.hashes[0]
        assert s.prefix.is_cached("attn", 10) and not s.prefix.is_cached("attn", 7)
        assert s.prefix.lru_order("attn") == [9, 8, 10]  # same order, new id
        hit = s.prefix.lookup(a.hashes, record=False)
        assert hit.blocks["attn"] == (10, 8, 9)
        b = s.start(toks(1, 2, 3, 4))
        assert b.hit == 3 and b.blocks["attn"][:3] == [10, 8, 9]
        assert s.read("attn", b.blocks["attn"][0]) == s.expected("attn", a.hashes[0])
        s.compute(b)
        s.finish(b)
        s.cache.allocator.check_invariants()
        # eviction and reset work on the moved bookkeeping: every page goes
        assert s.prefix.reset() == 4
        assert s.pool.mapped_bytes == 0
        s.cache.allocator.check_invariants()
    finally:
        s.close()


def test_a_pinned_block_does_not_move_the_other_slot_empties_instead(kind):
    s = Stack(kind, flat_layout(), budget=16 * MiB, max_tokens=4 * 8 * BS)
    try:
        a = _sparse(s)
        s.prefix.pin("attn", 7)  # a transfer reads block 7
        c = s.mgr.compact()
        assert 7 not in c.moves["attn"] and sorted(c.moves["attn"]) == [8, 9]
        assert c.released_slots == {"attn": (1,)}
        new8, new9 = c.moves["attn"][8], c.moves["attn"][9]
        assert s.cache.allocator.slot_of("attn", new8) == 0
        assert s.read("attn", new8) == s.expected("attn", a.hashes[1])
        assert s.read("attn", new9) == s.expected("attn", a.hashes[2])
        assert s.prefix.lookup(a.hashes, record=False).blocks["attn"] == (7, new8, new9)
        assert s.prefix.num_evictable("attn") == 2
        s.prefix.unpin("attn", 7)
        assert s.prefix.num_evictable("attn") == 3
        assert s.prefix.reset() == 3 and s.pool.mapped_bytes == 0
    finally:
        s.close()


def test_live_blocks_move_and_the_manager_rewrites_the_table(kind):
    s = Stack(kind, flat_layout(), budget=16 * MiB, max_tokens=4 * 8 * BS)
    try:
        s.mgr.allocate("filler", 7 * BS)
        a = s.start(toks(1, 2, 3))  # live: 7 | 8 9 10
        s.compute(a)
        s.mgr.free("filler")
        table = s.mgr.block_tables(a.rid)["attn"]
        c = s.mgr.compact()
        assert c.moves == {"attn": {7: 11}}
        assert table == [11, 8, 9, 10] and a.blocks["attn"] is table  # rewritten in place
        assert s.cache.allocator.ref_count("attn", 11) == 1
        assert s.cache.allocator.ref_count("attn", 7) == 0
        assert s.read("attn", 11) == s.expected("attn", a.hashes[0])
        assert s.prefix.block_of("attn", a.hashes[0]) == 11
        s.finish(a)
        assert s.prefix.lru_order("attn") == [9, 8, 11]
        assert s.prefix.reset() == 3 and s.pool.mapped_bytes == 0
    finally:
        s.close()
