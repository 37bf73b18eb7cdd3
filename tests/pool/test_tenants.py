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
