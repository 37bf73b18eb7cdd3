"""KVCacheManager through its verbs: exact block ids, eviction order, admission, "not now",
compaction applied to the tables, host restores, sleep / wake-up, the factory.

A tiny cache: one group ``attn`` (one layer, K and V), 4 tokens per block, 4 blocks per 2 MiB
page (slot); the pool's quota counts slots (``budget_slots``)."""

from __future__ import annotations

import ctypes

import pytest

from tests.kvcache.conftest import PAGE, toy_layout
from tests.pool.drivers import make_driver
from xllm_vmm.kvcache import (
    KVCacheManager,
    KVCacheManagerError,
    PrefixMatch,
    build_kv_cache_manager,
)
from xllm_vmm.pool import BudgetConfig, VmmPool
from xllm_vmm.vmm import CopyKind

BS = 4
MiB = 1 << 20
SLOT = 2 * PAGE  # one slot = one page per tensor (K and V)


def toks(*blocks: int, tail: int = 1) -> list[int]:
    """Whole blocks of distinct tokens (block ``b`` holds ``b*100 + i``) and ``tail`` more."""
    out: list[int] = []
    for b in blocks:
        out += [b * 100 + i for i in range(BS)]
    return out + [7] * tail


class Env:
    """driver → elastic pool (quota ``budget_slots`` slots) → manager of ``slots`` slots."""

    def __init__(self, kind: str = "sim", *, budget_slots: int = 4, slots: int = 8,
                 prefix: bool = True, host_factor: float = 0.0, **tuning) -> None:
        self.driver = make_driver(kind, 64 * MiB)
        layout = toy_layout(layers=1, blocks_per_page=4, block_size=BS)
        self.pool = VmmPool(self.driver, BudgetConfig(max_cache_size=budget_slots * SLOT,
                                                      execution_peak_bytes=0),
                            slots * SLOT)
        tuning.setdefault("compact", False)
        if host_factor:
            tuning.setdefault("host_populate", False)
        self.mgr = build_kv_cache_manager(self.pool, layout, enable_prefix_cache=prefix,
                                          host_blocks_factor=host_factor,
                                          max_tokens=slots * 4 * BS, **tuning)

    def close(self) -> None:
        self.mgr.close()
        self.pool.close()
        self.driver.close()

    def run(self, rid: str, tokens: list[int]) -> dict[str, list[int]]:
        """Look up, allocate the whole prompt, commit it; returns the tables."""
        hit = self.mgr.lookup(rid, tokens)
        t = self.mgr.allocate(rid, len(tokens) - hit.num_tokens, hit=hit)
        assert t is not None
        while not self.mgr.ready(rid):
            self.mgr.step()
        self.mgr.commit(rid, len(tokens), tokens)
        return {g: list(v) for g, v in t.items()}

    # block contents (a tag per block, read back through the tables)
    def write(self, block: int, tag: int) -> None:
        geo = self.mgr.cache.geometry["attn"]
        nb = geo.group.tensor_block_bytes
        buf = (ctypes.c_char * nb)()
        for t in range(geo.num_tensors):
            ctypes.memset(buf, (tag + 7 * t) & 0xFF, nb)
            self.driver.copy(self.mgr.cache.block_address("attn", t, block),
                             ctypes.addressof(buf), nb, CopyKind.H2D)

    def read(self, block: int) -> set[int]:
        geo = self.mgr.cache.geometry["attn"]
        nb = geo.group.tensor_block_bytes
        buf = (ctypes.c_char * nb)()
        out = set()
        for t in range(geo.num_tensors):
            self.driver.copy(ctypes.addressof(buf),
                             self.mgr.cache.block_address("attn", t, block), nb, CopyKind.D2H)
            out |= {(x - 7 * t) & 0xFF for x in bytes(buf)}
        return out


def test_fresh_request_block_ids_and_decode_growth(env):
    e = env(prefix=False)
    m = e.mgr
    assert (m.block_size, m.group_names) == (BS, ("attn",))
    hit = m.lookup("a", toks(1, 2))
    assert (hit.num_tokens, hit.num_device_tokens, hit.num_host_tokens) == (0, 0, 0)
    assert m.allocate("a", 9, hit=hit) == {"attn": [0, 1, 2]}
    m.commit("a", 9, toks(1, 2))
    assert m.allocate("a", 1) == {"attn": [0, 1, 2]}  # 10 tokens: still 3 blocks
    m.commit("a", 12, toks(1, 2, tail=4))
    assert m.allocate("a", 1) == {"attn": [0, 1, 2, 3]}
    assert m.allocate("a", 1, lookahead=4) == {"attn": [0, 1, 2, 3, 4]}  # next slot
    assert m.block_tables("a") is m.block_tables("a")
    b = m.allocate("b", 5)  # no lookup: no hit
    assert b == {"attn": [5, 6]}
    m.free("a")
    assert m.allocate("c", 4) == {"attn": [4]}  # the slot of a's last block is still mapped
    m.check_invariants()


def test_prefix_hit_reuses_blocks_and_keeps_last_token_computed(env):
    e = env()
    m = e.mgr
    assert e.run("a", toks(1, 2)) == {"attn": [0, 1, 2]}
    m.free("a")  # 0 and 1 published → cached; 2 (partial) freed
    hit = m.lookup("b", toks(1, 2, 3))
    assert (hit.num_tokens, hit.num_device_tokens) == (8, 8)
    t = m.allocate("b", 5, hit=hit)
    assert t == {"attn": [0, 1, 2, 3]}
    exact = m.lookup("c", toks(1, 2, tail=0))  # 8 tokens: the last one is always computed
    assert exact.num_tokens == 4
    st = m.stats()
    assert (st["prefix_queries"], st["prefix_hits"], st["prefix_hit_tokens"]) == (3, 2, 12)
    m.drop("c")
    m.check_invariants()


def test_eviction_order_lru_tail_first_whole_slots(env):
    """A request's blocks are released tail first: under pressure its last blocks go before
    its prefix; slot-emptying eviction gives up a whole evictable slot."""
    e = env(budget_slots=2)
    m = e.mgr
    e.run("a", toks(1, 2, 3, tail=0))  # blocks 0,1,2 (slot 0)
    m.free("a")  # cached: 0,1,2 (LRU order: 2, 1, 0)
    assert m.prefix.lru_order("attn") == [2, 1, 0]
    e.run("b", toks(4, 5, 6, 7, 8, tail=0))  # 3 and slot 1 (4..7): no eviction yet
    assert m.block_tables("b") == {"attn": [3, 4, 5, 6, 7]}
    assert m.stats()["evictions"] == 0
    # c needs 2 blocks: no free block, no slot left in the budget → evict, LRU, tail first
    assert m.allocate("c", 8) == {"attn": [1, 2]}  # evicted 2 then 1; the last freed first
    assert m.stats()["evictions"] == 2
    assert m.prefix.lru_order("attn") == [0]
    hit = m.lookup("d", toks(1, 2, 3))
    assert hit.num_tokens == 4  # only block 0 (tokens 0..3) is left of a's prefix
    m.check_invariants()


def test_a_shortfall_is_evicted_by_exact_lru_and_a_fresh_history_survives(env):
    """The shortfall goes by exact LRU: a history released last stays a hit even when it
    shares a slot with the oldest cached block (giving that slot up whole would free a page
    but lose the history, which exact LRU keeps)."""
    e = env(budget_slots=2)
    m = e.mgr
    e.run("a", toks(1, tail=0))  # block 0
    m.free("a")
    e.run("h", toks(2, 3, 4, tail=0))  # blocks 1, 2, 3: slot 0 full
    e.run("r", toks(5, 6, 7, 8, tail=0))  # slot 1, still running
    m.free("h")
    assert m.prefix.lru_order("attn") == [0, 3, 2, 1]
    assert m.allocate("c", 4) == {"attn": [0]}  # one block short: block 0 alone goes
    assert m.stats()["evictions"] == 1 and m.prefix.lru_order("attn") == [3, 2, 1]
    assert m.lookup("h2", toks(2, 3, 4, 9)).num_tokens == 12  # the whole history hits
    m.check_invariants()


def test_not_now_changes_nothing_and_keeps_the_hit(env):
    e = env(budget_slots=1)
    m = e.mgr
    e.run("a", toks(1, tail=0))
    m.free("a")
    hit = m.lookup("b", toks(1, 2, 3, 4, 5, 6))  # 1 block hit, needs 6 more: 7 > 4 blocks
    assert hit.num_tokens == 4
    assert m.allocate("b", 21, hit=hit) is None
    assert m.block_tables("b") == {"attn": []}
    assert m.cache.allocator.ref_count("attn", 0) == 1  # still held
    assert m.allocate("b", 1, hit=hit) == {"attn": [0, 1]}  # retry with a smaller chunk
    m.check_invariants()


def test_fresh_chunk_admitted_on_whole_prompt(env):
    """AD-04: the first chunk fits, the whole prompt does not → not now."""
    e = env(budget_slots=1, prefix=False)
    m = e.mgr
    hit = m.lookup("a", list(range(40)))
    assert m.allocate("a", 8, hit=hit, num_prompt_tokens=40) is None
    assert m.allocate("a", 8, hit=hit, num_prompt_tokens=16) == {"attn": [0, 1]}
    m.commit("a", 8, list(range(16)))
    assert m.allocate("a", 8) == {"attn": [0, 1, 2, 3]}
    m.commit("a", 16, list(range(16)))
    assert m.allocate("a", 1) is None  # a 5th block needs a second slot: not now
    assert m.block_tables("a") == {"attn": [0, 1, 2, 3]}


def test_hit_must_be_the_held_one(env):
    m = env().mgr
    h1 = m.lookup("a", toks(1, 2))
    m.lookup("b", toks(1, 2))
    with pytest.raises(KVCacheManagerError, match="not the one lookup"):
        m.allocate("b", 9, hit=h1)
    h2 = m.lookup("a", toks(1, 2))  # replaces h1
    with pytest.raises(KVCacheManagerError, match="not the one lookup"):
        m.allocate("a", 9, hit=h1)
    assert isinstance(h2, PrefixMatch) and m.allocate("a", 9, hit=h2) is not None
    with pytest.raises(KVCacheManagerError, match="unknown request"):
        m.block_tables("zz")
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate("a", -1)


def test_commit_publishes_only_complete_blocks(env):
    """Chunked prefill: a block is published once all its tokens are committed."""
    e = env()
    m = e.mgr
    prompt = toks(1, 2, 3)
    m.lookup("a", prompt)
    m.allocate("a", 6, num_prompt_tokens=len(prompt))
    m.commit("a", 6, prompt)  # block 0 complete, block 1 half
    assert m.lookup("x", prompt).num_tokens == 4
    m.drop("x")
    m.allocate("a", 7)
    m.commit("a", 13, prompt)
    assert m.lookup("y", prompt).num_tokens == 12
    m.drop("y")
    out = prompt + [9, 9, 9]  # decode: generated tokens complete block 3
    m.allocate("a", 3)
    m.commit("a", 16, out)
    assert m.lookup("z", out + [1]).num_tokens == 16
    with pytest.raises(ValueError, match="num_computed_tokens"):
        m.commit("a", 99, out)


def test_compaction_in_step_rewrites_tables_and_keeps_data(env):
    e = env("host", budget_slots=8, slots=8, compact=True, compact_min_slots=1)
    m = e.mgr
    # four requests growing one block at a time interleave in slots 0..3
    for r in range(4):
        m.allocate(f"r{r}", 4)
    for _ in range(3):
        for r in range(4):
            m.allocate(f"r{r}", 4 * len(m.block_tables(f"r{r}")["attn"]) + 4 -
                       m.num_computed_tokens(f"r{r}"))
    for r in range(4):
        for i, b in enumerate(m.block_tables(f"r{r}")["attn"]):
            e.write(b, 10 * r + i)
    for r in (1, 2, 3):
        m.free(f"r{r}")
    before = m.stats()["mapped_bytes"]
    table = m.block_tables("r0")["attn"]
    spread = {b // 4 for b in table}
    m.step()
    assert m.stats()["compactions"] == 1
    assert m.block_tables("r0")["attn"] is table  # the same list, rewritten in place
    assert len({b // 4 for b in table}) < len(spread) or len(spread) == 1
    assert m.stats()["mapped_bytes"] < before
    assert [e.read(b) for b in table] == [{i} for i in range(4)]
    m.check_invariants()


def test_host_tier_restore_into_new_blocks(env):
    e = env("host", budget_slots=1, host_factor=4.0)
    m = e.mgr
    e.run("a", toks(1, 2, tail=0))  # blocks 0, 1
    for i, b in enumerate(m.block_tables("a")["attn"]):
        e.write(b, 50 + i)
    m.free("a")
    m.step()  # write-through offload of both blocks
    m.host.wait_all()
    assert m.stats()["host_offloaded_blocks"] == 2
    e.run("b", toks(8, 9, 10, 11, tail=0))  # the whole slot: evicts both of a's blocks
    m.free("b")
    hit = m.lookup("c", toks(1, 2, 3))
    assert (hit.num_device_tokens, hit.num_host_tokens) == (0, 8)
    t = m.allocate("c", 5, hit=hit)
    assert t is not None and len(t["attn"]) == 4
    while not m.ready("c"):
        m.step()
    assert m.num_computed_tokens("c") == 8
    assert [e.read(b) for b in t["attn"][:2]] == [{50}, {51}]
    assert m.stats()["host_restored_blocks"] == 2
    m.check_invariants()


def test_sleep_and_wake_up(env):
    e = env()
    m = e.mgr
    e.run("a", toks(1, 2))
    with pytest.raises(KVCacheManagerError, match="still hold KV blocks"):
        m.sleep()
    m.free("a")
    assert m.sleep() == SLOT  # one slot (K and V pages) was mapped
    assert e.pool.mapped_bytes == 0 and m.is_sleeping()
    with pytest.raises(KVCacheManagerError, match="asleep"):
        m.allocate("b", 4)
    m.wake_up()
    m.wake_up()
    assert m.allocate("b", 4) == {"attn": [0]}


def test_factory_errors_and_sizing():
    from xllm_vmm.vmm.sim import SimDriver

    d = SimDriver(64 * MiB)
    pool = VmmPool(d, BudgetConfig(max_cache_size=4 * SLOT, execution_peak_bytes=0), 8 * SLOT)
    layout = toy_layout(layers=1, blocks_per_page=4, block_size=BS)
    with pytest.raises(TypeError, match="unknown tuning parameter.*compact_min_slot\\b"):
        build_kv_cache_manager(pool, layout, enable_prefix_cache=True, compact_min_slot=2)
    m = build_kv_cache_manager(pool, layout, enable_prefix_cache=True)  # sized from the pool
    assert isinstance(m, KVCacheManager)
    assert m.capacity().total_tokens == 4 * 4 * BS  # the quota: 4 slots of 4 blocks
    assert m.capacity().available_tokens == 4 * 4 * BS
    assert m.usage() == 0.0
    m.allocate("a", 8)
    assert m.usage() == pytest.approx(2 / 16)
    m.close()
    pool.close()


def test_target_and_draft_groups_behind_the_same_verbs():
    """SD-01: both groups allocated, published, hit and evicted together; block ids per group
    follow each group's own blocks per slot (4 for the target, 2 for the draft)."""
    from xllm_vmm.vmm.sim import SimDriver

    d = SimDriver(256 * MiB)
    layout = toy_layout(layers=1, blocks_per_page=4, block_size=BS, draft_blocks_per_page=2)
    pool = VmmPool(d, BudgetConfig(max_cache_size=3 * SLOT, execution_peak_bytes=0), 64 * SLOT)
    m = build_kv_cache_manager(pool, layout, enable_prefix_cache=True, max_tokens=16 * BS,
                               compact=False)
    try:
        assert m.group_names == ("attn", "draft")
        hit = m.lookup("a", toks(1, 2))
        t = m.allocate("a", 9, hit=hit)
        assert t == {"attn": [0, 1, 2], "draft": [0, 1, 2]}  # draft: slots 0 and 1
        m.commit("a", 9, toks(1, 2))
        m.free("a")
        hit = m.lookup("b", toks(1, 2, 3))
        assert hit.num_tokens == 8
        assert m.allocate("b", 5, hit=hit) == {"attn": [0, 1, 2, 3], "draft": [0, 1, 2, 3]}
        m.free("b")  # 0, 1, 2 published in both groups; 3 (partial) freed
        # the budget (3 slots) holds slot 0 of attn and slots 0, 1 of draft: a new prompt of
        # 3 blocks needs a draft slot, so cached blocks go — the hashes leave both groups
        assert m.allocate("c", 12) is not None
        assert m.stats()["prefix_evictions"] > 0
        hit = m.lookup("d", toks(1, 2, 3))
        for g in m.group_names:  # whatever is still hit is hit in both groups
            assert len(m.prefix.lookup(block_hashes_of(toks(1, 2, 3)), record=False).blocks[g]) \
                == hit.num_device_tokens // BS
        m.drop("d")
        m.check_invariants()
    finally:
        m.close()
        pool.close()
        d.close()


def block_hashes_of(tokens):
    from xllm_vmm.kvcache.hashing import block_hashes

    return block_hashes(tokens, BS)
