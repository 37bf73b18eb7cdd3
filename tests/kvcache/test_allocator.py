"""BlockAllocator on a fake slot backing: exact block ids, slots, packing, release, the
retained and pinned blocks, eviction only before a retried allocation (the prefix cache's
stand-in does it), all-or-nothing across groups."""

from __future__ import annotations

import pytest

from tests.kvcache.conftest import FakeBacking, KeepAll, make
from xllm_vmm.kvcache import BlockAllocator, BlockInfo, SlotInfo



def test_fresh_slots_give_lowest_ids_and_fill_one_slot_before_the_next(backing):
    a = make(backing)
    assert a.allocate({"attn": 3}) == {"attn": [0, 1, 2]}
    assert a.allocate({"attn": 2}) == {"attn": [3, 4]}
    assert backing.calls == [("activate", {"attn": [0]}), ("activate", {"attn": [1]})]
    assert a.active_slots("attn") == [0, 1]
    assert a.slot_info("attn", 1) == SlotInfo("attn", 1, True, live=1, cached=0, free=3)
    a.check_invariants()


def test_new_block_goes_to_the_fullest_partial_slot(backing):
    a = make(backing)
    a.allocate({"attn": 8})  # slots 0 and 1 full
    a.free({"attn": [0, 1, 2]})  # slot 0: one live block (3 free)
    a.free({"attn": [4]})  # slot 1: three live blocks (1 free)
    assert a.allocate({"attn": 1}) == {"attn": [4]}  # fullest: slot 1
    # slot 1 is full again: next comes from slot 0, most recently freed first
    assert a.allocate({"attn": 2}) == {"attn": [2, 1]}
    a.check_invariants()


def test_decode_growth_packs_into_few_slots(backing):
    a = make(backing, slots=8, bps=4)
    seqs = [a.allocate({"attn": 1})["attn"] for _ in range(6)]
    assert seqs == [[0], [1], [2], [3], [4], [5]]
    for s in (seqs[0], seqs[2], seqs[4]):  # three sequences finish
        a.free({"attn": s})
    # slot 0 holds blocks 1 and 3 (2 free), slot 1 holds block 5 (3 free): growth fills slot 0
    assert [a.allocate({"attn": 1})["attn"][0] for _ in range(3)] == [2, 0, 4]
    assert a.num_active_slots("attn") == 2


def test_emptied_slot_is_released_at_once_in_one_call(backing):
    a = make(backing)
    x = a.allocate({"attn": 6})["attn"]  # slots 0, 1
    backing.calls.clear()
    a.free({"attn": x})
    assert backing.calls == [("deactivate", {"attn": [0, 1]})]
    assert a.active_slots("attn") == [] and backing.active == set()
    assert a.num_free_blocks("attn") == 0
    # the next allocation starts again from the lowest slot
    assert a.allocate({"attn": 1}) == {"attn": [0]}


def test_several_new_slots_are_activated_in_one_call(backing):
    a = make(backing, slots=4, bps=4)
    assert a.allocate({"attn": 10})["attn"] == list(range(10))
    assert backing.calls == [("activate", {"attn": [0, 1, 2]})]


def test_groups_are_allocated_together_or_not_at_all(backing):
    b = FakeBacking(budget_slots=2)
    a = make(b, slots=4, bps=4, draft=(4, 8))
    assert a.allocate({"attn": 3, "draft": 3}) == {"attn": [0, 1, 2], "draft": [0, 1, 2]}
    assert b.calls[-1] == ("activate", {"attn": [0], "draft": [0]})
    # attn needs a new slot, draft fits: the budget (2 slots) refuses, nothing changes
    assert a.allocate({"attn": 2, "draft": 2}) is None
    assert a.num_free_blocks("attn") == 1 and a.num_free_blocks("draft") == 5
    assert a.num_live_blocks("attn") == 3 and a.num_live_blocks("draft") == 3
    a.check_invariants()
    # released together: both slots go in one call
    a.free({"attn": [0, 1, 2], "draft": [0, 1, 2]})
    assert b.calls[-1] == ("deactivate", {"attn": [0], "draft": [0]})


def test_virtual_range_exhausted_is_not_now(backing):
    a = make(backing, slots=2, bps=4)
    assert a.allocate({"attn": 9}) is None
    assert backing.calls == []
    assert a.allocate({"attn": 8})["attn"] == list(range(8))


def test_double_free_is_refused_and_changes_nothing(backing):
    a = make(backing)
    x = a.allocate({"attn": 2})["attn"]
    a.free({"attn": [x[0]]})
    with pytest.raises(ValueError, match=r"block 0 in group 'attn'.*double free"):
        a.free({"attn": [x[1], x[0]]})
    assert a.ref_count("attn", 1) == 1
    with pytest.raises(ValueError, match=r"block 1 in group 'attn': 2 frees, 1 references"):
        a.free({"attn": [1, 1]})
    a.check_invariants()


def test_unknown_group_names_the_groups(backing):
    a = make(backing, draft=(2, 2))
    with pytest.raises(KeyError, match="unknown cache group 'mla'; groups: attn, draft"):
        a.allocate({"mla": 1})


def test_touch_adds_references_and_refuses_free_blocks(backing):
    a = make(backing)
    (b,) = a.allocate({"attn": 1})["attn"]
    a.touch("attn", b)
    assert a.block_info("attn", b) == BlockInfo("attn", 0, 0, ref_count=2, cached=False)
    a.free({"attn": [b]})
    assert a.ref_count("attn", b) == 1
    a.free({"attn": [b]})
    with pytest.raises(ValueError, match="touch of free block 0 in group 'attn'"):
        a.touch("attn", b)


# -- retained and pinned blocks; eviction before a retried allocation ----------------------

def test_retained_blocks_become_cached_at_zero_and_stay_mapped(backing):
    a = make(backing)
    x = a.allocate({"attn": 3})["attn"]
    a.retain("attn", x)
    assert a.free({"attn": x}) == {"attn": [0, 1, 2]}  # what became cached, in order
    assert [a.is_cached("attn", b) for b in x] == [True, True, True]
    assert a.slot_info("attn", 0) == SlotInfo("attn", 0, True, live=0, cached=3, free=1)
    assert backing.active == {("attn", 0)}
    # a new allocation takes the free block first, not the cached ones
    assert a.allocate({"attn": 1}) == {"attn": [3]}
    a.check_invariants()


def test_touch_revives_a_cached_block(backing):
    a = make(backing)
    x = a.allocate({"attn": 2})["attn"]
    a.retain("attn", x)
    a.free({"attn": x})
    assert a.touch("attn", 1) is True  # revived (the prefix cache drops it from its LRU)
    assert a.touch("attn", 1) is False  # live: one more reference
    assert a.block_info("attn", 1) == BlockInfo("attn", 1, 0, ref_count=2, cached=False,
                                                retained=True)
    assert a.num_cached_blocks("attn") == 1 and a.num_live_blocks("attn") == 1
    a.check_invariants()


def test_unretained_blocks_are_freed_and_the_slot_released(backing):
    a = make(backing)
    x = a.allocate({"attn": 2})["attn"]
    assert a.free({"attn": x}) == {}
    assert a.active_slots("attn") == [] and backing.calls[-1] == ("deactivate", {"attn": [0]})
    y = a.allocate({"attn": 2})["attn"]
    a.retain("attn", y)
    a.free({"attn": y})
    assert a.unretain("attn", y) == 2  # cached, unpinned: freed now
    assert a.active_slots("attn") == []
    a.check_invariants()


def test_a_pinned_block_stays_until_unpinned_then_goes_unless_retained(backing):
    a = make(backing)
    x = a.allocate({"attn": 2})["attn"]
    a.pin("attn", 0)
    a.pin("attn", 1)
    a.retain("attn", [1])
    assert a.free({"attn": x}) == {"attn": [0, 1]}  # both kept: 0 pinned, 1 retained+pinned
    with pytest.raises(ValueError, match="block 0 in group 'attn' is pinned by a transfer"):
        a.release_cached("attn", [0])
    assert a.compact().blocks_moved == 0  # pinned blocks never move
    assert a.unpin("attn", 0) is True  # neither pinned nor retained any more: freed
    assert a.unpin("attn", 1) is False and a.is_cached("attn", 1)  # still retained
    with pytest.raises(ValueError, match="unpin of block 1 in group 'attn', which is not"):
        a.unpin("attn", 1)
    with pytest.raises(ValueError, match="pin of free block 0"):
        a.pin("attn", 0)
    a.check_invariants()


def test_allocation_never_evicts_it_says_not_now_and_changes_nothing():
    b = FakeBacking(budget_slots=1)
    p = KeepAll()
    a = make(b, slots=4, bps=4, policy=p)
    x = p.allocate({"attn": 4})["attn"]
    p.free({"attn": x[:3]})  # 0, 1, 2 cached; 3 live
    assert a.allocate({"attn": 2}) is None  # the allocator alone: no eviction
    assert [a.is_cached("attn", y) for y in x[:3]] == [True] * 3 and p.calls == []
    a.check_invariants()


def test_shortage_evicts_the_lru_shortfall_then_retries():
    b = FakeBacking(budget_slots=2)
    p = KeepAll()
    a = make(b, slots=4, bps=4, policy=p)
    s0 = p.allocate({"attn": 4})["attn"]  # slot 0
    s1 = p.allocate({"attn": 4})["attn"]  # slot 1
    p.free({"attn": s1})  # slot 1: all cached, first in LRU
    p.free({"attn": s0[:2]})  # slot 0: two cached, two live
    # 3 blocks: no free block, budget full -> evict(attn, 3) by exact LRU: three of slot 1's
    # blocks, reused in place (slot 1 stays mapped, its fourth block cached)
    got = p.allocate({"attn": 3})
    assert p.calls[0] == ("evict", "attn", 3, False)
    assert got == {"attn": [6, 5, 4]}  # the most recently freed block first
    assert list(p.lru) == [("attn", 7), ("attn", 0), ("attn", 1)]
    assert a.is_cached("attn", 7) and b.active == {("attn", 0), ("attn", 1)}
    assert [a.is_cached("attn", x) for x in (0, 1)] == [True, True]
    a.check_invariants()


def test_eviction_of_blocks_in_a_live_slot_frees_positions_there():
    b = FakeBacking(budget_slots=1)
    p = KeepAll()
    a = make(b, slots=4, bps=4, policy=p)
    x = p.allocate({"attn": 4})["attn"]
    p.free({"attn": x[:3]})  # 0, 1, 2 cached; 3 live
    assert p.allocate({"attn": 2}) == {"attn": [1, 0]}  # LRU 0, 1 evicted, reused LIFO
    assert a.is_cached("attn", 2)
    a.check_invariants()


def test_still_short_after_eviction_is_none_and_keeps_live_blocks():
    b = FakeBacking(budget_slots=1)
    p = KeepAll()
    a = make(b, slots=4, bps=4, policy=p)
    x = p.allocate({"attn": 4})["attn"]
    p.free({"attn": [x[0]]})
    assert p.allocate({"attn": 4}) is None  # only one evictable block
    assert [a.ref_count("attn", y) for y in x[1:]] == [1, 1, 1]
    a.check_invariants()


def test_other_groups_give_up_slots_when_the_short_group_has_nothing():
    b = FakeBacking(budget_slots=2)
    p = KeepAll()
    a = make(b, slots=4, bps=4, draft=(4, 4), policy=p)
    d = p.allocate({"draft": 4})["draft"]
    a.allocate({"attn": 4})
    p.free({"draft": d})  # the draft slot is all cached
    assert p.allocate({"attn": 1}) == {"attn": [4]}
    assert ("evict", "draft", 4, True) in p.calls
    assert a.active_slots("draft") == []
    a.check_invariants()


def test_release_cached_refuses_live_blocks(backing):
    a = make(backing)
    x = a.allocate({"attn": 2})["attn"]
    a.retain("attn", x)
    a.free({"attn": [x[0]]})
    with pytest.raises(ValueError, match="block 1 in group 'attn' is live, not cached"):
        a.release_cached("attn", [0, 1])
    assert a.is_cached("attn", 0)
    a.release_cached("attn", [0])
    assert a.slot_info("attn", 0).free == 3 and not a.is_retained("attn", 0)


def test_near_keeps_a_sequences_blocks_in_its_own_slot(backing):
    a = make(backing, slots=4, bps=4)
    a.allocate({"attn": 5})  # slot 0 full, slot 1: block 4
    a.free({"attn": [0]})  # slot 0 now has one free block (the fullest partial slot)
    # without a hint the fullest partial slot (0) gets it; with one, the sequence's slot (1)
    assert a.allocate({"attn": 1}, near={"attn": 4}) == {"attn": [5]}
    assert a.allocate({"attn": 1}) == {"attn": [0]}
    a.check_invariants()


def test_decode_growth_out_of_a_full_slot_goes_to_the_roomiest_partial_slot(backing):
    a = make(backing, slots=4, bps=4)
    seq = a.allocate({"attn": 4})["attn"]  # slot 0, full: the sequence's last block is 3
    other = a.allocate({"attn": 8})["attn"]  # slots 1 and 2, full
    a.free({"attn": other[:3]})  # slot 1: 3 free (blocks 4-6), one live
    a.free({"attn": [other[4]]})  # slot 2: 1 free (block 8), three live
    # near slot 0 is full: the roomiest partial slot (1) takes the block, most recently
    # freed first, not the one-block hole in slot 2; the next block follows it there
    assert a.allocate({"attn": 1}, {"attn": seq[-1]})["attn"] == [6]
    assert a.allocate({"attn": 1}, {"attn": 6})["attn"] == [5]
    # without a hint: the fullest partial slot (slots 1 and 2 have one free block each;
    # slot 2 got there first)
    assert a.allocate({"attn": 1})["attn"] == [8]
    assert a.num_active_slots("attn") == 3
    a.check_invariants()


def test_decode_growth_of_two_groups_places_each_in_its_roomiest_partial_slot(backing):
    a = make(backing, slots=4, bps=4, draft=(4, 4))
    seq = a.allocate({"attn": 4, "draft": 4})  # slot 0 of each, full
    other = a.allocate({"attn": 8, "draft": 8})  # slots 1 and 2 of each, full
    a.free({"attn": other["attn"][:3], "draft": other["draft"][:3]})  # slot 1: 3 free
    a.free({"attn": [8], "draft": [8]})  # slot 2: one free
    assert a.allocate({"attn": 1, "draft": 1}, {"attn": 3, "draft": 3}) == \
        {"attn": [6], "draft": [6]}
    assert seq == {"attn": [0, 1, 2, 3], "draft": [0, 1, 2, 3]}
    a.check_invariants()


def _snapshot(a, group="attn"):
    g = a.state(group)
    return (list(g.ref), [None if s is None else list(s) for s in g.stacks],
            [list(b) for b in g.buckets], sorted(g.inactive), g.free_active, g.n_active)


def test_a_double_free_late_in_the_list_is_refused_before_anything_changes(backing):
    a = make(backing, slots=4, bps=4)
    x = a.allocate({"attn": 10})["attn"]  # slots 0, 1 full, slot 2: 8, 9
    a.free({"attn": [1, 5]})  # slots 0 and 1 in bucket 1 (slot 0 first)
    before = _snapshot(a)
    calls = list(backing.calls)
    bad = [0, 2, 3, 4, 6, 7, 8, 9, 5]  # empties slots 0 and 2 ... then 5 is already free
    with pytest.raises(ValueError, match=r"free of block 5 in group 'attn' that holds no "
                                         r"reference \(double free\)"):
        a.free({"attn": bad})
    assert _snapshot(a) == before and backing.calls == calls
    # nothing moved: the fullest partial slot taken first is still slot 0, then slot 1
    assert a.allocate({"attn": 2})["attn"] == [1, 5]
    a.check_invariants()
    assert x == list(range(10))


def test_free_of_shared_blocks_frees_each_when_its_last_reference_goes(backing):
    a = make(backing, slots=4, bps=4)
    a.allocate({"attn": 4})
    a.touch("attn", 1)  # block 1: two references
    a.free({"attn": (1, 0, 1)})  # a tuple; block 1 reaches 0 at its second entry
    assert [a.ref_count("attn", b) for b in range(4)] == [0, 0, 1, 1]
    assert a.slot_info("attn", 0).free == 2
    # most recently freed first: block 1 (freed after block 0)
    assert a.allocate({"attn": 2})["attn"] == [1, 0]
    with pytest.raises(ValueError, match=r"block 2 in group 'attn': 2 frees, 1 references"):
        a.free({"attn": [2, 2]})
    a.free({"attn": range(2, 4)})  # any sequence of ints
    assert [a.ref_count("attn", b) for b in range(4)] == [1, 1, 0, 0]
    a.check_invariants()


def test_a_near_hint_outside_the_group_is_no_hint(backing):
    a = make(backing, slots=4, bps=4, draft=(4, 4))
    a.allocate({"attn": 12, "draft": 12})  # slots 0-2 full
    a.free({"attn": [0, 1, 2], "draft": [0, 1, 2]})  # slot 0: 3 free
    a.free({"attn": [4], "draft": [4]})  # slot 1: 1 free (the fullest partial slot)
    assert a.allocate({"attn": 1}, {"attn": 99})["attn"] == [4]
    assert a.allocate({"attn": 1, "draft": 1}, {"attn": 99, "draft": 99}) == \
        {"attn": [2], "draft": [4]}
    a.check_invariants()


@pytest.mark.parametrize("form", ["negative hint", "no hint"])
def test_one_group_decode_growth_placement(backing, form):
    """One-block growth of a one-group allocator: near slot, roomiest out of a full one,
    out-of-group hint = no hint (a negative one too) = fullest."""
    a = make(backing, slots=4, bps=4)

    def grow(near=-1):
        if form == "negative hint" or near >= 0:
            return a.allocate({"attn": 1}, {"attn": near})["attn"]
        return a.allocate({"attn": 1})["attn"]

    a.allocate({"attn": 12})  # slots 0-2 full
    a.free({"attn": [4, 5, 6]})  # slot 1: 3 free
    a.free({"attn": [8]})  # slot 2: 1 free
    assert grow(3) == [6]  # slot 0 full: the roomiest partial slot (1), last freed first
    assert grow(6) == [5]  # its own slot
    assert grow(99) == [8]  # outside the group: no hint, the fullest partial slot (2 first)
    assert grow() == [4]
    assert a.num_free_blocks("attn") == 0 and a.num_active_slots("attn") == 3
    a.check_invariants()


def test_one_group_dict_api_refuses_other_groups_by_name(backing):
    a = make(backing, slots=4, bps=4)
    with pytest.raises(KeyError, match="unknown cache group 'draft'; groups: attn"):
        a.allocate({"draft": 1})
    with pytest.raises(KeyError, match="unknown cache group 'draft'; groups: attn"):
        a.free({"draft": [0]})
    with pytest.raises(ValueError, match="negative block count -1 for group 'attn'"):
        a.allocate({"attn": -1})
    assert a.allocate({"attn": 0}) == {"attn": []}
    a.check_invariants()


def test_allocate_group_and_free_group_are_the_dict_api_per_group(backing):
    a = make(backing)
    b = make(FakeBacking())
    ops = [("a", 3, -1), ("a", 1, 2), ("a", 6, -1), ("f", [0, 1]), ("a", 1, 3), ("a", 2, 7),
           ("f", [4, 5, 6, 7]), ("a", 4, -1)]
    held = []
    for op in ops:
        if op[0] == "a":
            _, n, hint = op
            got = a.allocate_group("attn", n, hint)
            ref = b.allocate({"attn": n}, {"attn": hint} if hint >= 0 else None)
            assert got == ref["attn"]
            held += got
        else:
            assert a.free_group("attn", op[1]) is None
            assert b.free({"attn": op[1]}) == {}
        assert [a.slot_info("attn", s) for s in range(4)] == \
            [b.slot_info("attn", s) for s in range(4)]
    a.check_invariants()
    free = [x for x in range(16) if a.ref_count("attn", x) == 0]
    before = [a.slot_info("attn", s) for s in range(4)]
    with pytest.raises(ValueError, match="double free"):
        a.free_group("attn", [held[-1], free[0]])  # refused in its one pass: undone
    assert [a.slot_info("attn", s) for s in range(4)] == before
    with pytest.raises(ValueError, match="not a block of group"):
        a.free_group("attn", [-1])
    a.check_invariants()


def test_allocate_group_refuses_when_no_slot_can_be_activated():
    a = make(FakeBacking(), slots=1, bps=4)
    assert a.allocate_group("attn", 5) is None
    assert a.num_active_slots("attn") == 0
    assert a.allocate_group("attn", 4) == [0, 1, 2, 3]
    assert a.allocate_group("attn", 1) is None
    a.check_invariants()


def test_a_negative_block_id_is_refused_and_never_reads_another_block(backing):
    """A negative id is no block of the group (Python's negative index would name the last
    block): refused by the one-group free with a retaining group, by the dict free over
    several groups before any group changes, and by the LRU free."""
    a = make(backing, slots=4, bps=4, draft=(4, 4))
    a.will_retain("attn")
    x = a.allocate({"attn": 16, "draft": 16})
    a.touch("attn", 15)  # block 15 (ref[-1]) has a reference to spare
    before = [a.ref_count("attn", b) for b in range(16)]
    calls = list(backing.calls)
    for free in (lambda: a.free_group("attn", [0, -1]),
                 lambda: a.free({"attn": [1, -1], "draft": x["draft"]}),
                 lambda: a.free_group_lru("attn", [-1, 2], {})):
        with pytest.raises(ValueError, match="not a block of group 'attn'"):
            free()
        assert [a.ref_count("attn", b) for b in range(16)] == before
        assert a.num_live_blocks("draft") == 16 and backing.calls == calls
    a.check_invariants()
