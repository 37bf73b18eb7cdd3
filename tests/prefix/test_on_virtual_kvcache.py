"""The prefix cache and host tier over the real VirtualKVCache, pool and device drivers."""

import pytest

from xllm_vmm.kvcache.hashing import block_hashes
from xllm_vmm.kvcache.host_pool import HostPoolTooLarge
from xllm_vmm.kvcache import build_kv_cache_manager
from xllm_vmm.kvcache.prefix_setup import HostTierUnsupported, plan_host_pool
from xllm_vmm.models.spec import CacheGroup, CacheLayout, CacheTensor, ResidentState
from tests.prefix.real import BS, MiB, Stack, flat_layout, mla_index_layout, toks

DRIVERS = ["host", "acl-emu"]


@pytest.fixture(params=DRIVERS)
def kind(request):
    return request.param


def test_eviction_under_budget_gives_up_exact_lru_blocks(kind):
    # budget: 2 slots (each slot = 2 pages = 4 MiB; 8 blocks of 4 tokens per slot)
    s = Stack(kind, flat_layout(), budget=8 * MiB, max_tokens=4 * 8 * BS)
    try:
        a = s.start(toks(*range(1, 9), tail=0))  # fills slot 0
        s.compute(a)
        s.finish(a)
        b = s.start(toks(*range(11, 19), tail=0))  # fills slot 1
        s.compute(b)
        s.finish(b)
        assert s.pool.mapped_bytes == 8 * MiB
        assert s.prefix.stats.cached_blocks == 16
        # no memory: the shortfall (2 blocks) goes by exact LRU, a's last two blocks (released
        # tail first), and c reuses them in place; a's first six blocks stay hits
        c = s.start(toks(21, 22, tail=0))
        assert c.blocks["attn"] == [6, 7]
        assert s.prefix.stats.evictions == 2 and s.prefix.stats.evicted_slots_emptied == 0
        assert s.prefix.lookup(a.hashes, record=False).num_blocks == 6
        assert s.prefix.lookup(b.hashes, max_blocks=7, record=False).num_blocks == 7
        assert s.pool.mapped_bytes == 8 * MiB  # never beyond the budget
        s.cache.allocator.check_invariants()
    finally:
        s.close()


def test_reset_releases_every_cached_page(kind):
    s = Stack(kind, flat_layout(), budget=8 * MiB, max_tokens=4 * 8 * BS)
    try:
        a = s.start(toks(1, 2, 3))
        s.compute(a)
        s.finish(a)
        assert s.pool.mapped_bytes == 4 * MiB
        assert s.prefix.reset() == 3
        assert s.pool.mapped_bytes == 0  # EL-01: an empty slot is released at once
        s.cache.allocator.check_invariants()
    finally:
        s.close()


@pytest.mark.parametrize("layout", [flat_layout, mla_index_layout], ids=["flat", "mla+index"])
def test_restore_from_host_is_byte_exact(kind, layout):
    s = Stack(kind, layout(), budget=8 * MiB, max_tokens=4 * 8 * BS, host_factor=2.0)
    try:
        g0 = s.groups[0]
        a = s.start(toks(1, 2, 3, tail=0))
        s.compute(a)
        original = {g: [s.read(g, x) for x in a.blocks[g]] for g in s.groups}
        assert original[g0][0] == s.expected(g0, a.hashes[0])
        s.finish(a)
        s.host.wait_all()
        assert s.host.stats.offloaded_blocks == 3
        # evict a from the device by filling the budget with other prompts
        for base in (10, 30, 50):
            r = s.start(toks(*range(base, base + 8), tail=0))
            s.compute(r)
            s.finish(r)
            s.host.wait_all()
        assert s.prefix.lookup(a.hashes, record=False).num_blocks == 0
        b = s.start(toks(1, 2, 3, 4))
        assert b.hit == 0 and b.restore is not None and b.restore.num_blocks == 3
        assert b.restore.wait() is True
        for g in s.groups:
            assert [s.read(g, x) for x in b.blocks[g][:3]] == original[g]
        assert s.prefix.lookup(a.hashes, record=False).blocks[g0] == tuple(b.blocks[g0][:3])
        s.compute(b)
        s.finish(b)
        s.host.wait_all()
        s.cache.allocator.check_invariants()
    finally:
        s.close()


def test_cancel_during_restore_keeps_blocks_until_the_copy_is_reaped(kind):
    s = Stack(kind, flat_layout(), budget=8 * MiB, max_tokens=4 * 8 * BS, host_factor=2.0)
    try:
        a = s.start(toks(1, 2, tail=0))
        s.compute(a)
        s.finish(a)
        s.host.wait_all()
        s.prefix.reset()
        assert s.pool.mapped_bytes == 0
        b = s.start(toks(1, 2, 3))
        assert b.restore is not None and not b.restore.done()
        restored = list(b.blocks["attn"][:2])
        s.mgr.free(b.rid)  # the request is gone at once, its restore in flight
        alloc = s.cache.allocator
        for x in restored:
            assert alloc.is_cached("attn", x) and s.prefix.pin_count("attn", x) == 1
        assert s.pool.mapped_bytes == 4 * MiB  # the page under the copy stays mapped
        s.host.wait_all()
        assert s.host.stats.restored_blocks == 2 and s.host.stats.restores_cancelled == 1
        assert s.prefix.lookup(a.hashes, record=False).num_blocks == 2  # valid, cached
        assert s.prefix.reset() == 2 and s.pool.mapped_bytes == 0  # nothing leaked
        alloc.check_invariants()
    finally:
        s.close()


def test_host_pool_sizing_follows_device_capacity_hk06(kind):
    s = Stack(kind, flat_layout(), budget=8 * MiB, max_tokens=4 * 8 * BS, host_factor=2.0)
    try:
        size = plan_host_pool(s.cache, 2.0)
        # 4 slots x 2 tensors x 2 MiB = 16 MiB device capacity; 512 KiB per host block
        assert size.device_capacity_bytes == 16 * MiB
        assert (size.block_bytes, size.blocks, size.bytes) == (512 * 1024, 64, 32 * MiB)
        assert s.host.pool.capacity == 64
    finally:
        s.close()


def test_factory_refuses_a_host_pool_too_large_hk07_and_keeps_none_at_factor_1(kind):
    from xllm_vmm.pool.budget import BudgetConfig
    from xllm_vmm.pool.pool import VmmPool
    from tests.prefix.real import open_test_driver

    d = open_test_driver(kind, 64 * MiB)
    pool = VmmPool(d, BudgetConfig(max_cache_size=8 * MiB, execution_peak_bytes=0), 32 * MiB)
    try:
        with pytest.raises(HostPoolTooLarge, match=r"needs 33554432 bytes .* only 1048576 bytes"):
            build_kv_cache_manager(pool, flat_layout(), enable_prefix_cache=True,
                                   host_blocks_factor=2.0, max_tokens=4 * 8 * BS,
                                   host_available_bytes=1 * MiB, host_populate=False)
    finally:
        pool.close()
    pool = VmmPool(d, BudgetConfig(max_cache_size=8 * MiB, execution_peak_bytes=0), 32 * MiB)
    try:
        m = build_kv_cache_manager(pool, flat_layout(), enable_prefix_cache=True,
                                   host_blocks_factor=1.0, max_tokens=4 * 8 * BS)
        assert m.host is None  # HK-03: a factor of 1 or less keeps no host tier
        m = None
    finally:
        pool.close()
        d.close()


def test_hk05_layouts_are_refused():
    from xllm_vmm.kvcache.prefix_setup import host_tier_unsupported_reason

    hybrid = CacheLayout("h", 1, flat_layout().groups, resident=ResidentState(10, 10))
    assert "conv/SSM" in host_tier_unsupported_reason(hybrid)
    sliding = CacheLayout("s", 1, flat_layout().groups + (CacheGroup(
        "sliding", (CacheTensor("x", 64),), BS, max_tokens_per_seq=128),))
    assert "grouped caches (sliding)" in host_tier_unsupported_reason(sliding)
    assert "VLM" in host_tier_unsupported_reason(flat_layout(), vision=True)
    assert host_tier_unsupported_reason(mla_index_layout()) is None
