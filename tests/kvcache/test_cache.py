"""VirtualKVCache over a real pool on every driver: geometry, slot mapping in one batched call,
release at once, fixed and physical modes, MTP draft groups, unmapped-block access."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.kvcache.conftest import PAGE, toy_layout
from xllm_vmm.kvcache import CacheLayoutError, VirtualKVCache
from xllm_vmm.pool import BudgetConfig, VmmPool
from xllm_vmm.vmm.driver import CopyKind, VmmNotMapped

MiB = 1 << 20
ELASTIC = BudgetConfig(mode="elastic", execution_peak_bytes=0)


def make_cache(d, layout, tokens, budget=ELASTIC):
    pool = VmmPool(d, budget, VirtualKVCache.arena_bytes(layout, PAGE, tokens))
    return pool, VirtualKVCache.for_tokens(pool, layout, tokens)


def test_geometry_addresses_and_slot_pages(driver_factory):
    d = driver_factory(64 * MiB)
    lay = toy_layout(layers=2, blocks_per_page=4, block_size=16, draft_blocks_per_page=8)
    pool, c = make_cache(d, lay, 16 * 16)  # 16 blocks: attn 4 slots, draft 2 slots
    attn, draft = c.geometry["attn"], c.geometry["draft"]
    assert (attn.num_slots, attn.blocks_per_slot, attn.slot_bytes) == (4, 4, 4 * PAGE)
    assert (draft.num_slots, draft.blocks_per_slot, draft.first_page) == (2, 8, 16)
    assert attn.slot_pages(1) == [1, 5, 9, 13]
    assert draft.slot_pages(1) == [17, 19]
    base = pool.arena_va
    # block 6 of attn: slot 1, index 2, in tensor 3 (layer1.v): 12 pages + 1 page + 2 blocks
    assert c.block_address("attn", 3, 6) == base + 12 * PAGE + PAGE + 2 * (PAGE // 4)
    assert c.block_address("draft", 1, 9) == base + 18 * PAGE + PAGE + PAGE // 8
    pool.close()


def test_slots_of_every_group_map_in_one_batched_call_and_release_at_once(driver_factory):
    d = driver_factory(64 * MiB)
    lay = toy_layout(layers=2, blocks_per_page=4, draft_blocks_per_page=8)
    pool, c = make_cache(d, lay, 256)
    got = c.allocator.allocate({"attn": 5, "draft": 5})
    assert got == {"attn": [0, 1, 2, 3, 4], "draft": [0, 1, 2, 3, 4]}
    s = pool.stats()
    assert (s.map_calls, s.pages_mapped_total) == (1, 2 * 4 + 2)  # 2 attn slots, 1 draft slot
    assert d.mem_info().free == 64 * MiB - 10 * PAGE
    assert all(c.check_mapped("attn", b) for b in got["attn"])
    assert not c.check_mapped("attn", 8)
    c.allocator.free(got)
    assert pool.stats().unmap_calls == 1 and pool.mapped_bytes == 0
    assert d.mem_info().free == 64 * MiB
    pool.close()


def test_budget_refusal_is_not_now_and_changes_nothing(driver_factory):
    d = driver_factory(24 * MiB)
    lay = toy_layout(layers=2, blocks_per_page=4, draft_blocks_per_page=8)
    pool, c = make_cache(d, lay, 256)
    assert c.allocator.allocate({"attn": 8, "draft": 1})  # 2 attn slots (16 MiB) + 1 draft (4 MiB)
    assert c.allocator.allocate({"attn": 1, "draft": 1}) is None  # a third attn slot needs 8 MiB
    assert c.allocator.num_live_blocks("draft") == 1
    assert pool.stats().failed_maps == 1
    c.allocator.check_invariants()
    pool.close()


def test_fixed_cache_is_sized_by_the_ratio_and_activates_without_driver_calls(driver_factory):
    d = driver_factory(100 * MiB)
    cfg = BudgetConfig(mode="fixed", max_memory_utilization=0.5, execution_peak_bytes=0)
    lay = toy_layout(layers=2, blocks_per_page=4)  # one slot = 4 pages = 8 MiB = 64 tokens
    pool = VmmPool(d, cfg, 64 * MiB)
    c = VirtualKVCache.for_budget(pool, lay)
    assert c.geometry["attn"].num_slots == 6  # 50 MiB -> 6 slots of 8 MiB
    assert d.mem_info().free == 52 * MiB
    calls = pool.stats().map_calls
    x = c.allocator.allocate({"attn": 24})
    assert x["attn"] == list(range(24))
    c.allocator.free(x)
    assert pool.stats().map_calls == calls and pool.stats().unmap_calls == 0
    assert d.mem_info().free == 52 * MiB
    assert c.allocator.allocate({"attn": 25}) is None
    pool.close()


def test_physical_budget_too_small_for_one_slot_names_the_flags(driver_factory):
    d = driver_factory(16 * MiB)
    cfg = BudgetConfig(mode="physical", max_memory_utilization=0.25, execution_peak_bytes=0)
    pool = VmmPool(d, cfg, 16 * MiB)
    with pytest.raises(CacheLayoutError, match=r"physical budget leaves 4194304 bytes, less "
                                               r"than one slot.*\(8388608 bytes\).*raise "
                                               r"max_memory_utilization or max_cache_size"):
        VirtualKVCache.for_budget(pool, toy_layout())
    pool.close()


def test_block_larger_than_a_page_is_refused():
    from xllm_vmm.models.spec import CacheGroup, CacheLayout, CacheTensor
    from xllm_vmm.vmm.sim import SimDriver

    lay = CacheLayout("big", 1, (CacheGroup("attn", (CacheTensor("l0.k", 40000),), 128),))
    pool = VmmPool(SimDriver(64 * MiB), ELASTIC, 8 * MiB)
    with pytest.raises(CacheLayoutError, match=r"'attn': one block is 5120000 bytes per tensor, "
                                               r"larger than a 2097152-byte page.*block_size"):
        VirtualKVCache(pool, lay, {"attn": 1})


def test_copy_into_a_released_block_is_caught_on_the_sim_driver():
    from xllm_vmm.vmm.sim import SimDriver

    d = SimDriver(64 * MiB)
    pool, c = make_cache(d, toy_layout(), 256)
    (b,) = c.allocator.allocate({"attn": 1})["attn"]
    va = c.block_address("attn", 0, b)
    d.copy(va, 0x1000, 64, CopyKind.H2D)
    c.allocator.free({"attn": [b]})
    with pytest.raises(VmmNotMapped, match="destination not mapped"):
        d.copy(va, 0x1000, 64, CopyKind.H2D)
    pool.close()


_FAULT_CHILD = textwrap.dedent("""
    import ctypes, sys
    sys.path.insert(0, {tests!r})
    from kvcache.conftest import toy_layout, PAGE
    from xllm_vmm.kvcache import VirtualKVCache
    from xllm_vmm.pool import BudgetConfig, VmmPool
    from xllm_vmm.vmm import open_driver
    d = open_driver("host", device_memory=64 << 20)
    lay = toy_layout()
    pool = VmmPool(d, BudgetConfig(execution_peak_bytes=0), VirtualKVCache.arena_bytes(lay, PAGE, 256))
    c = VirtualKVCache.for_tokens(pool, lay, 256)
    (b,) = c.allocator.allocate({{"attn": 1}})["attn"]
    va = c.block_address("attn", 0, b)
    ctypes.memset(va, 7, 64)
    assert ctypes.string_at(va, 2) == b"\\x07\\x07"
    print("written", flush=True)
    c.allocator.free({{"attn": [b]}})
    ctypes.memset(va, 7, 64)
    print("NOT FAULTED", flush=True)
""")


def test_touching_a_released_block_faults_on_the_host_driver():
    pytest.importorskip("xllm_vmm.vmm.host")
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _FAULT_CHILD.format(tests=tests_dir)],
                         capture_output=True, text=True, timeout=120)
    assert "written" in out.stdout, out.stderr
    assert "NOT FAULTED" not in out.stdout
    assert out.returncode == -11  # SIGSEGV: the unmapped page is PROT_NONE


def _rss_shmem_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    return -1


def test_host_release_is_real_shared_memory_drops():
    pytest.importorskip("xllm_vmm.vmm.host")
    import ctypes

    from xllm_vmm.vmm import open_driver

    d = open_driver("host", device_memory=128 * MiB)
    lay = toy_layout(layers=2, blocks_per_page=4)
    pool, c = make_cache(d, lay, 1024)
    x = c.allocator.allocate({"attn": 16})["attn"]  # 4 slots × 4 pages = 32 MiB
    for b in x:
        for t in range(4):
            ctypes.memset(c.block_address("attn", t, b), 1, PAGE // 4)
    held = _rss_shmem_kib()
    c.allocator.free({"attn": x})
    dropped = held - _rss_shmem_kib()
    assert dropped >= 30 * 1024, f"RssShmem dropped by {dropped} KiB, expected ~32 MiB"
    pool.close()
    d.close()


def test_one_group_maps_and_releases_through_its_allocator(driver_factory):
    """The cache is its allocator's slot backing: one batched map for a new slot, one unmap
    when it empties; its allocate / free are the allocator's, called through (not rebound)."""
    d = driver_factory(64 * MiB)
    pool, c = make_cache(d, toy_layout(layers=1, blocks_per_page=4), 256)
    assert "allocate" not in vars(c) and "free" not in vars(c)
    seq = c.allocator.allocate({"attn": 3})["attn"]
    assert seq == [0, 1, 2] and pool.stats().map_calls == 1
    assert c.allocator.allocate({"attn": 1}, {"attn": seq[-1]}) == {"attn": [3]}
    c.allocator.free({"attn": seq + [3]})
    assert pool.mapped_bytes == 0 and pool.stats().unmap_calls == 1
    assert c.allocate({"attn": 1}) == {"attn": [0]} and c.free({"attn": [0]}) == {}
    pool.close()
