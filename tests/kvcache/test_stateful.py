"""Property-based stateful test of the pool + virtual KV cache on the simulated driver.

Random sequences of admit / allocate / append / free / touch cached blocks / budget changes /
injected driver failures, with the manager's invariants (docs/architecture.md) checked after every step:

1. every live or cached block has every page under it mapped;
2. pages in use = pages of active slots (slots holding a live or cached block), and the driver
   maps exactly those (no ready band here);
3. growth never takes the pool past free − peak − reserve, nor past the quota; a failed call
   leaves nothing behind;
4. a live (referenced) block is never evicted;
and nothing is left mapped or created after everything is freed.

Compaction is one of the rules: it never maps (held bytes only drop, by what it released),
leaves fewer than one slot's worth of free blocks in every group when uncapped, and the
machine rewrites its block tables with the returned moves. The same machine runs on the host
driver (real memory; the simulated driver's fault injection and external use are off there):
every block gets a tag written into each of its tensors when it is allocated, and every live
or cached block's tags are read back after every step, so a move that lost or mixed contents
fails.
"""

from __future__ import annotations

import os

import ctypes
import struct

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.kvcache.conftest import PAGE, KeepAll, toy_layout
from xllm_vmm.kvcache import Admission, VirtualKVCache
from xllm_vmm.pool import BudgetConfig, VmmPool
from xllm_vmm.vmm import CopyKind, open_driver
from xllm_vmm.vmm.sim import SimDriver

MiB = 1 << 20
DEVICE = 96 * MiB
RESERVE = 4 * MiB
QUOTA = 72 * MiB


class CacheMachine(RuleBasedStateMachine):
    DRIVER = "sim"
    TABLES = ""  # XLLM_VMM_KVTABLE while the cache is built ("": the default, native if built)

    def __init__(self) -> None:
        super().__init__()
        before = os.environ.get("XLLM_VMM_KVTABLE")
        if self.TABLES:
            os.environ["XLLM_VMM_KVTABLE"] = self.TABLES
        try:
            self._build()
        finally:
            if before is None:
                os.environ.pop("XLLM_VMM_KVTABLE", None)
            else:
                os.environ["XLLM_VMM_KVTABLE"] = before

    def _build(self) -> None:
        self.sim = self.DRIVER == "sim"
        self.d = SimDriver(DEVICE) if self.sim else open_driver(self.DRIVER,
                                                                 device_memory=DEVICE)
        self.tags: dict[tuple[str, int], int] = {}  # (group, block) -> tag written into it
        self.next_tag = 1
        self.layout = toy_layout(layers=1, blocks_per_page=4, block_size=8,
                                 draft_blocks_per_page=2)
        cfg = BudgetConfig(mode="elastic", execution_peak_bytes=2 * MiB, reserve_bytes=RESERVE,
                           max_cache_size=QUOTA)
        tokens = 8 * 4 * 12  # attn: 12 slots (2 pages each), draft: 24 slots
        self.pool = VmmPool(self.d, cfg, VirtualKVCache.arena_bytes(self.layout, PAGE, tokens))
        self.c = VirtualKVCache.for_tokens(self.pool, self.layout, tokens)
        from xllm_vmm.kvcache.kvtable import native_available

        assert self.c.allocator.native == (self.TABLES != "python" and native_available())
        self.policy = KeepAll(self.c.allocator)  # the prefix cache's stand-in
        self.adm = Admission([self.c])
        self.seqs: dict[int, tuple[int, dict[str, list[int]]]] = {}  # id -> (tokens, blocks)
        self.next_id = 0
        self.held_before = 0

    def _after_growth_check(self) -> None:
        held = self.pool.held_bytes
        if held > self.held_before:
            assert self.d.mem_info().free >= self.pool.execution_peak.bytes + RESERVE
        assert held <= QUOTA

    def _alloc(self, counts):
        self.held_before = self.pool.held_bytes
        live_before = {(g, b) for _, blocks in self.seqs.values() for g, bs in blocks.items()
                       for b in bs}
        got = self.policy.allocate(counts)  # evicts before a retry, never inside
        self._after_growth_check()
        for g, b in live_before:  # invariant 4: referenced blocks survive any eviction
            assert self.c.allocator.ref_count(g, b) >= 1
        if got is not None:
            for g, n in counts.items():
                assert len(got[g]) == n
                for b in got[g]:
                    self._tag(g, b)
        return got

    # -- contents (host driver: real memory) --------------------------------------------
    def _tag(self, g: str, b: int) -> None:
        if self.sim:
            return
        tag = self.next_tag
        self.next_tag += 1
        self.tags[(g, b)] = tag
        for t in range(self.c.geometry[g].num_tensors):
            buf = ctypes.create_string_buffer(struct.pack("<QQ", tag, t), 16)
            self.d.copy(self.c.block_address(g, t, b), ctypes.addressof(buf), 16, CopyKind.H2D)

    def _driver_bytes(self) -> tuple[int, int]:
        """(mapped, created) bytes as the driver itself counts them."""
        if self.sim:
            return self.d.mapped_bytes, self.d.created_bytes
        st = self.d.stats()
        return st["mapped_bytes"], st["committed_bytes"]

    def _check_tags(self) -> None:
        a = self.c.allocator
        for (g, b), tag in self.tags.items():
            if not (a.ref_count(g, b) or a.is_cached(g, b)):
                continue  # freed: its memory may be gone; a new allocation writes a new tag
            for t in range(self.c.geometry[g].num_tensors):
                buf = ctypes.create_string_buffer(16)
                self.d.copy(ctypes.addressof(buf), self.c.block_address(g, t, b), 16,
                            CopyKind.D2H)
                assert struct.unpack("<QQ", buf.raw) == (tag, t), (g, b, t)

    @rule(tokens=st.integers(1, 120))
    def admit_and_allocate(self, tokens):
        decision = self.adm.check_prefill(tokens)
        got = self._alloc(decision.demand)
        if got is not None:
            self.seqs[self.next_id] = (tokens, got)
            self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.integers(1, 40))
    def append(self, data, new):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, blocks = self.seqs[sid]
        growth = self.adm.check_growth(tokens, new).demand
        got = self._alloc(growth)
        if got is not None:
            for g, bs in got.items():
                blocks[g].extend(bs)
            self.seqs[sid] = (tokens + new, blocks)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        _, blocks = self.seqs.pop(sid)
        self.policy.free(blocks)

    @precondition(lambda self: self.policy.lru)
    @rule(data=st.data())
    def hit_cached_block(self, data):
        g, b = data.draw(st.sampled_from(sorted(self.policy.lru)))
        self.policy.touch(g, b)
        other = "draft" if g == "attn" else "attn"
        self.seqs[self.next_id] = (0, {g: [b], other: []})
        self.next_id += 1

    @precondition(lambda self: len(self.seqs) >= 2)
    @rule(data=st.data())
    def finish_then_compact(self, data):
        """A request ends and the scheduler compacts the lightly loaded cache."""
        self.finish(data)
        self.compact(None)

    @rule(cap=st.none() | st.integers(0, 12))
    def compact(self, cap):
        held = self.pool.held_bytes
        c = self.c.compact(max_blocks=cap)
        assert not c.error
        assert self.pool.held_bytes == held - c.bytes_released  # never maps anything
        for g, moves in c.moves.items():
            self.policy.on_move(g, moves)
            for blocks in (bl for _, bls in self.seqs.values() for bl in (bls.get(g, ()),)):
                blocks[:] = [moves.get(b, b) for b in blocks]
            old_tags = {b: self.tags.pop((g, b)) for b in moves if (g, b) in self.tags}
            for b, tag in old_tags.items():
                self.tags[(g, moves[b])] = tag
            if cap is not None:
                assert c.blocks_moved <= cap
        if cap is None:
            for name, geo in self.c.geometry.items():
                assert self.c.allocator.num_free_blocks(name) < geo.blocks_per_slot

    @rule(keep=st.booleans())
    def toggle_retention(self, keep):
        self.policy.keep = keep

    @precondition(lambda self: self.sim)
    @rule(mib=st.integers(0, 80))
    def memory_used_outside(self, mib):
        self.d.set_external_use(mib * MiB)

    @rule(mib=st.integers(0, 16))
    def execution_peak(self, mib):
        self.pool.reset_execution_peak(mib * MiB)

    @precondition(lambda self: self.sim)
    @rule(op=st.sampled_from(["create", "map"]), n=st.integers(1, 6))
    def inject_failure(self, op, n):
        self.d.fail_nth(op, n)

    @invariant()
    def consistent(self):
        a = self.c.allocator
        a.check_invariants()
        pages = set()
        for name, geo in self.c.geometry.items():
            for s in a.active_slots(name):
                pages.update(geo.slot_pages(s))
                for b in a.blocks_of_slot(name, s):
                    if a.ref_count(name, b) or a.is_cached(name, b):
                        assert self.c.check_mapped(name, b)
        assert set(self.pool.pages_in_use(self.c.region)) == pages
        mapped, created = self._driver_bytes()
        assert mapped == self.pool.mapped_bytes == len(pages) * PAGE
        assert self.pool.held_bytes == created == self.c.active_bytes()
        assert self.pool.held_bytes <= QUOTA
        self._check_tags()

    def teardown(self):
        if self.sim:
            self.d._fail = {"create": [], "map": []}
        for _, blocks in self.seqs.values():
            self.policy.free(blocks)
        self.policy.release_all()
        assert self._driver_bytes() == (0, 0)
        assert self.pool.stats().pages_in_use == 0
        self.pool.close()
        if not self.sim:
            self.d.close()


CacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestCacheMachine = CacheMachine.TestCase


class HostCacheMachine(CacheMachine):
    DRIVER = "host"

    def __init__(self) -> None:
        super().__init__()
        self.policy.keep = False  # start with freed blocks free, so that slots fragment


HostCacheMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestHostCacheMachine = HostCacheMachine.TestCase


class PythonTablesCacheMachine(CacheMachine):
    """The same machine on the pure-Python block-table passes (the classes above use the C
    ones of libxllm_kvtable.so when it is built)."""

    TABLES = "python"


PythonTablesCacheMachine.TestCase.settings = CacheMachine.TestCase.settings
TestPythonTablesCacheMachine = PythonTablesCacheMachine.TestCase


class PythonTablesHostCacheMachine(HostCacheMachine):
    TABLES = "python"


PythonTablesHostCacheMachine.TestCase.settings = HostCacheMachine.TestCase.settings
TestPythonTablesHostCacheMachine = PythonTablesHostCacheMachine.TestCase
