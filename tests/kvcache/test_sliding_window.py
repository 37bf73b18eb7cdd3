"""Sliding-window groups through the manager: the blocks wholly outside the window of the next
query go back as the request advances (vLLM v1's ``SlidingWindowManager``), their table entries
become ``NULL_BLOCK``, decode growth reuses them, published ones stay cached and findable.
Exact block ids. A full-attention group ``attn`` beside a ``sliding`` group (window 8 tokens =
2 blocks of 4), 4 blocks per page in both."""

from __future__ import annotations

import pytest

from tests.kvcache.conftest import PAGE
from xllm_vmm.kvcache import NULL_BLOCK as N
from xllm_vmm.kvcache import build_kv_cache_manager
from xllm_vmm.models.spec import CacheGroup, CacheLayout, CacheTensor
from xllm_vmm.pool import BudgetConfig, VmmPool
from xllm_vmm.vmm.sim import SimDriver

MiB = 1 << 20
BS = 4
W = 8
SLOT = 2 * PAGE


def sliding_layout(window: int = W, full: bool = True) -> CacheLayout:
    tpb = PAGE // 4 // BS  # 4 blocks per page
    kv = lambda p: (CacheTensor(f"{p}.k", tpb), CacheTensor(f"{p}.v", tpb))  # noqa: E731
    groups = [CacheGroup("attn", kv("l0"), BS)] if full else []
    groups.append(CacheGroup("sliding", kv("l1"), BS, max_tokens_per_seq=window))
    return CacheLayout("toy-sliding", 1, tuple(groups))


@pytest.fixture
def make():
    made = []

    def build(prefix: bool = False, **kw):
        d = SimDriver(256 * MiB)
        pool = VmmPool(d, BudgetConfig(max_cache_size=16 * SLOT, execution_peak_bytes=0),
                       64 * SLOT)
        m = build_kv_cache_manager(pool, sliding_layout(**kw), enable_prefix_cache=prefix,
                                   max_tokens=16 * BS, compact=False)
        made.append((m, pool, d))
        return m

    yield build
    for m, pool, d in made:
        m.close()
        pool.close()
        d.close()


def _ref(m, g, b):
    return m.cache.allocator.ref_count(g, b), m.cache.allocator.is_cached(g, b)


def test_blocks_outside_the_window_go_back_and_decode_reuses_them(make):
    m = make()
    p = list(range(9))
    assert m.allocate("a", 9) == {"attn": [0, 1, 2], "sliding": [0, 1, 2]}
    m.commit("a", 9, p)  # next query at 9 sees 2..9: block 0 still needed
    assert m.allocate("a", 1) == {"attn": [0, 1, 2], "sliding": [0, 1, 2]}
    m.commit("a", 12, p + [9, 10, 11])  # next query at 12 sees 5..12: block 0 (0..3) is out
    t = m.allocate("a", 1)  # 13 tokens: trimmed first, then one block each — sliding reuses 0
    assert t == {"attn": [0, 1, 2, 3], "sliding": [N, 1, 2, 0]}
    assert _ref(m, "sliding", 0) == (1, False)
    m.commit("a", 14, list(range(14)))  # the query at 14 sees 7..14: block 1 (4..7) needed
    assert m.allocate("a", 1) == {"attn": [0, 1, 2, 3], "sliding": [N, 1, 2, 0]}
    m.commit("a", 15, list(range(15)))  # the query at 15 sees 8..15: block 1 out
    m.allocate("a", 1)  # 16 tokens: no growth, the trim still runs
    assert t == {"attn": [0, 1, 2, 3], "sliding": [N, N, 2, 0]}
    assert _ref(m, "sliding", 1) == (0, False)
    assert m.capacity().used_blocks == {"attn": 4, "sliding": 2}
    m.check_invariants()
    assert m.truncate("a", 15) == 0
    m.free("a")  # the null entries hold nothing
    assert m.stats()["live_blocks"] == 0
    m.check_invariants()


def test_window_not_on_a_block_boundary_and_a_sliding_only_model(make):
    """Window 6: the query at N sees N-5..N; block i goes once (i+1)*4 <= N-5."""
    m = make(window=6, full=False)
    assert m.group_names == ("sliding",)
    toks = list(range(20))
    m.allocate("a", 9)
    m.commit("a", 9, toks)  # (9 - 5) // 4 = 1: block 0 out at the next allocate
    assert m.allocate("a", 0) == {"sliding": [N, 1, 2]}
    m.commit("a", 12, toks)  # (12 - 5) // 4 = 1
    assert m.allocate("a", 1) == {"sliding": [N, 1, 2, 0]}
    m.commit("a", 13, toks)  # (13 - 5) // 4 = 2
    assert m.allocate("a", 1) == {"sliding": [N, N, 2, 0]}
    assert m.capacity().used_blocks == {"sliding": 2}
    m.check_invariants()


def test_published_blocks_leave_the_window_cached_and_findable(make):
    """With prefix caching a trimmed block that holds a published prefix becomes cached (in
    the LRU, findable); a long hit's blocks outside the window go back at admission."""
    m = make(prefix=True)
    p = list(range(17))  # 4 complete blocks
    hit = m.lookup("a", p)
    assert m.allocate("a", 17, hit=hit) == {"attn": [0, 1, 2, 3, 4], "sliding": [0, 1, 2, 3, 4]}
    m.commit("a", 17, p)  # 0..3 published; next query at 17 sees 10..17: 0 and 1 out
    t = m.allocate("a", 1)
    assert t == {"attn": [0, 1, 2, 3, 4], "sliding": [N, N, 2, 3, 4]}
    assert _ref(m, "sliding", 0) == (0, True) and _ref(m, "sliding", 1) == (0, True)
    assert m.prefix.lru_order("sliding") == [1, 0]
    hit = m.lookup("b", p)  # both groups still hold every block of the prefix
    assert hit.num_device_tokens == 16
    t = m.allocate("b", 1, hit=hit)  # computed 16: the query at 16 sees 9..16 — 0, 1 out
    assert t == {"attn": [0, 1, 2, 3, 5], "sliding": [N, N, 2, 3, 5]}
    assert m.prefix.lru_order("sliding") == [1, 0]  # revived by the hit, given back again
    m.check_invariants()
    m.free("a")
    m.free("b")
    assert m.prefix.lru_order("sliding") == [1, 0, 3, 2]
    m.check_invariants()


def test_evicting_a_trimmed_block_withdraws_its_hash_from_both_groups(make):
    """A trimmed, cached sliding block may be evicted; its hash leaves both groups (the
    full-attention peer, still referenced, is no longer retained)."""
    m = make(prefix=True)
    p = list(range(17))
    m.lookup("a", p)
    m.allocate("a", 17)
    m.commit("a", 17, p)
    m.allocate("a", 1)  # sliding 0 and 1 cached
    assert m.prefix.evict("sliding", 1) == [1]  # least recently released (slot 0 is live)
    a = m.cache.allocator
    assert _ref(m, "sliding", 1) == (0, False)
    assert a.ref_count("attn", 1) == 1 and not a.is_retained("attn", 1)  # peer withdrawn
    assert m.lookup("b", p).num_device_tokens == 4  # the chain stops at block 1 in both
    m.drop("b")
    m.free("a")
    m.check_invariants()
