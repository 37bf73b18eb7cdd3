"""One block-table space over two workers: slot maps all or nothing, admission by the
smaller worker (AD-02). Each worker's device is emulated with its own size
(``worker_device_memory``); the plan — and so the cache geometry — is the same for both."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import BASE
from xllm_vmm.engine.llm_engine import LLMEngine
from xllm_vmm.engine.sampling_params import SamplingParams

ELASTIC = {"enable_vmm_kvcache": True, "vmm_elastic": True, "nnodes": 2}
BIG, SMALL = "64MiB", "20MiB"  # SMALL: after the execution headroom, less than one slot


def engine(model, mem):
    return LLMEngine.from_flags(str(model), **BASE, **ELASTIC, worker_device_memory=mem)


def kv_mapped(eng) -> list[int]:
    return [s["kv_mapped_bytes"] for s in eng.distributed.refresh()]


@pytest.mark.parametrize("mem", [[BIG, SMALL], [SMALL, BIG]], ids=["follower-small", "driver-small"])
def test_failed_map_on_one_worker_rolls_back_on_both(llama_dir, mem):
    eng = engine(llama_dir, mem)
    try:
        cache = eng.kv_cache_manager.cache
        backing = cache.allocator.backing
        assert kv_mapped(eng) == [0, 0]
        assert backing.activate({"attn": [0]}) is False  # "not now" on one worker
        assert kv_mapped(eng) == [0, 0]  # nothing stays mapped on either
        assert not cache.check_mapped("attn", 0)
    finally:
        eng.shutdown()


def test_maps_land_on_every_worker(llama_dir):
    eng = engine(llama_dir, [BIG, BIG])
    try:
        cache = eng.kv_cache_manager.cache
        slot = cache.geometry["attn"].slot_bytes
        backing = cache.allocator.backing
        assert backing.activate({"attn": [0, 1]}) is True
        assert kv_mapped(eng) == [2 * slot, 2 * slot]
        bps = cache.geometry["attn"].blocks_per_slot
        assert backing.move({"attn": [(0, bps), (1, bps + 1)]}) is True  # compaction copies, both
        backing.deactivate({"attn": [0, 1]})
        assert kv_mapped(eng) == [0, 0]
        # the engine's own allocations go the same way: a request maps a slot on both
        eng.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        eng.step()
        assert kv_mapped(eng) == [slot, slot]
    finally:
        eng.shutdown()


def test_admission_uses_the_smaller_worker(llama_dir):
    eng = engine(llama_dir, [BIG, SMALL])
    try:
        follower = eng.distributed.worker_stats()[1]
        slot = eng.kv_cache_manager.cache.geometry["attn"].slot_bytes
        # rank 0 alone could take the request; the cap is the follower's budget
        assert eng.pool.budget_left_bytes() >= slot > follower["budget_left_bytes"]
        assert eng.pool.peer_budget_left_bytes == follower["budget_left_bytes"]
        eng.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        for _ in range(4):
            assert eng.step() == []
        assert (eng.num_waiting, eng.num_running) == (1, 0)  # held, not failed
        assert eng.scheduler.capacity_finished == 0
        assert eng.pool.failed_maps == 0  # refused by admission, before any map
        assert kv_mapped(eng) == [0, 0]
        eng.abort_request("r")
    finally:
        eng.shutdown()
