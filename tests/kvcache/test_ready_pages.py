"""The manager's growth headroom (``ready_slots``): step() creates pages ahead of demand into
the pool's ready set, a slot activation maps them without creating any, and the headroom is
freed when no request is left, at sleep and at close.

The toy cache of ``test_manager.Env``: one group of 2 tensors (K and V), so one slot is 2
pages; 4 blocks of 4 tokens per slot."""

from __future__ import annotations

import pytest

from tests.kvcache.test_manager import BS, toks

MiB = 1 << 20


def committed(e) -> int:
    """Bytes the driver has committed (handles created and not freed)."""
    return 64 * MiB - e.driver.mem_info().free


@pytest.mark.parametrize("kind", ["sim", "host"])
def test_step_creates_one_slot_ahead_and_growth_maps_it(env, kind):
    e = env(kind, budget_slots=6, prefix=False, compact=False)
    m, pool = e.mgr, e.pool
    page = pool.page_bytes
    assert pool.ready_pages == 2  # one slot of the widest group: K and V
    m.allocate("a", 4 * BS)  # the first slot: 4 blocks
    m.commit("a", 4 * BS, toks(1, 2, 3, 4, tail=0))
    assert pool.stats().ready_bytes == 0
    m.step()  # at most an eighth of the headroom per step, rounded up: one page
    assert pool.stats().ready_bytes == page
    m.step()
    m.step()  # full: nothing more
    s = pool.stats()
    assert (s.ready_bytes, s.held_bytes, s.mapped_bytes) == (2 * page, 4 * page, 2 * page)
    before = committed(e)
    assert m.allocate("a", 1) == {"attn": [0, 1, 2, 3, 4]}  # a new slot: the ready pages
    assert committed(e) == before  # nothing created on the step that grew
    s = pool.stats()
    assert (s.ready_bytes, s.held_bytes, s.mapped_bytes) == (0, 4 * page, 4 * page)
    m.check_invariants()
    m.free("a")  # no request left: the slots go back and no headroom is kept
    s = pool.stats()
    assert (s.ready_bytes, s.held_bytes, s.mapped_bytes) == (0, 0, 0)
    assert committed(e) == 0


def test_headroom_stays_in_the_budget_and_sleep_and_close_free_it(env):
    e = env(budget_slots=2, prefix=False, compact=False)
    m, pool = e.mgr, e.pool
    page = pool.page_bytes
    m.allocate("a", 4 * BS)
    for _ in range(4):
        m.step()
    assert pool.stats().ready_bytes == 2 * page  # the budget's second slot, created ahead
    assert m.capacity().available_blocks["attn"] == 4  # still the request's to take
    assert m.allocate("b", 4 * BS) == {"attn": [4, 5, 6, 7]}
    assert m.allocate("c", 1) is None  # the quota: nothing was created past it
    for _ in range(4):
        m.step()
    assert pool.stats().ready_bytes == 0 and pool.held_bytes == 4 * page
    m.free("b")  # a slot freed while "a" runs: kept ready for the next growth
    assert pool.stats().ready_bytes == 2 * page
    m.free("a")
    assert pool.held_bytes == 0
    m.allocate("d", 1)
    m.step()
    assert pool.stats().ready_bytes == page
    m.free("d")
    m.sleep()
    assert pool.held_bytes == 0
    m.wake_up()
    m.allocate("e", 1)
    m.step()
    assert pool.ready_pages == 2 and pool.stats().ready_bytes == page
    m.close()  # the pool's own setting comes back and the headroom is freed
    assert pool.ready_pages == 0 and pool.held_bytes == 0


def test_ready_slots_zero_creates_nothing_ahead_and_bad_values_are_refused(env):
    e = env(prefix=False, ready_slots=0)
    e.mgr.allocate("a", 4 * BS)
    e.mgr.step()
    assert e.pool.ready_pages == 0 and e.pool.stats().ready_bytes == 0
    with pytest.raises(ValueError, match=r"ready_slots must be an int >= 0"):
        env(ready_slots=-1)
