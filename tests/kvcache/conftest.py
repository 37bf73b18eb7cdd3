"""Fixtures for the virtual KV cache tests: hand-made cache layouts, drivers, a fake slot
backing with a slot budget, and a stand-in for the prefix cache
(retains, keeps an LRU, evicts before an allocation is retried)."""

from __future__ import annotations

import pytest

from tests.pool.drivers import driver_factory, make_driver  # noqa: F401  (fixture, helper)
from xllm_vmm.models.spec import CacheGroup, CacheLayout, CacheTensor

MiB = 1 << 20
PAGE = 2 * MiB


def toy_layout(layers: int = 2, blocks_per_page: int = 4, block_size: int = 16,
               draft_blocks_per_page: int | None = None, name: str = "toy") -> CacheLayout:
    """``layers`` × K/V tensors with ``blocks_per_page`` blocks per 2 MiB page; an optional
    MTP draft group (one layer, K/V) of another width."""
    tbb = PAGE // blocks_per_page
    tensors = tuple(CacheTensor(f"layer{i}.{kv}", tbb // block_size)
                    for i in range(layers) for kv in "kv")
    groups = [CacheGroup("attn", tensors, block_size)]
    if draft_blocks_per_page is not None:
        dbb = PAGE // draft_blocks_per_page
        groups.append(CacheGroup("draft", (CacheTensor("mtp0.k", dbb // block_size),
                                           CacheTensor("mtp0.v", dbb // block_size)),
                                 block_size))
    return CacheLayout(name, 1, tuple(groups))


class FakeBacking:
    """Slot backing with a budget of ``budget_slots`` active slots over all groups; records
    every activate / deactivate call."""

    def __init__(self, budget_slots: int = 1 << 30) -> None:
        self.budget_slots = budget_slots
        self.active: set[tuple[str, int]] = set()
        self.calls: list[tuple[str, dict[str, list[int]]]] = []

    def activate(self, slots):
        n = sum(len(v) for v in slots.values())
        self.calls.append(("activate", {k: list(v) for k, v in slots.items()}))
        if len(self.active) + n > self.budget_slots:
            return False
        for g, ss in slots.items():
            for s in ss:
                assert (g, s) not in self.active
                self.active.add((g, s))
        return True

    def deactivate(self, slots):
        self.calls.append(("deactivate", {k: list(v) for k, v in slots.items()}))
        for g, ss in slots.items():
            for s in ss:
                self.active.remove((g, s))

    move_ok = True  # False: the copy "fails" (compaction must change nothing)
    last_move_error = ""

    def move(self, moves):
        self.calls.append(("move", {k: list(v) for k, v in moves.items()}))
        if not self.move_ok:
            self.last_move_error = "injected copy failure"
        return self.move_ok


class KeepAll:
    """Stands in for the prefix cache over a :class:`BlockAllocator`: while ``keep`` is set
    every block it sees allocated is retained (so it becomes cached at ref 0); it keeps the
    LRU of cached blocks from what ``free`` returns, and gives them up oldest first (whole
    evictable slots first when asked), *before* an allocation is retried — never inside one."""

    def __init__(self, allocator=None, keep: bool = True) -> None:
        self.allocator = allocator
        self.keep = keep
        self.lru: dict[tuple[str, int], None] = {}
        self.calls: list[tuple] = []

    def allocated(self, got):
        if got is not None and self.keep:
            for g, bs in got.items():
                self.allocator.retain(g, bs)
        return got

    def free(self, blocks) -> None:
        for g, bs in self.allocator.free(blocks).items():
            for b in bs:
                self.lru[(g, b)] = None

    def touch(self, group, block) -> None:
        if self.allocator.touch(group, block):
            del self.lru[(group, block)]

    def num_evictable(self, group) -> int:
        return sum(1 for g, _ in self.lru if g == group)

    def on_move(self, group, moves) -> None:
        self.lru = {(g, moves.get(b, b) if g == group else b): None for g, b in self.lru}

    def evict(self, group, n_blocks, prefer_slot_emptying=True) -> int:
        self.calls.append(("evict", group, n_blocks, prefer_slot_emptying))
        a = self.allocator
        out: list[int] = []
        if prefer_slot_emptying:
            for (g, b) in list(self.lru):
                if g != group or len(out) >= n_blocks or b in out:
                    continue
                slot = a.slot_of(g, b)
                if a.slot_evictable(g, slot):
                    out.extend(bb for bb in a.blocks_of_slot(g, slot)
                               if (g, bb) in self.lru and bb not in out)
        for (g, b) in list(self.lru):
            if len(out) >= n_blocks:
                break
            if g == group and b not in out:
                out.append(b)
        for b in out:
            del self.lru[(group, b)]
        a.release_cached(group, out)
        return len(out)

    def allocate(self, counts, near=None):
        """``allocator.allocate``; on "not now" evict (the short groups' shortfall by exact
        LRU, then one slot of every group at a time) and retry, as the manager does."""
        a = self.allocator
        got = a.allocate(counts, near)
        if got is not None:
            return self.allocated(got)
        n = sum(self.evict(g, c - a.num_free_blocks(g), prefer_slot_emptying=False)
                for g, c in counts.items() if c > a.num_free_blocks(g))
        while True:
            if n:
                got = a.allocate(counts, near)
                if got is not None:
                    return self.allocated(got)
            n = sum(self.evict(g, a.shape(g).blocks_per_slot) for g in a.group_names)
            if not n:
                return None

    def release_all(self) -> None:
        for name in self.allocator.group_names:
            cached = [b for (g, b) in self.lru if g == name]
            for b in cached:
                del self.lru[(name, b)]
            self.allocator.release_cached(name, cached)


def _block_tables():
    from xllm_vmm.kvcache.kvtable import native_available

    return ["python", "native"] if native_available() else ["python"]


def pytest_generate_tests(metafunc):
    if "block_tables" in metafunc.fixturenames and getattr(metafunc.module, "BOTH_PATHS", True):
        metafunc.parametrize("block_tables", _block_tables(), indirect=True)


@pytest.fixture(autouse=True)
def block_tables(request, monkeypatch):
    """Every test function here runs on both block-table paths: the pure-Python passes and
    the C ones of libxllm_kvtable.so (when it is built; XLLM_VMM_KVTABLE selects them for
    every allocator the test builds, directly or through the cache and the manager). The
    hypothesis state machines (unittest classes, not parametrized) have a class per path."""
    mode = getattr(request, "param", None)
    if mode is not None:
        monkeypatch.setenv("XLLM_VMM_KVTABLE", mode)
    return mode


@pytest.fixture
def backing():
    return FakeBacking()

def make(backing, slots=4, bps=4, draft=None, policy=None):
    """A BlockAllocator over ``backing``: group "attn" of ``slots`` slots of ``bps`` blocks,
    optionally a "draft" group (``(slots, bps)``); a :class:`KeepAll` ``policy`` is bound to
    it."""
    from xllm_vmm.kvcache import BlockAllocator, GroupShape

    shapes = [GroupShape("attn", slots, bps)]
    if draft:
        shapes.append(GroupShape("draft", *draft))
    a = BlockAllocator(shapes, backing)
    if policy is not None:
        policy.allocator = a
    return a


@pytest.fixture
def env():
    """``make(*a, **kw)`` -> a manager test environment (``test_manager.Env``: pool, driver,
    manager over a toy layout); every one made is closed after the test."""
    from tests.kvcache.test_manager import Env

    made: list[Env] = []

    def make(*a, **kw):
        e = Env(*a, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
