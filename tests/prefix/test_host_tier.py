"""Host KV tier on fakes: byte-exact restore, cancel during offload/restore, copy failures,
HK-06 sizing and the HK-07 refusal."""

import pytest

from xllm_vmm.kvcache.hashing import block_hashes
from xllm_vmm.kvcache.host_pool import (
    HostPool,
    HostPoolTooLarge,
    check_host_pool_fits,
    host_pool_size,
)
from xllm_vmm.kvcache.host_tier import HostTier
from xllm_vmm.kvcache.prefix import PrefixCache
from xllm_vmm.vmm.driver import CopyKind
from tests.prefix.fakes import FakeAllocator, FakeGroup, ManualDriver, Runner

BS = 4
TBB = 16  # bytes per block per tensor; 2 tensors -> 32 bytes per block per group


def make(host_blocks=8, budget=2, bps=2, groups=("attn",), auto=True):
    fg = {g: FakeGroup(blocks_per_slot=bps, num_slots=8, tensor_block_bytes=TBB) for g in groups}
    alloc = FakeAllocator(fg, budget)
    prefix = PrefixCache(alloc.allocator, {g: 2 * TBB for g in groups}, BS)
    alloc.policy = prefix
    size = host_pool_size(host_blocks * 2 * TBB * len(groups), 1.5, 2 * TBB * len(groups))
    pool = HostPool(size)
    driver = ManualDriver(auto_complete=auto)
    tier = HostTier(prefix, pool, driver, alloc)
    return alloc, prefix, pool, driver, tier, Runner(alloc, prefix, BS, host=tier)


def toks(*blocks, tail=1):
    out = []
    for b in blocks:
        out += [b * 100 + i for i in range(BS)]
    return out + [7] * tail


def test_host_pool_sizing_hk06():
    s = host_pool_size(device_capacity_bytes=1000, host_blocks_factor=2.5, host_block_bytes=64)
    assert (s.blocks, s.bytes) == (39, 39 * 64)  # floor(2500 / 64)
    assert host_pool_size(1000, 1.0, 64).blocks == 0  # factor <= 1: no host tier (HK-03)
    with pytest.raises(ValueError, match="HK-08"):
        host_pool_size(1000, -1, 64)


def test_host_pool_too_large_is_refused_with_numbers_hk07():
    s = host_pool_size(device_capacity_bytes=8 << 30, host_blocks_factor=4, host_block_bytes=1 << 20)
    with pytest.raises(HostPoolTooLarge) as ei:
        check_host_pool_fits(s, available_bytes=16 << 30)
    msg = str(ei.value)
    assert "HK-07" in msg and "34359738368 bytes (32.00 GiB" in msg
    assert "17179869184 bytes (16.00 GiB)" in msg
    assert "host_blocks_factor to at most 2.000" in msg
    assert "max_cache_size <= 4294967296 bytes" in msg
    check_host_pool_fits(s, available_bytes=32 << 30)  # fits exactly


def test_write_through_on_release_copies_every_complete_block():
    alloc, prefix, pool, driver, tier, run = make()
    a = run.start(toks(1, 2))
    run.compute(a)
    assert tier.stats.offload_queued == 0  # a running request's blocks are never copied
    run.finish(a)
    assert [t.kind for t in driver.transfers] == [CopyKind.D2H]
    tier.poll()
    assert tier.stats.offloaded_blocks == 2 and tier.stats.offloaded_bytes == 64
    # released tail first, so the last block was queued (and got host block 0) first
    assert [pool.lookup(h) for h in a.hashes] == [1, 0]
    for j, h in enumerate(a.hashes):
        hb = pool.lookup(h)
        assert pool.buffer.view(pool.address(hb) - pool.buffer.address, 32) == \
            alloc.read_block("attn", a.blocks["attn"][j])


def test_restore_after_device_eviction_is_byte_exact():
    alloc, prefix, pool, driver, tier, run = make(budget=2, bps=2)
    a = run.start(toks(1, 2, tail=0))
    run.compute(a)
    original = [alloc.read_block("attn", b) for b in a.blocks["attn"]]
    run.finish(a)
    tier.poll()
    # fill the device with other prompts: a's blocks are evicted
    for k in (3, 5):
        r = run.start(toks(k, k + 1, tail=0))
        run.compute(r)
        run.finish(r)
    tier.poll()
    hs = block_hashes(toks(1, 2, tail=0), BS)
    assert prefix.lookup(hs, record=False).num_blocks == 0
    # scribble over the whole device so a restore that copies nothing cannot pass
    for g in alloc.mem.values():
        for t in g:
            for i in range(len(t)):
                t[i] = b"\xee"
    b = run.start(toks(1, 2, 9))
    assert b.hit == 0 and b.restore.num_blocks == 2
    assert b.restore.wait() is True
    assert [alloc.read_block("attn", x) for x in b.blocks["attn"][:2]] == original
    # the restored blocks are device hits now
    assert prefix.lookup(hs, record=False).blocks["attn"] == tuple(b.blocks["attn"][:2])
    assert tier.stats.restored_blocks == 2 and tier.stats.restored_bytes == 64


def test_cancel_during_offload_keeps_device_blocks_until_copy_ends():
    alloc, prefix, pool, driver, tier, run = make(auto=False)
    a = run.start(toks(1, 2, tail=0))
    run.compute(a)
    run.finish(a)
    assert len(driver.transfers) == 1 and tier.in_flight == 1
    assert prefix.pin_count("attn", 0) == 1 and prefix.num_evictable("attn") == 0
    assert prefix.evict("attn", 2) == []
    assert prefix.reset() == 0  # operator reset while copying: nothing freed early
    assert sorted(alloc.groups["attn"].ref) == [0, 1]
    driver.transfers[0].complete()
    tier.poll()
    # reset forgot the hashes: the blocks are freed once the copy is done; host keeps them
    assert alloc.groups["attn"].ref == {} and alloc.mapped_total() == 0
    assert pool.indexed == 2 and tier.in_flight == 0


def test_cancel_during_restore_frees_nothing_early_and_leaks_nothing():
    alloc, prefix, pool, driver, tier, run = make(budget=2, bps=2, auto=False)
    a = run.start(toks(1, 2, tail=0))
    run.compute(a)
    run.finish(a)
    driver.complete_all()
    tier.poll()
    prefix.reset()  # device copy gone, host copy stays
    b = run.start(toks(1, 2, 9))
    r = b.restore
    assert r.num_blocks == 2 and not r.done()
    host_blocks = [pool.lookup(h) for h in b.hashes[:2]]
    assert [pool.pin_count(x) for x in host_blocks] == [1, 1]
    r.cancel()
    prefix.release(b.blocks)  # the request is gone
    # device blocks written by the copy are still allocated (cached, pinned)
    assert sorted(alloc.groups["attn"].ref) == sorted(b.blocks["attn"][:2])
    assert prefix.evict("attn", 4) == []
    assert pool.reset() == 0  # pinned host blocks are not dropped
    driver.transfers[-1].complete()
    tier.poll()
    assert r.finished and r.ok and tier.stats.restores_cancelled == 1
    assert [pool.pin_count(x) for x in host_blocks] == [0, 0]
    # the restored content is valid: it stays as ordinary cached blocks
    assert prefix.lookup(b.hashes[:2], record=False).num_blocks == 2
    assert prefix.num_evictable("attn") == 2
    victims = prefix.evict("attn", 2)  # freed by the eviction itself
    assert sorted(victims) == sorted(b.blocks["attn"][:2])
    assert alloc.groups["attn"].ref == {} and alloc.mapped_total() == 0


def test_failed_restore_leaves_blocks_to_compute_and_unpins_everything():
    alloc, prefix, pool, driver, tier, run = make()
    a = run.start(toks(1, 2, tail=0))
    run.compute(a)
    run.finish(a)
    tier.poll()
    prefix.reset()
    driver.fail_next_copy = 1
    b = run.start(toks(1, 2, 9))
    assert b.restore.wait() is False
    assert tier.stats.restore_failures == 2
    assert all(prefix.pin_count("attn", x) == 0 for x in b.blocks["attn"])
    assert all(pool.pin_count(x) == 0 for x in range(pool.capacity))
    run.compute(b)  # recomputes the blocks the restore could not bring back
    run.finish(b)
    assert prefix.lookup(b.hashes, record=False).num_blocks == 3


def test_failed_offload_submit_returns_host_block_and_unpins():
    alloc, prefix, pool, driver, tier, run = make()
    driver.fail_next_submit = 1
    a = run.start(toks(1, 2, tail=0))
    run.compute(a)
    run.finish(a)
    assert tier.stats.offload_failures == 2 and pool.used == 0
    assert prefix.num_evictable("attn") == 2


def test_host_pool_lru_evicts_oldest_unpinned_host_block():
    alloc, prefix, pool, driver, tier, run = make(host_blocks=2, budget=4)
    for k in (1, 3):
        r = run.start(toks(k))
        run.compute(r)
        run.finish(r)
    tier.poll()
    h1 = block_hashes(toks(1), BS)[0]
    h3 = block_hashes(toks(3), BS)[0]
    assert pool.capacity == 3 and pool.lookup(h1) == 0 and pool.lookup(h3) == 1
    for k in (5, 7):
        r = run.start(toks(k))
        run.compute(r)
        run.finish(r)
    tier.poll()
    assert pool.lookup(h1) is None and pool.lookup(h3) == 1 and pool.evictions == 1


def test_blocks_of_an_offload_in_flight_are_not_evictable_until_it_is_reaped():
    """Eviction never calls into the tier: a finished copy unpins its blocks when the tier
    is polled (the manager polls before giving up, between allocation attempts)."""
    alloc, prefix, pool, driver, tier, run = make(auto=False)
    a = run.start(toks(1, 2, tail=0))
    run.compute(a)
    run.finish(a)
    assert prefix.num_evictable("attn") == 0  # pinned by the offload in flight
    assert prefix.evict("attn", 2, prefer_slot_emptying=False) == []  # still copying
    driver.transfers[0].complete()  # done, but nobody polled yet
    assert prefix.evict("attn", 2, prefer_slot_emptying=False) == []
    tier.poll()
    assert prefix.evict("attn", 2, prefer_slot_emptying=False) == [1, 0]
    assert pool.indexed == 2 and tier.in_flight == 0


# ---- de-duplicated restores: a second request joins the restore in flight ------------------

def _on_host_only():
    """Blocks of toks(1, 2) written, offloaded, then dropped from the device (operator reset):
    on the host only. The driver completes copies only when told."""
    alloc, prefix, pool, driver, tier, run = make(budget=4, auto=False)
    a = run.start(toks(1, 2, tail=0))
    run.compute(a)
    original = [alloc.read_block("attn", b) for b in a.blocks["attn"]]
    run.finish(a)
    driver.complete_all()
    tier.poll()
    prefix.reset()
    assert alloc.mapped_total() == 0 and pool.indexed == 2
    return alloc, prefix, pool, driver, tier, run, original


def test_second_restore_of_the_same_hashes_joins_the_copy_in_flight():
    alloc, prefix, pool, driver, tier, run, original = _on_host_only()
    b = run.start(toks(1, 2, 9))
    c = run.start(toks(1, 2, 8))
    assert (b.restore.num_blocks, b.restore.joined) == (2, 0)
    assert (c.restore.num_blocks, c.restore.joined) == (2, 2)
    assert [t.kind for t in driver.transfers] == [CopyKind.D2H]  # restores wait for a poll
    tier.poll()  # ... which submits them (a waiter would run them on its own thread)
    # one host->device copy for both requests; c uses b's blocks, by reference
    assert [t.kind for t in driver.transfers] == [CopyKind.D2H, CopyKind.H2D]
    assert b.blocks["attn"] == [0, 1, 2, 3] and c.blocks["attn"] == [0, 1, 6, 7]
    assert c.restore.blocks == {"attn": [0, 1]}
    g = alloc.groups["attn"]
    assert g.ref == {0: 2, 1: 2, 2: 1, 3: 1, 6: 1, 7: 1}  # c's own 4 and 5 went back at once
    assert alloc.mapped_total() == 3  # and their slot with them
    assert not b.restore.done() and not c.restore.done()
    driver.transfers[1].complete()
    assert c.restore.done() and b.restore.done()
    assert b.restore.ok and c.restore.ok
    assert [alloc.read_block("attn", x) for x in c.blocks["attn"][:2]] == original
    assert tier.stats.restored_blocks == 2 and tier.stats.restored_bytes == 64
    assert tier.stats.restore_joined_blocks == 2
    assert prefix.lookup(block_hashes(toks(1, 2, tail=0), BS), record=False).blocks["attn"] == (0, 1)
    for req in (b, c):
        run.compute(req)
        run.finish(req)
    driver.complete_all()
    tier.poll()
    prefix.reset()
    assert g.ref == {} and alloc.mapped_total() == 0


def test_a_restore_joins_only_the_hashes_in_flight_and_copies_the_rest():
    alloc, prefix, pool, driver, tier, run, original = _on_host_only()
    b = run.start(toks(1, 9))  # restores hash 1 only (block 2 differs)
    c = run.start(toks(1, 2, 8))
    assert (b.restore.num_blocks, c.restore.num_blocks, c.restore.joined) == (1, 2, 1)
    tier.poll()  # submits the deferred restores, in order
    assert [t.kind for t in driver.transfers] == [CopyKind.D2H, CopyKind.H2D, CopyKind.H2D]
    assert c.blocks["attn"][0] == b.blocks["attn"][0]
    driver.transfers[1].complete()
    assert b.restore.done() and not c.restore.done()  # c still waits for its own copy
    driver.transfers[2].complete()
    assert c.restore.done() and c.restore.ok
    assert [alloc.read_block("attn", x) for x in c.blocks["attn"][:2]] == original


@pytest.mark.parametrize("who", ["first", "joiner"])
def test_cancel_of_one_request_the_other_still_completes_nothing_freed_early(who):
    alloc, prefix, pool, driver, tier, run, original = _on_host_only()
    b = run.start(toks(1, 2, 9))
    c = run.start(toks(1, 2, 8))
    gone, stays = (b, c) if who == "first" else (c, b)
    gone.restore.cancel()
    run.finish(gone)  # releases its references right away
    g = alloc.groups["attn"]
    shared = stays.blocks["attn"][:2]
    assert [g.ref[x] for x in shared] == [1, 1]
    assert [prefix.pin_count("attn", x) for x in shared] == [1, 1]
    assert tier.stats.restores_cancelled == 1
    driver.transfers[1].complete()
    assert stays.restore.wait() is True
    assert [alloc.read_block("attn", x) for x in shared] == original
    run.compute(stays)
    run.finish(stays)
    driver.complete_all()
    tier.poll()
    prefix.reset()
    assert g.ref == {} and alloc.mapped_total() == 0
    assert all(pool.pin_count(x) == 0 for x in range(pool.capacity))


def test_cancel_of_both_leaves_nothing_behind():
    alloc, prefix, pool, driver, tier, run, original = _on_host_only()
    b = run.start(toks(1, 2, 9))
    c = run.start(toks(1, 2, 8))
    for req in (b, c):
        req.restore.cancel()
        run.finish(req)
    g = alloc.groups["attn"]
    assert g.ref == {0: 0, 1: 0}  # held by the copy's pins only
    assert alloc.mapped_total() == 1
    driver.transfers[1].complete()
    tier.poll()
    assert b.restore.finished and c.restore.finished and tier.in_flight == 0
    # the copy succeeded: the blocks stay as ordinary cached blocks, evictable
    assert prefix.lru_order("attn") == [0, 1]
    prefix.reset()
    assert g.ref == {} and alloc.mapped_total() == 0
    assert all(pool.pin_count(x) == 0 for x in range(pool.capacity))


def test_failure_of_the_shared_copy_is_seen_by_every_request():
    alloc, prefix, pool, driver, tier, run, original = _on_host_only()
    driver.fail_next_copy = 1
    b = run.start(toks(1, 2, 9))
    c = run.start(toks(1, 2, 8))
    assert c.restore.joined == 2
    tier.poll()  # submits the deferred restore
    driver.transfers[1].complete()
    assert b.restore.wait() is False and c.restore.wait() is False
    assert b.restore.error is c.restore.error and "injected copy failure" in str(b.restore.error)
    assert tier.stats.restore_failures == 2 and tier.stats.restored_blocks == 0
    hs = block_hashes(toks(1, 2, tail=0), BS)
    assert prefix.lookup(hs, record=False).num_blocks == 0  # nothing published
    # both compute the blocks (into the shared blocks) and proceed
    run.compute(b)
    run.compute(c)
    assert [alloc.read_block("attn", x) for x in c.blocks["attn"][:2]] == original
    assert prefix.lookup(hs, record=False).blocks["attn"] == tuple(b.blocks["attn"][:2])
    for req in (b, c):
        run.finish(req)
    driver.complete_all()
    tier.poll()
    prefix.reset()
    assert alloc.groups["attn"].ref == {} and alloc.mapped_total() == 0
    assert all(pool.pin_count(x) == 0 for x in range(pool.capacity))


def test_failed_shared_copy_with_both_cancelled_frees_everything():
    alloc, prefix, pool, driver, tier, run, original = _on_host_only()
    driver.fail_next_copy = 1
    b = run.start(toks(1, 2, 9))
    c = run.start(toks(1, 2, 8))
    for req in (b, c):
        req.restore.cancel()
        run.finish(req)
    driver.transfers[1].complete()
    tier.poll()
    assert not b.restore.ok and not c.restore.ok
    assert alloc.groups["attn"].ref == {} and alloc.mapped_total() == 0
