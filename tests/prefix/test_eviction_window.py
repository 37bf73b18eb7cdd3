"""Exact eviction order under the exact-LRU shortfall rule and the page-aware window
(:meth:`PrefixCache.evict_pages`), on tiny caches, over both block-state backends; and a
property test: a page-aware eviction never gives up a block that exact LRU, freeing the same
pages, keeps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xllm_vmm.kvcache.prefix as prefix_mod
from tests._hyp import examples
from xllm_vmm.kvcache.allocator import BlockAllocator, GroupShape
from xllm_vmm.kvcache.kvtable import native_available
from xllm_vmm.kvcache.prefix import PrefixCache

BACKENDS = [False, True] if native_available() else [False]


class Backing:
    """Maps every slot asked for; records releases."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def activate(self, slots) -> bool:
        return True

    def deactivate(self, slots) -> None:
        for ss in slots.values():
            self.released.extend(ss)


def cache(native: bool, slots: int, bps: int):
    """Every block of the group allocated one at a time (block i in slot i // bps) and
    published under hash 1000 + i; nothing released yet."""
    back = Backing()
    a = BlockAllocator([GroupShape("attn", slots, bps)], back, native=native)
    p = PrefixCache(a, {"attn": 32}, 4)
    blocks = [a.allocate({"attn": 1})["attn"][0] for _ in range(slots * bps)]
    assert blocks == list(range(slots * bps))
    p.publish({"attn": blocks}, [1000 + b for b in blocks])
    return a, p, back


def release(p: PrefixCache, order) -> None:
    for b in order:
        p.release({"attn": [b]})


def check(a: BlockAllocator, p: PrefixCache) -> None:
    a.check_invariants()
    g = a._groups["attn"]
    want = [b for b in p.lru_order("attn")]
    assert all(g.cached[b] and p.hash_of("attn", b) is not None for b in want)
    assert sorted(want) == sorted(b for b in range(g.nblocks)
                                  if g.cached[b] and not g.pins.get(b)
                                  and p.hash_of("attn", b) is not None)


@pytest.mark.parametrize("native", BACKENDS)
def test_exact_lru_takes_the_oldest_blocks_in_release_order(native):
    a, p, back = cache(native, slots=2, bps=4)
    release(p, [0, 4, 5, 6, 7, 1, 2, 3])
    assert p.evict("attn", 3, prefer_slot_emptying=False) == [0, 4, 5]
    assert p.lru_order("attn") == [6, 7, 1, 2, 3]
    assert back.released == []  # no slot emptied: 6, 7 and 1..3 stay hits
    check(a, p)


@pytest.mark.parametrize("native", BACKENDS)
def test_evict_pages_takes_the_slot_exact_lru_empties_first(native):
    a, p, back = cache(native, slots=2, bps=4)
    release(p, [0, 4, 5, 6, 7, 1, 2, 3])
    # exact LRU, freeing one page, evicts 0, 4, 5, 6, 7 (slot 1 empties at block 7): the
    # window's page-aware choice is slot 1 alone, block 0 stays
    assert p.evict_pages("attn", 4) == [4, 5, 6, 7]
    assert back.released == [1]
    assert p.lru_order("attn") == [0, 1, 2, 3]
    assert p.stats.evicted_slots_emptied == 1
    check(a, p)


@pytest.mark.parametrize("native", BACKENDS)
def test_pages_first_evict_takes_the_slot_of_the_oldest_block(native):
    """The older pages-first rule (prefer_slot_emptying=True) gives up slot 0 whole, blocks
    1..3 included, which exact LRU keeps longer than slot 1's: what evict_pages avoids."""
    a, p, back = cache(native, slots=2, bps=4)
    release(p, [0, 4, 5, 6, 7, 1, 2, 3])
    assert p.evict("attn", 4, prefer_slot_emptying=True) == [0, 1, 2, 3]
    assert back.released == [0]
    check(a, p)


@pytest.mark.parametrize("native", BACKENDS)
def test_evict_pages_skips_a_slot_with_a_live_block_and_fills_from_lru(native):
    a, p, back = cache(native, slots=3, bps=2)
    release(p, [0, 2, 4, 5, 3])  # block 1 stays live: slot 0 never completes
    # slot 2 (4, 5) completes at the third entry, slot 1 (2, 3) at the fifth
    assert p.evict_pages("attn", 3) == [4, 5, 2, 3]
    assert back.released == [2, 1]
    assert p.lru_order("attn") == [0]
    assert p.evict_pages("attn", 2) == [0]  # nothing completes: plain LRU
    assert back.released == [2, 1]
    check(a, p)


@pytest.mark.parametrize("native", BACKENDS)
def test_evict_pages_looks_no_further_than_the_window(native, monkeypatch):
    monkeypatch.setattr(prefix_mod, "WINDOW_FACTOR", 1)
    a, p, back = cache(native, slots=3, bps=2)
    release(p, [0, 2, 4, 1, 5, 3])
    # window = 1 × (1 + 2) = 3 oldest: 0, 2, 4 -- no slot completes inside it: plain LRU
    assert p.evict_pages("attn", 1) == [0]
    assert back.released == []
    # window now 2, 4, 1, 5 ... = 3 oldest: 2, 4, 1 -- slot 0 (only block 1 left) completes
    assert p.evict_pages("attn", 1) == [1]
    assert back.released == [0]
    check(a, p)


@st.composite
def scenarios(draw):
    bps = draw(st.integers(1, 4))
    slots = draw(st.integers(1, 4))
    n = slots * bps
    order = draw(st.permutations(list(range(n))))
    k = draw(st.integers(0, n))  # blocks released (the rest stay live)
    want = draw(st.integers(1, n + 1))
    native = draw(st.sampled_from(BACKENDS))
    factor = draw(st.sampled_from([1, 2, 8]))
    return bps, slots, order[:k], want, native, factor


@settings(max_examples=examples(150), deadline=None)
@given(scenarios())
def test_evict_pages_never_gives_up_what_exact_lru_keeps_for_the_same_pages(sc):
    bps, slots, released, want, native, factor = sc
    old = prefix_mod.WINDOW_FACTOR
    prefix_mod.WINDOW_FACTOR = factor
    try:
        a, p, back = cache(native, slots, bps)
        release(p, released)
        lru = p.lru_order("attn")
        pos = {b: i for i, b in enumerate(lru)}
        live_slots = {b // bps for b in range(slots * bps) if b not in pos}
        chosen = p.evict_pages("attn", want)
        check(a, p)
        # the rule, restated: slots complete in an oldest-first walk of the window, whole;
        # then the oldest blocks not taken
        window = factor * (want + bps)
        seen: dict[int, list[int]] = {}
        whole: list[int] = []
        for b in lru[:window]:
            seen.setdefault(b // bps, []).append(b)
            if len(seen[b // bps]) == bps and len(whole) < want:
                whole += seen[b // bps]
        fill = [b for b in lru if b not in set(whole)][:max(0, want - len(whole))]
        assert chosen == whole + fill
        assert not set(back.released) & live_slots
        assert {b // bps for b in whole} <= set(back.released)
        if whole:
            # exact LRU, walking oldest first until the same pages are empty, reaches the
            # newest block of them: it gives up every block taken whole (and more)
            reach = max(pos[b] for b in whole)
            assert set(whole) <= set(lru[:reach + 1]) and reach < window
        assert p.lru_order("attn") == [b for b in lru if b not in set(chosen)]
    finally:
        prefix_mod.WINDOW_FACTOR = old
