"""The two backends of the block-state protocol (:mod:`xllm_vmm.kvcache.block_state`) in
lockstep: the C block-table passes (``libxllm_kvtable.so``, :class:`NativeBlockState`) against
the pure-Python ones (:class:`PyBlockState`), driven through the allocator façade on random
traces over every verb and compared through the protocol's views: the same block ids in the
same order, the same stacks, bucket insertion order, inactive slots, flags, counters, backing
calls, cached/LRU/pinned answers, refusals and compactions."""

from __future__ import annotations

import random

import pytest

from tests.kvcache.conftest import FakeBacking
from xllm_vmm.kvcache import BlockAllocator, GroupShape
from xllm_vmm.kvcache.block_state import BlockState
from xllm_vmm.kvcache.kvtable import NativeBlockState, native_available, native_requested
from xllm_vmm.kvcache.pytable import PyBlockState

pytestmark = pytest.mark.skipif(not native_available(), reason="libxllm_kvtable.so not built")
BOTH_PATHS = False  # each test builds both itself (conftest's block_tables: not parametrized)


def _state(a):
    """Every group's state as the protocol shows it."""
    out = []
    for name in a.group_names:
        g: BlockState = a.state(name)
        out.append((list(g.ref), bytes(g.cached), bytes(g.keep), dict(g.pins),
                    g.stacks, [list(b) for b in g.buckets], sorted(g.inactive),
                    g.free_active, g.n_cached, g.n_active))
    return out


def _pair(slots=10, bps=4, draft=None, budget=1 << 30):
    shapes = [GroupShape("attn", slots, bps)] + ([GroupShape("draft", *draft)] if draft else [])
    py = BlockAllocator(shapes, FakeBacking(budget), native=False)
    c = BlockAllocator(shapes, FakeBacking(budget), native=True)
    assert not py.native and c.native
    for a, backend in ((py, PyBlockState), (c, NativeBlockState)):
        for name in a.group_names:
            assert type(a.state(name)) is backend and isinstance(a.state(name), BlockState)
    return py, c


def _both(py, c, fn):
    """``fn(allocator)`` on both; the same answer or the same exception."""
    res = []
    for a in (py, c):
        try:
            res.append(("ok", fn(a)))
        except (ValueError, KeyError, IndexError) as exc:
            res.append((type(exc).__name__, str(exc)))
    assert res[0] == res[1]
    assert _state(py) == _state(c)
    return res[0][1] if res[0][0] == "ok" else None


@pytest.mark.parametrize("seed", range(8))
def test_one_group_lockstep(seed):
    rng = random.Random(seed)
    py, c = _pair(slots=10, bps=4, budget=rng.choice([6, 8, 1 << 30]))
    lru_py: dict[int, None] = {}
    lru_c: dict[int, None] = {}
    if rng.random() < 0.7:
        py.will_retain("attn")
        c.will_retain("attn")
    reqs: list[list[int]] = []
    for _ in range(120):
        op = rng.random()
        if op < 0.35 or not reqs:
            n = rng.randint(0, 9)
            hint = reqs[-1][-1] if reqs and reqs[-1] and rng.random() < 0.5 else rng.choice(
                [-1, -1, 999, -5])
            x = _both(py, c, lambda a: a.allocate_group("attn", n, hint))
            if x is not None:
                if hint >= 0 and reqs and hint in reqs[-1]:
                    reqs[-1].extend(x)
                else:
                    reqs.append(x)
        elif op < 0.5:
            r = reqs.pop(rng.randrange(len(reqs)))
            order = r[::-1] if rng.random() < 0.5 else r
            _both(py, c, lambda a: a.free_group("attn", order))
        elif op < 0.6:
            r = reqs.pop(rng.randrange(len(reqs)))
            got = [a.free_group_lru("attn", r, lru)
                   for a, lru in ((py, lru_py), (c, lru_c))]
            assert got[0] == got[1] and list(lru_py) == list(lru_c)
            assert _state(py) == _state(c)
        elif op < 0.68:
            r = rng.choice(reqs)
            if r:
                blocks = rng.sample(r, rng.randint(1, len(r)))
                _both(py, c, lambda a: a.retain("attn", blocks))
        elif op < 0.73:
            r = rng.choice(reqs)
            if r:
                b = rng.choice(r)
                _both(py, c, lambda a: a.pin("attn", b))
        elif op < 0.78:
            pinned = list(py.pinned_blocks("attn"))
            if pinned:
                b = rng.choice(pinned)
                _both(py, c, lambda a: a.unpin("attn", b))
        elif op < 0.84:
            cached = [b for b in range(py.shape("attn").num_blocks)
                      if py.is_cached("attn", b) and not py.pin_count("attn", b)]
            if cached:
                blocks = rng.sample(cached, rng.randint(1, len(cached)))
                for lru in (lru_py, lru_c):
                    for b in blocks:
                        lru.pop(b, None)
                _both(py, c, lambda a: a.release_cached("attn", blocks))
        elif op < 0.88:
            cached = [b for b in range(py.shape("attn").num_blocks) if py.is_cached("attn", b)]
            if cached:
                blocks = rng.sample(cached, rng.randint(1, min(3, len(cached))))
                for lru in (lru_py, lru_c):
                    for b in blocks:
                        lru.pop(b, None)
                _both(py, c, lambda a: a.touch_many("attn", blocks))
                reqs.append(blocks)
        elif op < 0.93:
            r = rng.choice(reqs)
            bad = rng.choice([r + r[:1], [-1], [py.shape("attn").num_blocks], r[:1] + ["x"],
                              r[:1] * 3, [10 ** 30]]) if r else [-1]
            _both(py, c, lambda a: a.free_group("attn", bad))
            got = []
            for a, lru in ((py, lru_py), (c, lru_c)):
                with pytest.raises(ValueError) as exc:
                    a.free_group_lru("attn", bad, lru)
                got.append(str(exc.value))
            assert got[0] == got[1] and list(lru_py) == list(lru_c)
        else:
            excl = {"attn": [b for r in reqs[:1] for b in r]}
            cap = rng.choice([None, 3])
            comp = [a.compact(max_blocks=cap, exclude=excl) for a in (py, c)]
            assert comp[0] == comp[1]
            moves = comp[0].moves["attn"]
            reqs = [[moves.get(b, b) for b in r] for r in reqs]
            for lru in (lru_py, lru_c):
                items = [moves.get(b, b) for b in lru]
                lru.clear()
                lru.update(dict.fromkeys(items))
            assert _state(py) == _state(c)
        py.check_invariants()
        c.check_invariants()
    assert py.backing.calls == c.backing.calls


@pytest.mark.parametrize("seed", range(4))
def test_two_groups_lockstep(seed):
    rng = random.Random(100 + seed)
    py, c = _pair(slots=8, bps=4, draft=(12, 2), budget=rng.choice([10, 1 << 30]))
    reqs: list[dict[str, list[int]]] = []
    for _ in range(80):
        if rng.random() < 0.55 or not reqs:
            n = rng.randint(0, 6)
            near = ({g: t[-1] for g, t in reqs[-1].items() if t}
                    if reqs and rng.random() < 0.5 else None)
            x = _both(py, c, lambda a: a.allocate({"attn": n, "draft": n}, near))
            if x is not None:
                if near and reqs:
                    for g in x:
                        reqs[-1][g].extend(x[g])
                else:
                    reqs.append(x)
        else:
            r = reqs.pop(rng.randrange(len(reqs)))
            _both(py, c, lambda a: a.free(r))
        py.check_invariants()
        c.check_invariants()
    assert py.backing.calls == c.backing.calls


def test_a_refused_activation_gives_the_slots_back():
    py, c = _pair(slots=6, bps=4, budget=2)
    for a in (py, c):
        assert a.allocate_group("attn", 8) == list(range(8))
        assert a.allocate_group("attn", 1) is None  # a third slot: refused by the budget
        assert a.num_inactive_slots("attn") == 4
    assert _state(py) == _state(c)
    c.check_invariants()


def test_a_long_free_grows_the_input_buffer():
    py, c = _pair(slots=4, bps=4)
    for a in (py, c):
        x = a.allocate_group("attn", 16)
        for _ in range(200):  # shared: 201 references each
            a.touch_many("attn", x)
    g = c.state("attn")
    cap = g.table.in_cap
    long = list(range(16)) * 201
    assert len(long) > cap
    _both(py, c, lambda a: a.free_group("attn", long))
    assert g.table.in_cap >= len(long) and py.num_active_slots("attn") == 0


def test_the_environment_selects_the_passes(monkeypatch):
    monkeypatch.setenv("XLLM_VMM_KVTABLE", "python")
    assert not native_requested()
    assert not BlockAllocator([GroupShape("attn", 2, 2)], FakeBacking()).native
    monkeypatch.setenv("XLLM_VMM_KVTABLE", "native")
    assert BlockAllocator([GroupShape("attn", 2, 2)], FakeBacking()).native
    monkeypatch.setenv("XLLM_VMM_KVTABLE", "fast")
    with pytest.raises(ValueError, match="XLLM_VMM_KVTABLE"):
        BlockAllocator([GroupShape("attn", 2, 2)], FakeBacking())


def test_without_the_library_or_int32_ids_the_python_passes_run(monkeypatch):
    from xllm_vmm.kvcache import allocator as allocator_module
    from xllm_vmm.kvcache import kvtable

    monkeypatch.setattr(allocator_module, "MAX_BLOCKS", 15)  # a group of 16 blocks: too many
    assert not BlockAllocator([GroupShape("attn", 4, 4)], FakeBacking()).native
    assert BlockAllocator([GroupShape("attn", 3, 5)], FakeBacking()).native
    monkeypatch.setattr(kvtable, "MAX_BLOCKS", 15)
    with pytest.raises(ValueError, match="int32"):
        BlockAllocator([GroupShape("attn", 4, 4)], FakeBacking(), native=True)
    monkeypatch.setattr(kvtable, "_lib", None)  # as when libxllm_kvtable.so is not built
    assert not native_available() and not native_requested()
    a = BlockAllocator([GroupShape("attn", 4, 4)], FakeBacking())
    assert not a.native and a.allocate_group("attn", 5) == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="libxllm_kvtable.so is not built"):
        BlockAllocator([GroupShape("attn", 4, 4)], FakeBacking(), native=True)


def test_hints_and_counts_that_are_not_python_ints():
    class Index:  # an integer type of another library (numpy's, torch's scalars)
        def __init__(self, v):
            self.v = v

        def __index__(self):
            return self.v

    py, c = _pair(slots=6, bps=4)
    for a in (py, c):
        a.allocate_group("attn", 6)  # slot 1 has 2 free blocks
        a.allocate_group("attn", 9)  # slots 2, 3 full, slot 4 has 3 free
    hints = [Index(5), 2 ** 40, Index(17), -1]
    for h in hints:
        x = c.allocate_group("attn", Index(1) if h == -1 else 1, h)
        y = py.allocate_group("attn", 1, h.v if isinstance(h, Index) else h)
        assert x == y
        assert _state(py) == _state(c)
    with pytest.raises(TypeError, match="hint"):
        c.allocate_group("attn", 2, "5")
