"""The flat hot paths against the general ones they stand for: ``BlockAllocator.free_group_lru``
against ``free_group`` + the prefix cache's LRU (ids, flags, stacks, slots, refusals), and the
manager's one-group paths (direct admission, the one-pass publish, flat release) against the
manager's general paths on the same requests (tables, index, LRU, counters)."""

from __future__ import annotations

import random

import pytest

from tests.kvcache.conftest import FakeBacking, make
from tests.kvcache.test_manager import Env, toks


def _state(a, g="attn"):
    gg = a.state(g)
    return (list(gg.ref), bytes(gg.cached), bytes(gg.keep), dict(gg.pins),
            [None if s is None else list(s) for s in gg.stacks], list(gg.ncached),
            [dict(b) for b in gg.buckets], sorted(gg.inactive), gg.free_active, gg.n_cached,
            gg.n_active)


def test_free_group_lru_equals_free_group_plus_the_lru():
    rng = random.Random(1)
    for trial in range(30):
        a1, a2 = (make(FakeBacking(), slots=6, bps=4) for _ in range(2))
        lru1: dict[int, None] = {}
        lru2: dict[int, None] = {}
        reqs = []
        for _ in range(12):
            n = rng.randint(1, 5)
            x, y = a1.allocate_group("attn", n), a2.allocate_group("attn", n)
            assert x == y
            if x is None:
                break
            keep = [b for b in x if rng.random() < 0.6]
            if keep:
                a1.retain("attn", keep)
                a2.retain("attn", keep)
            if keep and rng.random() < 0.3:
                a1.pin("attn", keep[0])
                a2.pin("attn", keep[0])
            reqs.append(x)
            if rng.random() < 0.5:
                r = reqs.pop(rng.randrange(len(reqs)))
                kept = a1.free_group("attn", r[::-1]) or []
                pins = a1.pinned_blocks("attn")
                for b in kept:
                    if a1.is_retained("attn", b) and b not in pins:
                        lru1[b] = None
                pinned = a2.free_group_lru("attn", r, lru2)
                assert (pinned or []) == [b for b in kept if b in pins]
                assert list(lru1) == list(lru2)
                assert _state(a1) == _state(a2)
        a2.check_invariants()
        assert a1.backing.calls == a2.backing.calls


def test_free_group_lru_refusal_changes_nothing():
    a = make(FakeBacking(), slots=4, bps=4)
    x = a.allocate_group("attn", 6)
    a.retain("attn", x[:3])
    lru = {99: None}
    before = _state(a)
    for bad, msg in (([x[0], x[1], x[1]], "double free"), ([x[0], 77], "not a block"),
                     ([x[2], -1], "not a block"), ([x[3], "z"], "not a block")):
        with pytest.raises(ValueError, match=msg):
            a.free_group_lru("attn", bad, lru)
        assert _state(a) == before and list(lru) == [99]
    assert a.free_group_lru("attn", x, lru) is None
    assert list(lru) == [99, x[2], x[1], x[0]]
    a.check_invariants()


def _drive(m, rng, rounds=60):
    """A random workload through the verbs; returns what a caller can see after each step."""
    seen = []
    live: dict[str, list[int]] = {}
    systems = [toks(1, 2), toks(3), toks(1, 2, 4, tail=0)]
    for i in range(rounds):
        op = rng.random()
        if op < 0.45 or not live:
            rid = f"r{i}"
            p = list(rng.choice(systems)) + [rng.randrange(50, 60) for _ in range(rng.randint(1, 6))]
            hit = m.lookup(rid, p)
            t = m.allocate(rid, len(p) - hit.num_tokens, hit=hit)
            if t is None:
                m.drop(rid)
                seen.append(("none", rid))
                continue
            m.commit(rid, len(p), p)
            live[rid] = p
            seen.append(("arrive", rid, hit.num_tokens, {g: list(v) for g, v in t.items()}))
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            p = live[rid]
            if m.allocate(rid, 1) is None:
                seen.append(("grow-none", rid))
                continue
            p.append(rng.randrange(50, 53))
            m.commit(rid, len(p), p)
            seen.append(("grow", rid, list(m.block_tables(rid)["attn"])))
        else:
            rid = rng.choice(sorted(live))
            m.free(rid)
            del live[rid]
            seen.append(("free", rid))
        st = m.stats()
        seen.append((m.prefix.lru_order("attn"), dict(m.prefix._groups["attn"].hash_to_block),
                     st["live_blocks"], st["cached_blocks"], st["prefix_hits"],
                     st["prefix_published_blocks"], st["prefix_evictions"]))
        m.check_invariants()
    return seen


@pytest.mark.parametrize("seed", range(4))
def test_flat_manager_paths_equal_the_general_ones(seed):
    """The same workload with the flat paths on (``_chain``) and off: identical tables, index,
    LRU order and counters at every step (eviction included: a small budget)."""
    e1, e2 = Env(budget_slots=3), Env(budget_slots=3)
    try:
        assert e1.mgr._chain
        e2.mgr._chain = False  # the general paths (as with a host tier or several groups)
        assert _drive(e1.mgr, random.Random(seed)) == _drive(e2.mgr, random.Random(seed))
    finally:
        e1.close()
        e2.close()


def test_flat_publish_conflict_is_refused_and_undone():
    """A block already indexed under another hash (its content changed after publishing):
    the one-group commit's publish (``PrefixCache.index_run``) undoes the blocks it indexed in
    that call and raises like publish; no retained flag is set."""
    from xllm_vmm.kvcache.prefix import PrefixCacheError

    e = Env()
    try:
        m = e.mgr
        p = toks(1, 2, 3)
        m.lookup("a", p)
        t = m.allocate("a", len(p))["attn"]
        m.prefix.publish({"attn": t}, [12345], first_block=1)  # block t[1] under a wrong hash
        idx = dict(m.prefix._groups["attn"].hash_to_block)
        with pytest.raises(PrefixCacheError, match="already published under another hash"):
            m.commit("a", len(p), p)
        assert dict(m.prefix._groups["attn"].hash_to_block) == idx
        assert not m.cache.allocator.is_retained("attn", t[0])
        m.check_invariants()
    finally:
        e.close()


def _ordered_state(a, g="attn"):
    """:func:`_state` with each bucket's insertion order (the tie-break of slot choice)."""
    return _state(a, g) + ([list(b) for b in a.state(g).buckets],)


def _take_partial_rescanning(g, n, out):
    """The fullest-first pass as it was written before the one-pass walk: rescan the buckets
    from the fullest for every slot taken (the reference for ``PyBlockState._take_partial``)."""
    buckets, stacks, ref, want = g.buckets, g.stacks, g.ref, n
    while n and g.free_active > want - n:
        bucket = next(b for b in buckets if b)
        slot = next(iter(bucket))
        stack = stacks[slot]
        k = len(stack)
        take = min(k, n)
        got = stack[-take:][::-1]
        del stack[-take:]
        for b in got:
            ref[b] = 1
        out.extend(got)
        del bucket[slot]
        if k - take:
            buckets[k - take][slot] = None
        n -= take
    g.free_active -= want - n
    return n


def test_free_group_fast_pass_and_one_pass_take_equal_the_general_passes(monkeypatch):
    """``free_group`` of a group that retains nothing (its pass skips the flags) against the
    same pass reading them (``will_retain`` set, nothing retained), and the Python passes'
    one-pass ``_take_partial`` walk against the rescanning reference: the same ids, stacks,
    bucket order, slots released and refusals."""
    from xllm_vmm.kvcache.pytable import PyBlockState

    rng = random.Random(7)
    for trial in range(40):
        fast, general = (make(FakeBacking(), slots=8, bps=4) for _ in range(2))
        general.will_retain("attn")
        reqs: list[list[int]] = []
        for step in range(40):
            op = rng.random()
            if op < 0.55 or not reqs:
                n = rng.randint(1, 9)
                hint = reqs[-1][-1] if reqs and rng.random() < 0.4 else -1
                x = fast.allocate_group("attn", n, hint)
                with monkeypatch.context() as m:
                    m.setattr(PyBlockState, "_take_partial", _take_partial_rescanning)
                    y = general.allocate_group("attn", n, hint)
                assert x == y
                if x is not None:
                    if hint >= 0:
                        reqs[-1].extend(x)
                    else:
                        reqs.append(x)
            elif op < 0.9:
                r = reqs.pop(rng.randrange(len(reqs)))
                order = r[::-1] if rng.random() < 0.5 else r
                assert fast.free_group("attn", order) is None
                assert general.free_group("attn", order) is None
            else:  # refusals: a double free, a duplicate, an id outside, a negative id
                r = rng.choice(reqs)
                bad = rng.choice([r + [r[0]], r[:1] + r[:1],
                                  r[:2] + [fast.shape("attn").num_blocks], r[:1] + [-1]])
                for a in (fast, general):
                    before = _ordered_state(a)
                    with pytest.raises(ValueError):
                        a.free_group("attn", bad)
                    assert _ordered_state(a) == before
            assert _ordered_state(fast) == _ordered_state(general)
            fast.check_invariants()
        assert fast.backing.calls == general.backing.calls


def test_per_token_verbs_touch_only_the_hot_fields_of_a_request(env):
    """A decode token that fits (``allocate``), its ``commit`` (no block completes), ``ready``
    and ``num_computed_tokens`` read and write only ``RequestHot``'s fields (laid out next
    to the object header), whatever else the request holds."""
    from xllm_vmm.kvcache import records as mgr_mod

    seen: list[str] = []

    class Tracking(mgr_mod.RequestRecord):
        __slots__ = ()

        def __getattribute__(self, name):
            seen.append(name)
            return object.__getattribute__(self, name)

        def __setattr__(self, name, value):
            seen.append(name)
            object.__setattr__(self, name, value)

    e = env()
    m = e.mgr
    tokens = toks(1, 2, tail=1)  # 9 tokens: 3 blocks of 4, the last one with room
    hit = m.lookup("a", tokens)
    m.allocate("a", len(tokens) - hit.num_tokens, hit=hit)
    m.commit("a", len(tokens), tokens)
    req = m._reqs["a"]
    req.__class__ = Tracking
    tokens.append(8)
    assert m.ready("a") and m.num_computed_tokens("a") == 9
    assert m.allocate("a", 1) == m.block_tables("a")
    m.commit("a", 10, tokens)
    assert seen and set(seen) <= set(mgr_mod.RequestHot.__slots__), sorted(set(seen))
    req.__class__ = mgr_mod.RequestRecord
    seen.clear()
    tokens += [9, 10]
    m.allocate("a", 2)  # 12 tokens: the third block fills, and commit publishes it
    req.__class__ = Tracking
    m.commit("a", 12, tokens)
    assert set(seen) - set(mgr_mod.RequestHot.__slots__)  # the cold path (hashes, first)
    req.__class__ = mgr_mod.RequestRecord
    m.check_invariants()


def test_a_commit_that_completes_no_block_reads_nothing_but_the_record(env):
    """``upto`` (the record's second hot field) says at once that a commit completes no
    block: the token list is not read then (not even its length); a commit that completes a
    block reads it and refuses one shorter than ``num_computed_tokens``. ``upto`` follows
    growth, publishing and truncation (``check_invariants`` recomputes it), and the record
    keeps its cache-line size (192 bytes with the GC header: the hot fields in one line)."""
    from xllm_vmm.kvcache import records as mgr_mod

    class Unreadable(list):
        def __len__(self):
            raise AssertionError("token_ids read")

        def __getitem__(self, i):
            raise AssertionError("token_ids read")

    assert (mgr_mod.RequestRecord.__basicsize__ + 16) % 64 == 0
    assert len(mgr_mod.RequestHot.__slots__) == 2
    e = env()
    m = e.mgr
    tokens = toks(1, 2, tail=1)  # 9 tokens: 3 blocks of 4
    hit = m.lookup("a", tokens)
    m.allocate("a", len(tokens) - hit.num_tokens, hit=hit)
    m.commit("a", len(tokens), tokens)
    req = m._reqs["a"]
    assert req.upto == 11  # block 2 completes at 12 tokens
    assert m.allocate("a", 2) is req
    m.commit("a", 11, Unreadable())
    assert m.num_computed_tokens("a") == 11
    m.check_invariants()
    with pytest.raises(ValueError, match="len"):
        m.commit("a", 12, tokens[:11])  # completes block 2: the list is read and too short
    assert m.num_computed_tokens("a") == 11 and req.upto == 11
    m.commit("a", 12, tokens + [5, 6, 7])
    assert req.upto == 12 and req.published == 3  # no room beyond 12 until it grows
    assert m.allocate("a", 3) is req and req.upto == 15
    assert m.truncate("a", 13) == 0 and req.upto == 15
    m.commit("a", 14, Unreadable())
    m.check_invariants()
    with pytest.raises(ValueError, match="num_computed_tokens"):
        m.commit("a", 17, tokens)  # beyond its blocks: refused
    m.check_invariants()


def test_a_running_request_holds_one_gc_tracked_object_besides_its_record(env):
    """The record of a running request (one group, prefix caching) is its tables mapping;
    once its blocks are published it keeps no hash list (only the chain's parent), so the one
    GC-tracked object it references is its block list: less for its free and the cyclic GC
    to touch at thousands of running requests. The chain still continues from the parent
    (the next blocks publish under the hashes a fresh lookup of the same tokens finds)."""
    import gc

    from xllm_vmm.kvcache.hashing import block_hashes

    e = env()
    m = e.mgr
    tokens = toks(1, 2, tail=1)  # 9 tokens: 3 blocks of 4
    hit = m.lookup("a", tokens)
    assert m.allocate("a", len(tokens) - hit.num_tokens, hit=hit) is m.block_tables("a")
    m.commit("a", len(tokens), tokens)
    for t in (8, 9, 10, 11, 12):  # block 2 completes at 12 tokens, block 3 starts
        tokens.append(t)
        assert m.allocate("a", 1) is not None
        m.commit("a", len(tokens), tokens)
    from xllm_vmm.kvcache import records as mgr_mod

    req = m._reqs["a"]
    shared = {id(type(req)), id(mgr_mod.NO_HASHES), id(mgr_mod.NO_HOST)}  # not per request
    tracked = {id(o): o for o in gc.get_referents(req)
               if gc.is_tracked(o) and id(o) not in shared}
    assert list(tracked.values()) == [req["attn"]], tracked
    assert req.hashes == [] and req.published == 3
    assert req.parent == block_hashes(tokens[:12], 4)[-1]
    assert m.lookup("b", tokens).num_tokens == 12  # blocks 0..2 published, the chain intact
    m.drop("b")
    m.check_invariants()
