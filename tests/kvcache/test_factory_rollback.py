"""A failed ``build_kv_cache_manager`` leaves nothing on the caller's pool: no ``kv`` tenant, the
arena space and every page it backed given back, no host buffer — with a failure injected at
each construction step (the region's backing, the allocator, the prefix cache, HK-05, HK-07,
the host buffer, the host tier, the manager's own checks). After each, the same call without
the failure succeeds on the same pool."""

from __future__ import annotations

import pytest

from tests.kvcache.conftest import toy_layout
from xllm_vmm.kvcache import build_kv_cache_manager
from xllm_vmm.kvcache import manager as manager_mod
from xllm_vmm.pool import BudgetConfig, VmmPool
from xllm_vmm.vmm.sim import SimDriver

MiB = 1 << 20
PAGE = 2 * MiB
BS = 4


class Boom(RuntimeError):
    pass


def _raise(*a, **kw):
    raise Boom("injected")


class CountingHost:
    """Wraps a driver: counts host buffers (alloc_host / free_host)."""

    def __init__(self, d):
        self._d = d
        self.live: set[int] = set()
        self.fail = False

    def __getattr__(self, name):
        return getattr(self._d, name)

    def alloc_host(self, nbytes):
        if self.fail:
            raise MemoryError("injected host allocation failure")
        a = self._d.alloc_host(nbytes) if hasattr(self._d, "alloc_host") else 0x1000 + len(
            self.live)
        self.live.add(a)
        return a

    def free_host(self, address):
        self.live.remove(address)
        if hasattr(self._d, "free_host"):
            self._d.free_host(address)


def _snapshot(pool, d):
    return (pool.has_tenant("kv"), pool.arena_bytes_left(), pool.held_bytes, pool.mapped_bytes,
            d.created_bytes, d.mapped_bytes)


STEPS = ["backing", "allocator", "prefix", "hk05", "hk07", "host_buffer", "host_tier",
         "manager"]


@pytest.mark.parametrize("step,mode", [(s, m) for s in STEPS for m in ("elastic", "fixed")
                                       if (s, m) != ("backing", "elastic")])  # elastic backs
def test_a_failed_factory_leaves_nothing_on_the_pool(step, mode, monkeypatch):  # nothing at start
    d = SimDriver(256 * MiB)
    host_drv = CountingHost(d)
    layout = toy_layout(layers=1, blocks_per_page=4, block_size=BS)
    pool = VmmPool(d, BudgetConfig(mode=mode, max_cache_size=24 * PAGE,
                                   execution_peak_bytes=0), 32 * PAGE)
    other = pool.add_tenant("weights", 4 * PAGE, end="high")  # another tenant stays put
    before = _snapshot(pool, d)
    kw = dict(enable_prefix_cache=True, host_blocks_factor=2.0, max_tokens=8 * 4 * BS,
              driver=host_drv, host_populate=False, compact=False)
    expect: type[BaseException] = Boom
    match = "injected"
    with monkeypatch.context() as mp:
        if step == "backing":
            d.fail_nth("create", 3)  # the third page of the region's whole backing
            expect, match = Exception, "failure"
        elif step == "allocator":
            mp.setattr("xllm_vmm.kvcache.cache.BlockAllocator.__init__", _raise)
        elif step == "prefix":
            mp.setattr(manager_mod.PrefixCache, "__init__", _raise)
        elif step == "hk05":
            kw["vision"] = True  # the host tier refuses a vision model's KV (HK-05)
            expect, match = Exception, "host_blocks_factor"
        elif step == "hk07":
            kw["host_available_bytes"] = 1
            expect, match = Exception, "host"
        elif step == "host_buffer":
            host_drv.fail = True
            expect = MemoryError
        elif step == "host_tier":
            mp.setattr(manager_mod.HostTier, "__init__", _raise)
        elif step == "manager":
            kw["compact_min_slots"] = 0
            expect, match = ValueError, "compact_min_slots"
        with pytest.raises(expect, match=match):
            build_kv_cache_manager(pool, layout, **kw)
    assert _snapshot(pool, d) == before
    assert not host_drv.live, "a host buffer was left allocated"
    assert pool.region("weights") == other
    kw.pop("vision", None)
    kw.pop("host_available_bytes", None)
    kw["compact_min_slots"] = 2
    host_drv.fail = False
    m = build_kv_cache_manager(pool, layout, **kw)  # the same call now succeeds
    assert m.allocate("a", 9) == {"attn": [0, 1, 2]}
    m.close()
    assert not host_drv.live
    pool.close()
    d.close()


def test_an_existing_kv_tenant_is_not_removed_by_a_refused_call():
    d = SimDriver(64 * MiB)
    pool = VmmPool(d, BudgetConfig(max_cache_size=8 * PAGE, execution_peak_bytes=0), 16 * PAGE)
    layout = toy_layout(layers=1, blocks_per_page=4, block_size=BS)
    m = build_kv_cache_manager(pool, layout, enable_prefix_cache=True, max_tokens=16 * BS)
    region = m.cache.region
    with pytest.raises(Exception, match="already has a region"):
        build_kv_cache_manager(pool, layout, enable_prefix_cache=True, max_tokens=16 * BS)
    assert pool.region("kv") is region
    assert m.allocate("a", 4) == {"attn": [0]}
    m.close()
    pool.close()
    d.close()

