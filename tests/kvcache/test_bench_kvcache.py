"""Smoke test of ``xllm-vmm bench kvcache`` with tiny sizes: field presence and sanity only
(never speed)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from xllm_vmm.bench.kvcache import FreeListBlockPool, KvBenchConfig, make_trace
from xllm_vmm.cli.app import app


def test_bench_kvcache_json_reports_the_named_fields():
    r = CliRunner().invoke(app, ["bench", "kvcache", "--sequences", "12", "--layers", "2",
                                 "--repeats", "1", "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    for key in ("alloc_vs_freelist_ratio", "idle_footprint_ratio", "peak_footprint_ratio",
                "map_calls_per_1k_tokens", "admission_us", "cache_vs_freelist_ratio",
                "freelist_idle_footprint_ratio"):
        assert isinstance(out[key], float) and out[key] > 0, key
    assert out["peak_footprint_ratio"] >= 1.0 and out["idle_footprint_ratio"] >= 1.0
    assert out["peak_mapped_bytes"] >= out["peak_packed_floor_bytes"] > 0
    assert out["blocks_per_slot"] == 8 and out["slot_bytes"] == 4 * (2 << 20)
    assert out["map_calls"] >= 1 and out["generated_tokens"] > 0
    assert isinstance(out["alloc_groups_api_vs_freelist_ratio"], float)
    # compaction at the idle point never leaves more than the packed floor plus one slot
    assert out["idle_footprint_ratio_before_compaction"] >= out["idle_footprint_ratio"]
    assert out["idle_mapped_bytes"] - out["idle_packed_floor_bytes"] < out["slot_bytes"]
    assert out["compaction_bytes_copied"] == out["compaction_blocks_moved"] * 2 * 2 * (1 << 18)
    assert (out["idle_mapped_bytes_before_compaction"] - out["idle_mapped_bytes"]
            == out["compaction_bytes_released"])


def test_default_trace_meets_the_footprint_targets_after_compaction():
    from xllm_vmm.bench.kvcache import run_kvcache_bench

    out = run_kvcache_bench(KvBenchConfig(repeats=1))
    assert out["idle_footprint_ratio"] == 1.0 and out["peak_footprint_ratio"] == 1.0
    assert round(out["idle_footprint_ratio_before_compaction"], 4) == 2.3958
    assert out["compaction_blocks_moved"] == 97
    assert out["compaction_bytes_copied"] == 97 * 36 * 2 * 128 * 8 * 128 * 2


def test_bench_kvcache_refuses_bad_options_by_name():
    r = CliRunner().invoke(app, ["bench", "kvcache", "--sequences", "0"])
    assert r.exit_code == 2 and "--sequences must be >= 1, got 0" in r.output


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
