"""``KVCacheManager.truncate``: shrinking a request's block tables after
rejected speculative tokens — exact block ids released and reused, a held prefix hit left alone,
host-tier restores (pinned blocks) untouched, several groups (target + draft, MLA latent +
index) shrunk together, and the refusals."""

from __future__ import annotations

import pytest

from tests.kvcache.conftest import toy_layout
from tests.kvcache.test_manager import BS, SLOT, Env, toks
from tests.prefix.real import Stack, flat_layout, mla_index_layout
from xllm_vmm.kvcache import KVCacheManagerError, build_kv_cache_manager
from xllm_vmm.pool import BudgetConfig, VmmPool

MiB = 1 << 20


def _state(m, g, b):
    a = m.cache.allocator
    return a.ref_count(g, b), a.is_cached(g, b)


def test_truncate_releases_the_lookahead_tail_and_decode_reuses_it(env):
    e = env(prefix=False)
    m = e.mgr
    prompt = toks(1, 2)  # 9 tokens
    assert m.allocate("a", 9) == {"attn": [0, 1, 2]}
    m.commit("a", 9, prompt)
    table = m.block_tables("a")["attn"]
    # one decode token + 7 speculative: 17 tokens → 5 blocks (4 is in slot 1)
    assert m.allocate("a", 1, lookahead=7) == {"attn": [0, 1, 2, 3, 4]}
    mapped = m.stats()["mapped_bytes"]
    assert mapped == 2 * SLOT
    m.commit("a", 10, prompt + [5])  # one token accepted
    assert m.truncate("a", 10) == 2  # 10 tokens: 3 blocks; 3 and 4 go back
    assert m.block_tables("a")["attn"] is table and table == [0, 1, 2]
    assert _state(m, "attn", 3) == (0, False) and _state(m, "attn", 4) == (0, False)
    assert m.stats()["mapped_bytes"] == SLOT  # slot 1 emptied: released at once
    assert m.capacity().used_blocks["attn"] == 3
    assert m.truncate("a", 10) == 0  # nothing beyond
    assert m.truncate("a", 12) == 0  # 12 tokens fit in 3 blocks
    assert m.allocate("a", 1) == {"attn": [0, 1, 2]}  # 11 tokens: no growth
    assert m.allocate("a", 3) == {"attn": [0, 1, 2, 3]}  # 13: block 3 again (its slot)
    m.check_invariants()
    m.free("a")
    assert m.stats()["live_blocks"] == 0


def test_truncate_refusals_change_nothing(env):
    e = env(prefix=False)
    m = e.mgr
    with pytest.raises(KVCacheManagerError, match="unknown request"):
        m.truncate("zz", 0)
    m.lookup("a", toks(1, 2))
    with pytest.raises(KVCacheManagerError, match="before allocate"):
        m.truncate("a", 0)
    m.allocate("a", 9, lookahead=3)  # 12 tokens: 3 blocks
    m.commit("a", 9, toks(1, 2))
    for bad in (8, 13, -1):
        with pytest.raises(ValueError, match=f"num_tokens={bad}"):
            m.truncate("a", bad)
    assert m.block_tables("a") == {"attn": [0, 1, 2]}
    assert m.truncate("a", 9) == 0  # 9 tokens still need 3 blocks
    m.check_invariants()


def test_truncate_keeps_a_held_hit_and_published_blocks(env):
    """Published blocks (the hit, and the prompt blocks committed) lie below the committed
    count: truncate never touches them. Another request's held hit on the same blocks stays
    held; the released tail is unpublished, so nothing enters the LRU."""
    e = env()
    m = e.mgr
    assert e.run("a", toks(1, 2)) == {"attn": [0, 1, 2]}
    m.free("a")  # 0 and 1 cached; 2 freed
    assert m.prefix.lru_order("attn") == [1, 0]
    other = m.lookup("c", toks(1, 2, 9))  # c holds 0 and 1 too
    assert other.num_device_tokens == 8
    hit = m.lookup("b", toks(1, 2, 3))
    assert hit.num_device_tokens == 8
    # 8 hit + 5 prompt + 3 speculative = 16 tokens: 4 blocks
    assert m.allocate("b", 5, hit=hit, lookahead=3) == {"attn": [0, 1, 2, 3]}
    assert m.num_computed_tokens("b") == 8
    assert m.truncate("b", 8) == 2  # back to the hit: 2 and 3 released
    assert m.block_tables("b") == {"attn": [0, 1]}
    assert _state(m, "attn", 0) == (2, False) and _state(m, "attn", 1) == (2, False)
    assert _state(m, "attn", 2) == (0, False) and _state(m, "attn", 3) == (0, False)
    assert m.prefix.lru_order("attn") == []
    assert m.allocate("b", 5, lookahead=7) == {"attn": [0, 1, 2, 3, 4]}  # 20 tokens
    prompt = toks(1, 2, 3)
    m.commit("b", 13, prompt)  # block 2 published
    assert m.truncate("b", 13) == 1  # 4 goes; 3 (half full) stays
    assert m.block_tables("b") == {"attn": [0, 1, 2, 3]}
    with pytest.raises(ValueError, match="num_tokens=12"):
        m.truncate("b", 12)  # below the committed count
    assert m.allocate("c", 5, hit=other) == {"attn": [0, 1, 4, 5]}  # c's hit still held
    m.free("b")
    assert m.prefix.lru_order("attn") == [2]  # b's published block 2 cached; 3 freed
    assert m.lookup("d", toks(1, 2, 3)).num_device_tokens == 12
    m.drop("d")
    m.check_invariants()


def test_truncate_beside_a_host_restore_in_flight_keeps_its_pins():
    """A host hit's restore pins the blocks it writes; truncating the request's lookahead tail
    while the copy is queued releases only the tail; the restore then completes into the kept
    blocks. A failed restore drops the committed count back to the device hit, and truncate
    can then give the restore's blocks back (the copy ended: no pin left)."""
    s = Stack("host", flat_layout(), budget=16 * MiB, max_tokens=4 * 8 * BS, host_factor=4.0,
              step_copies=True)
    try:
        m, g = s.mgr, "attn"
        a = s.start(toks(1, 2, tail=0))  # blocks 0, 1
        s.compute(a)
        s.finish(a)  # cached; write-through queued
        s.copies.complete(1)
        m.step()
        s.prefix.evict(g, 2)  # only the host has them now
        assert s.host.stats.offloaded_blocks == 2
        for rid, fail in (("b", False), ("c", True)):
            hit = m.lookup(rid, toks(1, 2, 3))
            assert (hit.num_device_tokens, hit.num_host_tokens) == (0, 8)
            t = m.allocate(rid, 5, hit=hit, lookahead=7)  # 20 tokens: 5 blocks
            assert t == {g: [0, 1, 2, 3, 4]}
            assert [s.prefix.pin_count(g, b) for b in t[g]] == [1, 1, 0, 0, 0]
            assert not m.ready(rid)
            assert m.truncate(rid, 8) == 3  # 2, 3, 4 released; 0, 1 (restoring) kept
            assert t == {g: [0, 1]}
            assert [_state(m, g, b) for b in (2, 3, 4)] == [(0, False)] * 3
            assert [s.prefix.pin_count(g, b) for b in (0, 1)] == [1, 1]
            s.copies.complete(1, fail_first=fail)
            while not m.ready(rid):
                m.step()
            assert [s.prefix.pin_count(g, b) for b in (0, 1)] == [0, 0]
            if not fail:
                assert m.num_computed_tokens(rid) == 8
                assert [s.read(g, b) for b in t[g]] == [
                    s.expected(g, h) for h in a.hashes[:2]]
                with pytest.raises(ValueError, match="num_tokens=4"):
                    m.truncate(rid, 4)
                m.free(rid)
                m.step()
                s.prefix.evict(g, 2)  # the host copy is the only one again
            else:
                assert m.num_computed_tokens(rid) == 0  # compute from scratch
                assert m.truncate(rid, 0) == 2
                assert t == {g: []}
                assert [_state(m, g, b) for b in (0, 1)] == [(0, False)] * 2
                assert m.allocate(rid, 9) == {g: [0, 1, 2]}
                m.free(rid)
        m.check_invariants()
        s.host.wait_all()
        m.reset_prefix_cache()
        assert s.pool.mapped_bytes == 0
    finally:
        s.close()


def test_truncate_target_and_draft_together():
    """SD-01: both groups shrink to the same length; the draft's own ids (2 blocks per slot)
    go back with the target's, and the emptied slots are released."""
    from xllm_vmm.vmm.sim import SimDriver

    d = SimDriver(256 * MiB)
    layout = toy_layout(layers=1, blocks_per_page=4, block_size=BS, draft_blocks_per_page=2)
    pool = VmmPool(d, BudgetConfig(max_cache_size=8 * SLOT, execution_peak_bytes=0), 64 * SLOT)
    m = build_kv_cache_manager(pool, layout, enable_prefix_cache=True, max_tokens=16 * BS,
                               compact=False)
    try:
        prompt = toks(1, 2)
        hit = m.lookup("a", prompt)
        assert m.allocate("a", 9, hit=hit) == {"attn": [0, 1, 2], "draft": [0, 1, 2]}
        m.commit("a", 9, prompt)
        before = pool.mapped_bytes
        t = m.allocate("a", 1, lookahead=10)  # 20 tokens: 5 blocks
        assert t == {"attn": [0, 1, 2, 3, 4], "draft": [0, 1, 2, 3, 4]}
        m.commit("a", 10, prompt + [5])
        assert m.truncate("a", 10) == 2
        assert t == {"attn": [0, 1, 2], "draft": [0, 1, 2]}
        for gname in ("attn", "draft"):
            assert [_state(m, gname, b) for b in (3, 4)] == [(0, False)] * 2
        assert pool.mapped_bytes == before  # attn slot 1 and draft slot 2 released
        assert m.allocate("a", 3) == {"attn": [0, 1, 2, 3], "draft": [0, 1, 2, 3]}
        m.check_invariants()
        m.free("a")
        assert m.prefix.lru_order("attn") == [1, 0] and m.prefix.lru_order("draft") == [1, 0]
    finally:
        m.close()
        pool.close()
        d.close()


def test_truncate_mla_latent_and_index_groups():
    """MLA latent (8 blocks per page) and its index keys (16 per page): one table length."""
    s = Stack("host", mla_index_layout(), budget=32 * MiB, max_tokens=4 * 16 * BS)
    try:
        m = s.mgr
        prompt = toks(1, 2, 3, 4, 5, 6, 7)  # 29 tokens: 8 blocks
        t = m.allocate("a", 29, lookahead=8)  # 37 tokens: 10 blocks
        assert t == {"mla": list(range(10)), "index": list(range(10))}
        m.commit("a", 29, prompt)
        assert m.truncate("a", 30) == 2
        assert t == {"mla": list(range(8)), "index": list(range(8))}
        for gname in ("mla", "index"):
            assert [_state(m, gname, b) for b in (8, 9)] == [(0, False)] * 2
        assert s.cache.allocator.num_active_slots("mla") == 1  # slot 1 of mla released
        assert s.cache.allocator.num_free_blocks("index") == 8
        m.check_invariants()
        m.free("a")
    finally:
        s.close()
