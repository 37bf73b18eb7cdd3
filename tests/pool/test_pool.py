"""VmmPool on every driver: tenants, elastic budget, quota, rollback, fixed and physical."""

from __future__ import annotations

import pytest

from xllm_vmm.pool import BudgetConfig, PoolCapacityError, VmmPool

MiB = 1 << 20
PAGE = 2 * MiB


def elastic(peak=0, reserve=0, quota=0):
    return BudgetConfig(mode="elastic", execution_peak_bytes=peak, reserve_bytes=reserve,
                        max_cache_size=quota)


def test_tenants_come_from_both_ends_of_the_arena(driver_factory):
    d = driver_factory(64 * MiB)
    with VmmPool(d, elastic(), 20 * MiB) as pool:
        kv = pool.add_tenant("kv", 7 * MiB)  # rounds up to 4 pages
        w = pool.add_tenant("weights", 4 * MiB, end="high")
        assert (kv.first_page, kv.pages) == (0, 4)
        assert (w.first_page, w.pages) == (8, 2)
        assert w.base_va == pool.arena_va + 8 * PAGE
        with pytest.raises(PoolCapacityError, match=r"'extra' needs 5 pages but the arena has "
                                                    r"4 of 10 pages left"):
            pool.add_tenant("extra", 10 * MiB)
        with pytest.raises(PoolCapacityError, match="'kv' already has a region"):
            pool.add_tenant("kv", PAGE)


def test_elastic_growth_stops_at_free_minus_peak_minus_reserve(driver_factory):
    d = driver_factory(64 * MiB)
    with VmmPool(d, elastic(peak=8 * MiB, reserve=8 * MiB), 64 * MiB) as pool:
        r = pool.add_tenant("kv", 64 * MiB)
        assert pool.budget_left_bytes() == 48 * MiB
        assert pool.map_pages(r, list(range(24)))
        assert d.mem_info().free == 16 * MiB
        assert pool.map_pages(r, [24]) is False
        s = pool.stats()
        assert (s.failed_maps, s.mapped_bytes, s.pages_in_use, s.budget_left_bytes) == (
            1, 48 * MiB, 24, 0)
        # the engine observes a smaller peak on a backend with statistics: room for 4 more
        pool.reset_execution_peak(0)
        assert pool.mappable_pages(r) == 4
        assert pool.map_pages(r, [24, 25, 26, 27])


def test_quota_caps_the_pool(driver_factory):
    d = driver_factory(64 * MiB)
    with VmmPool(d, elastic(quota=10 * MiB), 32 * MiB) as pool:
        r = pool.add_tenant("kv", 32 * MiB)
        assert pool.map_pages(r, [0, 1, 2, 3, 4])
        assert pool.map_pages(r, [5]) is False
        pool.unmap_pages(r, [0])
        assert pool.map_pages(r, [5])
        assert pool.held_bytes == 10 * MiB


def test_unmap_releases_backing_at_once(driver_factory):
    d = driver_factory(64 * MiB)
    with VmmPool(d, elastic(), 16 * MiB) as pool:
        r = pool.add_tenant("kv", 16 * MiB)
        assert pool.map_pages(r, [0, 3, 5], tag="attn")
        assert d.mem_info().free == 58 * MiB
        assert pool.is_mapped(r, 3) and not pool.is_mapped(r, 1)
        pool.unmap_pages(r, [3, 5], tag="attn")
        assert d.mem_info().free == 62 * MiB
        s = pool.stats()
        assert (s.map_calls, s.unmap_calls, s.pages_mapped_total, s.pages_unmapped_total) == (
            1, 1, 3, 2)
        assert s.per_tenant_mapped_bytes == {"kv": PAGE}
        assert s.per_tag_mapped_bytes == {"attn": PAGE}


def test_misuse_is_an_error_not_a_not_now(driver_factory):
    d = driver_factory(64 * MiB)
    with VmmPool(d, elastic(), 8 * MiB) as pool:
        r = pool.add_tenant("kv", 8 * MiB)
        assert pool.map_pages(r, [1])
        with pytest.raises(ValueError, match="page 1 of tenant 'kv' is already in use"):
            pool.map_pages(r, [0, 1])
        with pytest.raises(ValueError, match=r"page 4 outside tenant 'kv' \(4 pages\)"):
            pool.map_pages(r, [4])
        with pytest.raises(ValueError, match="page 2 of tenant 'kv' is not in use"):
            pool.unmap_pages(r, [2])
        assert pool.pages_in_use(r) == {1}


def test_ready_pages_are_kept_and_counted(driver_factory):
    d = driver_factory(64 * MiB)
    with VmmPool(d, elastic(quota=8 * MiB), 16 * MiB, ready_pages=1) as pool:
        r = pool.add_tenant("kv", 16 * MiB)
        assert pool.map_pages(r, [0, 1, 2])
        pool.unmap_pages(r, [0, 1])
        s = pool.stats()
        assert (s.held_bytes, s.ready_bytes, s.mapped_bytes) == (4 * MiB, 2 * MiB, 2 * MiB)
        assert s.budget_left_bytes == 6 * MiB  # one ready page + 4 MiB of quota
        assert pool.map_pages(r, [5, 6, 7])
        assert pool.held_bytes == 8 * MiB and pool.map_pages(r, [3]) is False


def test_fill_ready_creates_ahead_within_the_budget_and_map_takes_them(driver_factory):
    d = driver_factory(64 * MiB)
    with VmmPool(d, elastic(quota=10 * MiB), 16 * MiB, ready_pages=3) as pool:
        r = pool.add_tenant("kv", 16 * MiB)
        assert pool.map_pages(r, [0])
        left = pool.budget_left_bytes()
        assert pool.fill_ready(2) == 2  # at most max_new per call
        assert pool.fill_ready(5) == 1  # up to ready_pages in all
        assert pool.fill_ready(5) == 0
        s = pool.stats()
        assert (s.held_bytes, s.ready_bytes, s.mapped_bytes) == (8 * MiB, 6 * MiB, 2 * MiB)
        assert pool.budget_left_bytes() == left  # ready handles are budget already held
        committed = 64 * MiB - d.mem_info().free
        assert committed == 8 * MiB
        assert pool.map_pages(r, [1, 2, 3, 4])  # three ready, one created
        assert 64 * MiB - d.mem_info().free == committed + PAGE
        assert pool.stats().ready_bytes == 0 and pool.held_bytes == 10 * MiB
        assert pool.fill_ready(3) == 0  # the quota is reached: nothing is created past it
        pool.unmap_pages(r, [1, 2])  # freed pages refill the ready set first
        assert pool.stats().ready_bytes == 4 * MiB
        assert pool.drain_ready() == 2
        s = pool.stats()
        assert (s.held_bytes, s.ready_bytes, s.mapped_bytes) == (6 * MiB, 0, 6 * MiB)
        assert 64 * MiB - d.mem_info().free == 6 * MiB  # the drained handles are freed


def test_fill_ready_is_a_no_op_outside_elastic_pools(driver_factory):
    d = driver_factory(64 * MiB)
    cfg = BudgetConfig(mode="fixed", max_memory_utilization=0.5, execution_peak_bytes=0)
    with VmmPool(d, cfg, 8 * MiB, ready_pages=4) as pool:
        pool.add_tenant("kv", 8 * MiB)
        assert pool.ready_pages == 0 and pool.fill_ready(4) == 0 and pool.drain_ready() == 0


def test_fixed_pool_maps_the_whole_region_at_start_and_never_returns_it(driver_factory):
    d = driver_factory(100 * MiB)
    cfg = BudgetConfig(mode="fixed", max_memory_utilization=0.5, execution_peak_bytes=10 * MiB)
    with VmmPool(d, cfg, 64 * MiB) as pool:
        assert pool.static_capacity_bytes() == 40 * MiB
        with pytest.raises(PoolCapacityError, match=r"'kv' needs 44040192 bytes but the fixed "
                                                    r"budget allows 41943040 bytes"):
            pool.add_tenant("kv", 40 * MiB + 1)
        r = pool.add_tenant("kv", 40 * MiB)
        assert d.mem_info().free == 60 * MiB
        assert pool.map_pages(r, list(range(20)))
        pool.unmap_pages(r, list(range(20)))
        assert d.mem_info().free == 60 * MiB and pool.mapped_bytes == 40 * MiB
        assert pool.stats().pages_in_use == 0 and pool.mappable_pages(r) == 20
    assert d.mem_info().free == 100 * MiB


def test_physical_pool_is_one_resident_allocation(driver_factory):
    d = driver_factory(100 * MiB)
    cfg = BudgetConfig(mode="physical", max_memory_utilization=0.5, execution_peak_bytes=0)
    with VmmPool(d, cfg, 50 * MiB) as pool:
        r = pool.add_tenant("kv", 50 * MiB)
        assert d.mem_info().free == 50 * MiB
        assert pool.is_mapped(r, 24) and pool.map_pages(r, [24])
        assert pool.stats().mapped_bytes == 50 * MiB
    assert d.mem_info().free == 100 * MiB


def test_default_execution_headroom_is_five_percent_of_total(driver_factory):
    d = driver_factory(100 * MiB)
    with VmmPool(d, BudgetConfig(mode="elastic"), 8 * MiB) as pool:
        assert pool.stats().execution_peak_bytes == 5 * MiB
        assert pool.growth_left_bytes() == 95 * MiB
        pool.observe_execution_peak(20 * MiB)
        assert pool.growth_left_bytes() == 80 * MiB


def test_close_returns_everything(driver_factory):
    d = driver_factory(64 * MiB)
    pool = VmmPool(d, elastic(), 16 * MiB, ready_pages=2)
    r = pool.add_tenant("kv", 16 * MiB)
    pool.map_pages(r, [0, 1, 2])
    pool.unmap_pages(r, [0])
    pool.close()
    pool.close()
    assert d.mem_info().free == 64 * MiB


# -- sim-only: external memory and injected driver failures ---------------------------------

def test_memory_used_and_freed_outside_the_pool_moves_the_budget():
    from xllm_vmm.vmm.sim import SimDriver

    d = SimDriver(64 * MiB)
    with VmmPool(d, elastic(), 64 * MiB) as pool:
        r = pool.add_tenant("kv", 64 * MiB)
        d.set_external_use(60 * MiB)
        assert pool.map_pages(r, [0, 1, 2]) is False
        d.set_external_use(10 * MiB)  # released outside the pool: usable without a restart
        assert pool.map_pages(r, [0, 1, 2])


@pytest.mark.parametrize("op,nth", [("create", 1), ("create", 2), ("map", 1), ("map", 4)])
def test_a_failed_create_or_map_rolls_back_the_whole_call(op, nth):
    from xllm_vmm.vmm.sim import SimDriver

    d = SimDriver(64 * MiB)
    with VmmPool(d, elastic(), 16 * MiB, ready_pages=2) as pool:
        r = pool.add_tenant("kv", 16 * MiB)
        assert pool.map_pages(r, [0, 1])
        pool.unmap_pages(r, [0, 1])  # two ready handles
        before = (d.created_bytes, d.mapped_bytes, pool.held_bytes, pool.stats().ready_bytes)
        d.fail_nth(op, nth)
        assert pool.map_pages(r, [2, 3, 4, 5]) is False
        assert (d.created_bytes, d.mapped_bytes, pool.held_bytes,
                pool.stats().ready_bytes) == before
        assert pool.pages_in_use(r) == frozenset() and pool.stats().failed_maps == 1
        assert pool.map_pages(r, [2, 3, 4, 5])
