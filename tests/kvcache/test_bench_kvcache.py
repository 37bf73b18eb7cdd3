"""Smoke test of ``xllm-vmm bench kvcache`` with tiny sizes: field presence and sanity only
(never speed)."""

from __future__ import annotations

import json

import pytest

from typer.testing import CliRunner

from xllm_vmm.bench.kvcache import FreeListBlockPool, KvBenchConfig, make_trace
from xllm_vmm.cli.app import app


def test_bench_kvcache_json_reports_the_named_fields():
    r = CliRunner().invoke(app, ["bench", "kvcache", "--sequences", "12", "--layers", "2",
                                 "--repeats", "1", "--min-seconds", "0", "--cycle-requests",
                                 "64", "--growth-requests", "96", "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    for key in ("alloc_vs_freelist_ratio", "idle_footprint_ratio", "peak_footprint_ratio",
                "map_calls_per_1k_tokens", "admission_us", "cache_vs_freelist_ratio",
                "freelist_idle_footprint_ratio", "manager_cycle_vs_freelist_ratio",
                "manager_cycle_vs_freelist_ratio_median", "cost_growth_4096_vs_64",
                "freelist_cost_growth_4096_vs_64", "manager_cycle_us_per_op",
                "shortest_measurement_s"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["peak_footprint_ratio"] >= 1.0 and out["idle_footprint_ratio"] >= 1.0
    assert out["peak_mapped_bytes"] >= out["peak_packed_floor_bytes"] > 0
    assert out["blocks_per_slot"] == 8 and out["slot_bytes"] == 4 * (2 << 20)
    assert out["map_calls"] >= 1 and out["generated_tokens"] > 0
    assert "alloc_groups_api_vs_freelist_ratio" not in out  # the headline is that path now
    # compaction at the idle point never leaves more than the packed floor plus one slot
    assert out["idle_footprint_ratio_before_compaction"] >= out["idle_footprint_ratio"]
    assert out["idle_mapped_bytes"] - out["idle_packed_floor_bytes"] < out["slot_bytes"]
    assert out["compaction_bytes_copied"] == out["compaction_blocks_moved"] * 2 * 2 * (1 << 18)
    assert (out["idle_mapped_bytes_before_compaction"] - out["idle_mapped_bytes"]
            == out["compaction_bytes_released"])


def test_default_trace_meets_the_footprint_targets_after_compaction():
    from xllm_vmm.bench.kvcache import run_kvcache_bench

    out = run_kvcache_bench(KvBenchConfig(repeats=1, min_seconds=0, cycle_requests=32,
                                          growth_requests=64))
    assert out["idle_footprint_ratio"] == 1.0 and out["peak_footprint_ratio"] == 1.0
    # decode growth leaving a full slot goes to the roomiest partial slot (a sequence's
    # blocks share fewer slots): 2.3958 before that placement, 2.0833 with it
    assert round(out["idle_footprint_ratio_before_compaction"], 4) == 2.0833
    assert out["compaction_blocks_moved"] == 98
    assert out["compaction_bytes_copied"] == 98 * 36 * 2 * 128 * 8 * 128 * 2


@pytest.mark.parametrize("args,msg", [
    (["--sequences", "0"], "--sequences must be an integer in [1, 16384], got 0"),
    (["--layers", "0"], "--layers must be an integer in [1, 512], got 0"),
    (["--block-size", "100000"], "--block-size must be an integer in [1, 1024], got 100000"),
    (["--repeats", "1000"], "--repeats must be an integer in [1, 100], got 1000"),
    (["--long-fraction", "nan"], "--long-fraction must be in (0, 1), got nan"),
    (["--long-fraction", "inf"], "--long-fraction must be in (0, 1), got inf"),
    (["--driver", "cuda"], "--driver must be 'sim' or 'host', got 'cuda'"),
    (["--min-seconds", "nan"], "--min-seconds must be in [0, 60], got nan"),
    (["--cycle-requests", "0"], "--cycle-requests must be an integer in [1, 1048576], got 0"),
])
def test_bench_kvcache_refuses_bad_options_by_name(args, msg):
    r = CliRunner().invoke(app, ["bench", "kvcache"] + args)
    assert r.exit_code == 2, r.output
    assert r.output.strip() == f"error: {msg}"


def test_bench_kvcache_block_size_limit_is_checked_by_the_library_too():
    from xllm_vmm.bench.kvcache import MAX_BLOCK_SIZE, run_kvcache_bench

    assert MAX_BLOCK_SIZE == 1024  # 1024 tokens x 2 KiB per layer's K = one 2 MiB page
    with pytest.raises(ValueError, match=r"--block-size must be in \[1, 1024\]"):
        run_kvcache_bench(KvBenchConfig(block_size=1025))


def test_bench_kvcache_on_the_host_refuses_a_trace_that_does_not_fit(monkeypatch):
    import xllm_vmm.bench.limits as limits

    monkeypatch.setattr(limits, "host_headroom", lambda: 64 << 20)  # a 64 MiB host
    r = CliRunner().invoke(app, ["bench", "kvcache", "--driver", "host", "--sequences", "8"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: bench kvcache --driver host: --sequences 8 needs ")
    assert "but this host can commit 67108864 bytes (0.06 GiB) now" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_bench_kvcache_on_the_host_names_the_largest_sequences_that_fit(monkeypatch):
    import xllm_vmm.bench.limits as limits
    from xllm_vmm.bench.kvcache import _peak_live_blocks

    # 36 layers: 144 MiB per slot of 8 blocks; a 3 GiB host takes 21 slots (168 blocks)
    monkeypatch.setattr(limits, "host_headroom", lambda: 3 << 30)
    peaks = {n: _peak_live_blocks(make_trace(KvBenchConfig(sequences=n))[0])
             for n in (14, 15, 16)}
    assert peaks == {14: 156, 15: 160, 16: 180}  # 15 sequences: 20 slots; 16: 23 slots
    r = CliRunner().invoke(app, ["bench", "kvcache", "--driver", "host", "--sequences", "256"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: bench kvcache --driver host: --sequences 256 needs "
                               "43335548928 bytes (40.36 GiB: ")
    assert r.output.strip().endswith("now; use --sequences 15 or less")


def test_bench_kvcache_run_failure_is_one_line_exit_1(monkeypatch):
    import xllm_vmm.bench.kvcache as kb

    def boom(cfg):
        raise RuntimeError("virtual KV cache ran out of memory on the benchmark trace")

    monkeypatch.setattr(kb, "run_kvcache_bench", boom)
    r = CliRunner().invoke(app, ["bench", "kvcache"])
    assert r.exit_code == 1
    assert r.output.strip() == ("error: bench kvcache --driver sim failed: virtual KV cache ran "
                                "out of memory on the benchmark trace")


def test_trace_frees_every_sequence_and_marks_the_idle_point():
    ops, generated = make_trace(KvBenchConfig(sequences=20, seed=3))
    allocs = {op.seq for op in ops if op.kind == "alloc"}
    frees = [op.seq for op in ops if op.kind == "free"]
    assert sorted(frees) == sorted(allocs) == list(range(20))
    assert sum(1 for op in ops if op.kind == "idle") == 1 and generated > 0


def test_freelist_baseline_is_fifo_and_refcounted():
    p = FreeListBlockPool(4)
    assert p.allocate(3) == [0, 1, 2]
    p.free([1])
    assert p.allocate(2) == [3, 1] and p.allocate(1) is None


def test_serving_trace_and_the_cycle_baseline_do_the_same_block_operations():
    """Both sides of manager_cycle_vs_freelist_ratio replay one trace to the same hits."""
    from xllm_vmm.bench.kvcache import (
        FreeListPrefixPool,
        _manager_for,
        _replay_cycles_baseline,
        _replay_cycles_manager,
        _trace_blocks,
        make_serving_trace,
    )

    ev = make_serving_trace(8, 40, 16, seed=1)
    assert sum(1 for e in ev if e[0] == 0) == sum(1 for e in ev if e[0] == 2) == 40
    n = _trace_blocks(ev, 16)
    base = FreeListPrefixPool(n, 16)
    _, ops_b = _replay_cycles_baseline(ev, base)
    mgr, pool, d = _manager_for(n, 16)
    try:
        _, ops_m = _replay_cycles_manager(ev, mgr)
        assert ops_b == ops_m
        st = mgr.stats()
        assert st["requests"] == 0 and st["live_blocks"] == 0
        assert st["prefix_hit_tokens"] > 0  # the shared system prompts hit
        # the same prompts hit the baseline's index as deep as the manager's
        for e in ev:
            if e[0] == 0:
                toks = e[2]
                assert base.lookup("x", toks) == mgr.lookup("x", toks).num_tokens
                base.reqs.pop("x")
                mgr.drop("x")
    finally:
        mgr.close()
        pool.close()
        d.close()


def test_flat_serving_trace_refers_to_one_token_list_per_request():
    """The cycle replays read a prepared trace: every event of a request refers to its one
    token list (prompt, then each decoded token), the committed count rises by one per decode
    token, and the token values are the raw trace's."""
    from xllm_vmm.bench.kvcache import _flatten, make_serving_trace

    raw = [(0, "a", [5, 6, 7]), (1, "a", 8), (0, "b", [1, 2]), (3,), (1, "a", 9),
           (1, "b", 3), (2, "a"), (3,), (2, "b"), (3,)]
    flat = _flatten(raw)
    assert [e[0] for e in flat] == [e[0] for e in raw]
    ta, tb = flat[0][3], flat[2][3]
    assert ta == [5, 6, 7, 8, 9] and tb == [1, 2, 3]
    assert flat[0][2] == [5, 6, 7] and flat[2][2] == [1, 2]
    assert all(x is y for x, y in zip(flat[0][2], ta))  # the prompt is the list's own ints
    assert [(e[1], e[2]) for e in flat if e[0] == 1] == [("a", 4), ("a", 5), ("b", 3)]
    assert all(e[3] is (ta if e[1] == "a" else tb) for e in flat if e[0] == 1)
    assert flat[6] == (2, "a") and flat[3] == (3,)

    ev = make_serving_trace(8, 40, 16, seed=1)
    last: dict[str, int] = {}
    for e in ev:
        if e[0] == 0:
            assert e[3][:len(e[2])] == e[2] and e[1] not in last
            last[e[1]] = len(e[2])
        elif e[0] == 1:
            assert e[2] == last[e[1]] + 1 <= len(e[3])
            last[e[1]] = e[2]
        elif e[0] == 2:
            assert last.pop(e[1]) >= 0
    assert not last


def test_cycle_measurements_interleave_every_trace():
    from xllm_vmm.bench.kvcache import _measure_cycles, make_serving_trace

    traces = [make_serving_trace(4, 8, 16, seed=2), make_serving_trace(8, 8, 16, seed=2)]
    out = _measure_cycles(traces, 16, 0.0, 2)
    assert len(out) == 2
    for res in out:
        assert res["loops"] == 1 and res["ops_per_replay"] > 0
        assert len(res["manager_s_per_op"]) == len(res["baseline_s_per_op"]) == 2


def test_compared_traces_are_measured_with_the_same_replay_counts(monkeypatch):
    """The cost-growth traces (``compared``) get, per side, the largest of their calibrated
    replay counts; a trace outside them keeps its own."""
    import xllm_vmm.bench.kvcache as kb

    traces = [kb.make_serving_trace(4, 8, 16, seed=2), kb.make_serving_trace(8, 8, 16, seed=2),
              kb.make_serving_trace(16, 8, 16, seed=2)]
    counts = iter([3, 5, 1, 2, 2, 1])  # (manager, baseline) for each trace, in order
    monkeypatch.setattr(kb, "_loops_for", lambda replay, min_seconds: next(counts))
    out = kb._measure_cycles(traces, 16, 0.0, 1, compared=(1, 2))
    assert [(r["loops"], r["baseline_loops"]) for r in out] == [(3, 5), (2, 2), (2, 2)]


def test_cycle_ops_per_replay_counts_the_verb_calls_both_replays_make():
    from xllm_vmm.bench.kvcache import (
        FreeListPrefixPool,
        _measure_cycles,
        _replay_cycles_baseline,
        _trace_blocks,
        make_serving_trace,
    )

    ev = make_serving_trace(8, 40, 16, seed=1)
    _, n = _replay_cycles_baseline(ev, FreeListPrefixPool(_trace_blocks(ev, 16), 16))
    assert _measure_cycles([ev], 16, 0.0, 1)[0]["ops_per_replay"] == n


def test_bench_kvcache_freezes_its_traces_and_leaves_a_frozen_heap_alone(monkeypatch):
    """The run freezes the heap (its prepared traces) while it measures, as the engine's
    start-up does, and thaws it after; a heap someone else froze is neither frozen again nor
    thawed."""
    import gc

    from xllm_vmm.bench.kvcache import run_kvcache_bench

    calls: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    cfg = KvBenchConfig(sequences=8, layers=2, repeats=1, min_seconds=0, cycle_requests=16,
                        growth_requests=16)
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 0)
    run_kvcache_bench(cfg)
    assert calls == ["freeze", "unfreeze"]
    calls.clear()
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 123)  # an engine froze its heap
    run_kvcache_bench(cfg)
    assert calls == []


def test_bench_kvcache_full_pool_keeps_every_exact_lru_hit():
    """The full-pool steady state: every case reported, and no request's hit shorter than the
    exact-LRU baseline's (the manager evicts a block shortfall by exact LRU)."""
    r = CliRunner().invoke(app, ["bench", "kvcache", "--sequences", "12", "--layers", "2",
                                 "--repeats", "1", "--min-seconds", "0", "--cycle-requests",
                                 "64", "--growth-requests", "96", "--full-pool-requests", "96",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    for trace in ("serving", "multi_turn", "no_reuse"):
        for bs in (16, 128):
            for conc in (64, 4096):
                key = f"full_{trace}_b{bs}_c{conc}"
                assert out[f"{key}_vs_freelist_ratio"] > 0, key
                assert out[f"{key}_hit_losses"] == 0, key
                assert out[f"{key}_hit_tokens"] >= out[f"{key}_freelist_hit_tokens"], key
            assert out[f"full_{trace}_b{bs}_growth_4096_vs_64"] > 0
    assert out["full_serving_b16_c64_hit_tokens"] > 0  # shared system prompts hit
    assert out["full_no_reuse_b16_c64_hit_tokens"] == 0


def test_full_pool_side_starts_full_of_cached_prefixes():
    from xllm_vmm.bench.kvcache import (_full_pool_side, _prefill_events, full_pool_blocks,
                                        make_full_pool_trace)

    events = make_full_pool_trace("multi_turn", 8, 64, 16)
    nb = full_pool_blocks(events, 16)
    mgr, close = _full_pool_side("manager", nb, 16, _prefill_events(nb, 16, 0))
    try:
        # every block cached but the few the last pre-fill requests' partial blocks left free
        assert nb - 9 <= mgr.prefix.num_evictable("attn") <= nb
    finally:
        close()
