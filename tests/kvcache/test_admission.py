"""Admission: demand per group (AD-01), minimum across workers (AD-02), sequence slots (AD-03),
whole prompt for prefill and per-block growth for decode (AD-04)."""

from __future__ import annotations

import pytest

from tests.kvcache.conftest import PAGE, KeepAll, toy_layout
from xllm_vmm.kvcache import Admission, SequenceSlots, VirtualKVCache, blocks_for_tokens
from xllm_vmm.models.spec import CacheGroup, CacheLayout, CacheTensor, ResidentState
from xllm_vmm.pool import BudgetConfig, VmmPool
from xllm_vmm.vmm.sim import SimDriver

MiB = 1 << 20


def worker(device_mib, layout, tokens=2048):
    d = SimDriver(device_mib * MiB)
    pool = VmmPool(d, BudgetConfig(execution_peak_bytes=0),
                   VirtualKVCache.arena_bytes(layout, PAGE, tokens))
    return d, VirtualKVCache.for_tokens(pool, layout, tokens)


def test_demand_uses_each_groups_layout_and_the_sliding_cap():
    lay = toy_layout(block_size=16, draft_blocks_per_page=8)
    _, c = worker(64, lay)
    assert c.demand(33) == {"attn": 3, "draft": 3}
    sliding = CacheGroup("sliding", (CacheTensor("l0.k", 64),), 16, max_tokens_per_seq=40)
    assert blocks_for_tokens(sliding, 1000) == 4  # ceil(40 / 16) + 1
    assert blocks_for_tokens(sliding, 20) == 2


def test_prefill_is_checked_against_the_whole_prompt_and_by_bytes_across_groups():
    lay = toy_layout(layers=2, blocks_per_page=4, block_size=16, draft_blocks_per_page=8)
    # 40 MiB: attn slot 8 MiB (64 tokens), draft slot 4 MiB (128 tokens)
    _, c = worker(40, lay)
    adm = Admission([c])
    # 256 tokens: attn 4 slots (32 MiB) + draft 2 slots (8 MiB) = 40 MiB: fits exactly
    assert adm.check_prefill(256).admit
    d = adm.check_prefill(257)
    assert (d.admit, d.demand, d.worker) == (False, {"attn": 17, "draft": 17}, 0)
    assert "needs 54525952 bytes of new slots, the live budget allows 41943040" in d.reason
    assert adm.available_tokens() == 256
    # blocks already held (a prefix hit) are not demanded again
    assert adm.check_prefill(257, held={"attn": 1, "draft": 1}).admit


def test_decode_growth_needs_blocks_only_when_a_block_boundary_is_crossed():
    lay = toy_layout(block_size=16)
    _, c = worker(64, lay)
    adm = Admission([c])
    assert adm.check_growth(20, 5).demand == {"attn": 0}
    assert adm.check_growth(20, 13).demand == {"attn": 1}
    assert adm.check_growth(0, 40).demand == {"attn": 3}


def test_minimum_across_workers_with_unequal_capacity():
    lay = toy_layout(layers=2, blocks_per_page=4, block_size=16)  # 8 MiB per 64 tokens
    _, big = worker(64, lay)
    _, small = worker(24, lay)
    adm = Admission([big, small])
    assert adm.available_tokens() == 192  # small worker: 3 slots
    d = adm.check_prefill(193)
    assert (d.admit, d.worker) == (False, 1)
    assert adm.check_prefill(192).admit
    # the small worker fills up: its free blocks count, then nothing more
    got = small.allocator.allocate({"attn": 11})
    assert got is not None and adm.available_tokens() == 16
    big.allocator.allocate({"attn": 1})
    assert adm.available_tokens() == 16


def test_free_blocks_and_evictable_blocks_count_as_available():
    lay = toy_layout(layers=2, blocks_per_page=4, block_size=16)
    _, c = worker(16, lay)  # two slots
    p = KeepAll(c.allocator)
    x = p.allocate({"attn": 5})["attn"]  # slot 0 full, slot 1 one block
    assert c.capacity({"attn": p.num_evictable("attn")}).fits({"attn": 3})
    assert not c.capacity({"attn": p.num_evictable("attn")}).fits({"attn": 4})
    p.free({"attn": x})  # all five cached (evictable)
    cap = c.capacity({"attn": p.num_evictable("attn")})
    assert cap.fits({"attn": 8}) and not cap.fits({"attn": 9})
    assert not c.capacity().fits({"attn": 8})  # without the evictable count: 3 free blocks
    assert p.allocate({"attn": 8}) is not None  # evicts the cached blocks to get there


def test_sequence_slots_are_needed_for_a_new_sequence_but_not_for_growth():
    lay = toy_layout()
    _, c = worker(64, lay)
    state = SequenceSlots.for_resident(ResidentState(conv_bytes_per_seq=100,
                                                     recurrent_bytes_per_seq=900), max_seqs=2)
    mtp = SequenceSlots("mtp_embedding", 3)
    assert state.reserved_bytes == 2000
    adm = Admission([c], [state, mtp])
    assert state.acquire() == 0 and state.acquire() == 1 and state.acquire() is None
    d = adm.check_prefill(10)
    assert (d.admit, d.reason) == (False, "sequence slots: no free linear_state slot")
    assert adm.available_tokens() == 0
    assert adm.check_growth(10, 100).admit
    state.release(0)
    assert adm.check_prefill(10).admit
    with pytest.raises(ValueError, match="linear_state: slot 0 is not held"):
        state.release(0)


def test_hybrid_layout_counts_only_full_attention_groups():
    attn = CacheGroup("attn", tuple(CacheTensor(f"l{i}.{kv}", 1024) for i in (3, 7)
                                    for kv in "kv"), 16)
    lay = CacheLayout("hybrid", 1, (attn,), resident=ResidentState(4096, 65536))
    _, c = worker(64, lay)
    assert c.demand(100) == {"attn": 7}
    assert list(c.geometry) == ["attn"]
