"""Smoke test of `xllm-vmm bench prefix` with tiny sizes: fields present and sane, never speed."""

import json

import pytest
from typer.testing import CliRunner

from xllm_vmm.cli.app import app

TINY = ["bench", "prefix", "--format", "json", "--hash-tokens", "4096", "--lookup-blocks",
        "2048", "--requests", "16", "--block-size", "16"]

FIELDS = ["hash_vs_sha256_ratio", "lookup_us_1k", "lookup_us_1m", "hit_rate_device_only",
          "hit_rate_with_host", "host_hit_rate_gain", "restore_vs_memcpy_ratio",
          "bytes_freed_per_eviction_ratio"]


def test_bench_prefix_json_has_every_named_field():
    r = CliRunner().invoke(app, TINY)
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    for f in FIELDS:
        assert f in res, f
    assert res["hash_vs_sha256_ratio"] > 0 and res["lookup_us_1k"] > 0 and res["lookup_us_1m"] > 0
    assert 0 <= res["hit_rate_device_only"] <= 1 and 0 <= res["hit_rate_with_host"] <= 1
    assert res["host_hit_rate_gain"] == pytest.approx(
        res["hit_rate_with_host"] - res["hit_rate_device_only"])
    # the workload is deterministic (seeded): the device budget is below the working set, so
    # the device alone evicts prefixes the host tier then restores
    assert res["workload_device_budget_blocks"] < res["workload_working_set_blocks"]
    assert res["host_restores"] > 0 and res["host_hit_rate_gain"] > 0
    assert res["restore_vs_memcpy_ratio"] > 0
    # restores into populated mappings, and the same workload without populating, both also
    # counted with the allocation that maps their blocks
    assert res["restore_populated"] is True
    for f in ("restore_with_map_vs_memcpy_ratio", "restore_unpopulated_vs_memcpy_ratio",
              "restore_unpopulated_with_map_vs_memcpy_ratio"):
        assert res[f] > 0, f
    assert res["restore_with_map_vs_memcpy_ratio"] < res["restore_vs_memcpy_ratio"]
    # one slot = 8 blocks of 2 x 256 KiB: slot-emptying frees a whole slot per 8 blocks
    assert res["bytes_freed_per_eviction_slot_emptying"] == 2 * 2 * 1024 * 1024 / 8
    assert res["bytes_freed_per_eviction_ratio"] > 1
    assert res["lookup_1m_measured_at_blocks"] == 2048


def test_bench_prefix_without_populate_runs_the_workload_once():
    r = CliRunner().invoke(app, TINY + ["--no-populate"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["restore_populated"] is False and res["restore_vs_memcpy_ratio"] > 0
    assert not any(k.startswith("restore_unpopulated") for k in res)


@pytest.mark.parametrize("args,msg", [
    (["--driver", "cuda"], "--driver must be 'host' or 'acl-emu'"),
    (["--host-blocks-factor", "1"], "--host-blocks-factor must be > 1"),
    (["--lookup-blocks", "10"], "--lookup-blocks must be >= 1024"),
])
def test_bench_prefix_bad_options_are_clear_errors(args, msg):
    r = CliRunner().invoke(app, ["bench", "prefix"] + args)
    assert r.exit_code == 2
    assert msg in r.output
