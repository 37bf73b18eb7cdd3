"""Tenant removal (the weights of a closed checkpoint give their region back) and
``unmap_pages(release=True)`` (weights going to sleep keep no ready handle)."""

from __future__ import annotations

import pytest

from xllm_vmm.pool import BudgetConfig, BudgetMode, VmmPool

MiB = 1 << 20
PAGE = 2 * MiB


def _pool(driver, mode=BudgetMode.ELASTIC, ready_pages=0):
    return VmmPool(driver, BudgetConfig(mode=mode, max_memory_utilization=0.9,
                                        execution_peak_bytes=0), 16 * PAGE,
                   ready_pages=ready_pages)


@pytest.mark.parametrize("mode", list(BudgetMode))
def test_remove_tenant_frees_its_memory_and_arena(driver_factory, mode):
    d = driver_factory(64 * MiB)
    with _pool(d, mode) as pool:
        kv = pool.add_tenant("kv", 4 * PAGE)
        w = pool.add_tenant("weights", 4 * PAGE, end="high")
        assert pool.map_pages(w, [0, 1, 2, 3], tag="weights")
        assert pool.map_pages(kv, [0])
        kv_held = pool.held_bytes - 4 * PAGE
        left = pool.arena_bytes_left()
        pool.remove_tenant("weights")
        assert not pool.has_tenant("weights") and pool.has_tenant("kv")
        assert pool.held_bytes == kv_held
        assert pool.arena_bytes_left() == left + 4 * PAGE  # innermost of the high end
        again = pool.add_tenant("weights", 4 * PAGE, end="high")
        assert again.first_page == w.first_page
        if mode is BudgetMode.ELASTIC:
            assert pool.held_bytes == PAGE
        pool.remove_tenant("kv")
        assert pool.arena_bytes_left() == left + 4 * PAGE  # kv was innermost of the low end
        assert pool.held_bytes == (0 if mode is BudgetMode.ELASTIC else 4 * PAGE)


def test_remove_inner_tenant_keeps_space_carved(driver_factory):
    d = driver_factory(64 * MiB)
    with _pool(d) as pool:
        a = pool.add_tenant("weights", 2 * PAGE, end="high")
        pool.add_tenant("weights.1", 2 * PAGE, end="high")
        assert pool.map_pages(a, [0, 1])
        left = pool.arena_bytes_left()
        pool.remove_tenant("weights")  # not innermost: its pages stay carved
        assert pool.held_bytes == 0 and pool.arena_bytes_left() == left
        pool.remove_tenant("weights.1")  # innermost: its pages return
        assert pool.arena_bytes_left() == left + 2 * PAGE


def test_unmap_release_keeps_no_ready_handle(driver_factory):
    d = driver_factory(64 * MiB)
    with _pool(d, ready_pages=4) as pool:
        r = pool.add_tenant("weights", 4 * PAGE, end="high")
        assert pool.map_pages(r, [0, 1])
        pool.unmap_pages(r, [0])
        assert pool.stats().ready_bytes == PAGE and pool.held_bytes == PAGE * 2
        assert pool.map_pages(r, [0])
        assert pool.stats().ready_bytes == 0  # the ready handle was reused
        pool.unmap_pages(r, [0, 1], release=True)
        assert pool.stats().ready_bytes == 0 and pool.held_bytes == 0


def test_paged_tenant_of_a_physical_pool_is_elastic(driver_factory):
    """Weight-only VMM: a paged tenant of a physical pool maps pages on demand within free −
    execution peak − reserve (max_cache_size caps the physical KV cache, not it), releases
    them at once, and leaves the resident tenant alone."""
    d = driver_factory(16 * PAGE)
    pool = VmmPool(d, BudgetConfig(mode=BudgetMode.PHYSICAL, max_memory_utilization=0.5,
                                   max_cache_size=4 * PAGE, execution_peak_bytes=0), 32 * PAGE)
    with pool:
        w = pool.add_tenant("weights", 20 * PAGE, end="high", paged=True)
        assert pool.held_bytes == 0 and not pool.is_mapped(w, 0)
        kv = pool.add_tenant("kv", 4 * PAGE)  # resident, at once
        assert pool.held_bytes == 4 * PAGE and pool.is_mapped(kv, 3)
        assert pool.mappable_pages(w) == 12  # 16 − 4 pages free, beyond max_cache_size
        assert not pool.map_pages(w, list(range(13)))
        assert pool.held_bytes == 4 * PAGE
        assert pool.map_pages(w, list(range(12)))
        assert pool.is_mapped(w, 11) and not pool.is_mapped(w, 12)
        assert pool.stats().per_tenant_mapped_bytes == {"weights": 12 * PAGE, "kv": 4 * PAGE}
        assert pool.mapped_bytes == 16 * PAGE
        pool.unmap_pages(w, list(range(12)))
        assert pool.held_bytes == 4 * PAGE
        assert pool.map_pages(w, [0, 1])
        pool.remove_tenant("weights")
        assert pool.held_bytes == 4 * PAGE and pool.is_mapped(kv, 0)
