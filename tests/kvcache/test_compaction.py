"""BlockAllocator.compact on a fake backing: exact moves, slots released, pins and exclusions,
caps, a failed copy, several groups, cached and retained blocks."""

from __future__ import annotations

import pytest

from tests.kvcache.conftest import FakeBacking, KeepAll, make
from xllm_vmm.kvcache import BlockAllocator, Compaction



def scattered(a):
    """Three slots of 4: slot 0 keeps block 3, slot 1 keeps 4 and 5, slot 2 keeps 8, 9, 10."""
    a.allocate({"attn": 12})
    a.free({"attn": [0, 1, 2, 6, 7, 11]})


def test_sparsest_slot_moves_into_the_fullest_and_is_released_at_once(backing):
    a = make(backing)
    scattered(a)  # 6 free in active slots: one slot can go
    backing.calls.clear()
    c = a.compact()
    # slot 0 (1 block) is the sparsest; its block goes to the fullest slot (2: one free, 11)
    assert c == Compaction({"attn": {3: 11}}, {"attn": (0,)})
    assert backing.calls == [("move", {"attn": [(3, 11)]}), ("deactivate", {"attn": [0]})]
    assert a.active_slots("attn") == [1, 2] and a.ref_count("attn", 11) == 1
    assert a.ref_count("attn", 3) == 0 and a.num_free_blocks("attn") == 2
    assert c.blocks_moved == 1 and c.slots_released == 1
    a.check_invariants()
    # nothing left to gain: a second call moves nothing and maps nothing
    backing.calls.clear()
    assert a.compact() == Compaction({"attn": {}}, {"attn": ()}) and backing.calls == []


def test_as_many_slots_as_free_blocks_allow_are_emptied(backing):
    a = make(backing, slots=4, bps=4)
    a.allocate({"attn": 16})
    a.free({"attn": [0, 1, 2, 4, 5, 6, 8, 9, 12]})  # slots hold 1, 1, 2, 3 blocks
    c = a.compact()
    # 9 free blocks: 2 slots (the two sparsest, highest id first among equals) empty
    assert c.released_slots == {"attn": (0, 1)}
    assert sorted(c.moves["attn"]) == [3, 7]
    assert set(c.moves["attn"].values()) == {12, 9}  # fullest first: slot 3, then slot 2
    assert a.num_active_slots("attn") == 2 and a.num_live_blocks("attn") == 7
    a.check_invariants()


def test_cached_blocks_move_with_their_flags(backing):
    p = KeepAll()
    a = make(backing, policy=p)
    x = p.allocate({"attn": 12})["attn"]
    p.free({"attn": [0, 1, 2, 6, 7, 11]})  # cached: nothing is free, nothing to compact
    assert a.compact().blocks_moved == 0
    p.release_all()
    p.free({"attn": [3]})  # block 3 is cached now (retained)
    c = a.compact()
    assert c.moves == {"attn": {3: 11}}
    assert a.is_cached("attn", 11) and not a.is_cached("attn", 3)
    assert a.is_retained("attn", 11) and not a.is_retained("attn", 3)
    p.on_move("attn", c.moves["attn"])  # the caller's index follows
    assert ("attn", 11) in p.lru and a.slot_info("attn", 2).cached == 1
    assert x == list(range(12))
    a.check_invariants()


def test_pinned_and_excluded_blocks_stay_and_keep_their_slot(backing):
    a = make(backing)
    scattered(a)
    a.pin("attn", 3)
    c = a.compact()  # slot 0 is pinned: slot 1 (2 blocks) goes instead
    assert c.released_slots == {"attn": (1,)} and sorted(c.moves["attn"]) == [4, 5]
    a.check_invariants()
    b2 = FakeBacking()
    a2 = make(b2)
    scattered(a2)
    c2 = a2.compact(exclude={"attn": [3, 4]})
    assert c2.released_slots == {"attn": (2,)} and sorted(c2.moves["attn"]) == [8, 9, 10]


def test_max_blocks_caps_the_copies_to_whole_slots(backing):
    a = make(backing, slots=4, bps=4)
    a.allocate({"attn": 16})
    a.free({"attn": [0, 1, 2, 4, 5, 8, 9, 12]})  # slots hold 1, 2, 2, 3
    assert a.compact(max_blocks=0).blocks_moved == 0
    c = a.compact(max_blocks=2)  # slot 0 (1 block) fits; slot 2 (2 more) would exceed
    assert c.blocks_moved == 1 and c.released_slots == {"attn": (0,)}
    a.check_invariants()


def test_a_failed_copy_changes_nothing(backing):
    a = make(backing)
    scattered(a)
    backing.move_ok = False
    c = a.compact()
    assert c.blocks_moved == 0 and c.error == "injected copy failure"
    assert a.active_slots("attn") == [0, 1, 2] and a.ref_count("attn", 3) == 1
    a.check_invariants()


def test_groups_compact_together_and_one_call_releases_them(backing):
    a = make(backing, slots=4, bps=4, draft=(4, 2))
    a.allocate({"attn": 8, "draft": 4})
    a.free({"attn": [0, 1, 2, 5], "draft": [0, 3]})  # attn: 1 | 3 blocks; draft: 1 | 1
    backing.calls.clear()
    c = a.compact()
    assert c.moves == {"attn": {3: 5}, "draft": {2: 0}}
    assert c.released_slots == {"attn": (0,), "draft": (1,)}
    assert backing.calls[-1] == ("deactivate", {"attn": [0], "draft": [1]})
    assert a.compact(["draft"]).moves == {"draft": {}}
    a.check_invariants()


def test_misuse_is_refused_with_what_to_do(backing):
    a = make(backing)
    with pytest.raises(KeyError, match="unknown cache group 'mla'"):
        a.compact(["mla"])
    with pytest.raises(ValueError, match="max_blocks must be >= 0, got -1"):
        a.compact(max_blocks=-1)

    class NoCopy:
        def activate(self, slots):
            return True

        def deactivate(self, slots):
            pass

    with pytest.raises(TypeError, match="slot backing NoCopy has no move"):
        make(NoCopy()).compact()
