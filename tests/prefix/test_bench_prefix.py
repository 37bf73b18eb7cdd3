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
    # the device budget is below the working set, so the device alone evicts prefixes the host
    # tier then restores; the counts are deterministic (seeded, each write-through finished
    # before the next request): the same on every run
    assert res["workload_device_budget_blocks"] < res["workload_working_set_blocks"]
    assert res["host_restores"] == 8
    assert res["hit_rate_device_only"] == pytest.approx(0.21333333333333335)
    assert res["hit_rate_with_host"] == pytest.approx(0.5866666666666667)
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
    (["--host-blocks-factor", "nan"], "--host-blocks-factor must be > 1 (the host tier is off "
                                      "at 1 or less, HK-03), got nan"),
    (["--host-blocks-factor", "inf"], "--host-blocks-factor must be a finite number in "
                                      "[1, 1024], got inf"),
    (["--host-blocks-factor", "2000"], "--host-blocks-factor must be a finite number in "
                                       "[1, 1024], got 2000.0"),
    (["--lookup-blocks", "10"], "--lookup-blocks must be >= 1024"),
    (["--lookup-blocks", "100000000"], "--lookup-blocks must be an integer in [1024, 4194304]"),
    (["--block-size", "0"], "--block-size must be an integer in [1, 1024], got 0"),
    (["--block-size", "4096"], "--block-size must be an integer in [1, 1024], got 4096"),
    (["--requests", "0"], "--requests must be >= 1, got 0"),
    (["--requests", "100000"], "--requests must be an integer in [1, 1000], got 100000"),
    (["--system-prompts", "1000"], "--system-prompts must be an integer in [1, 256]"),
    (["--hash-tokens", "100"], "--hash-tokens must be >= 128, got 100"),
])
def test_bench_prefix_bad_options_are_clear_errors(args, msg):
    r = CliRunner().invoke(app, ["bench", "prefix"] + args)
    assert r.exit_code == 2
    assert msg in r.output


def test_bench_prefix_refuses_a_host_pool_that_does_not_fit_before_running(monkeypatch):
    import xllm_vmm.bench.limits as limits
    import xllm_vmm.bench.prefix as pb

    monkeypatch.setattr(limits, "host_headroom", lambda: 64 * 1024 * 1024 + 200 * 1024 * 1024)
    monkeypatch.setattr(pb, "_hash_bench", lambda *a: pytest.fail("ran before the check"))
    r = CliRunner().invoke(app, ["bench", "prefix", "--host-blocks-factor", "8"])
    assert r.exit_code == 2, r.output
    # 200 MiB for the pool (the copy baseline's 64 MiB ring aside); the device KV capacity of
    # the workload is 128 blocks of 512 KiB = 64 MiB, so 8x needs 512 MiB and 3.12x fits
    assert r.output.strip() == (
        "error: bench prefix --driver host: --host-blocks-factor 8 needs 536870912 bytes "
        "(0.50 GiB: a host KV pool of 1024 blocks, the factor x the workload's device KV "
        "capacity of 67108864 bytes) but this host can commit 209715200 bytes (0.20 GiB) now; "
        "use --host-blocks-factor 3.12 or less")


def test_populate_index_leaves_the_state_publish_leaves():
    import random

    from xllm_vmm.bench.prefix import populate_index
    from xllm_vmm.kvcache.prefix import PrefixCache

    from xllm_vmm.kvcache.allocator import BlockAllocator, GroupShape

    class Backing:
        def activate(self, slots):
            return True

        def deactivate(self, slots):
            pass

    def alloc():
        return BlockAllocator([GroupShape("k", 1000, 1), GroupShape("v", 1000, 1)], Backing())

    rng = random.Random(1)
    hashes = [rng.getrandbits(128) for _ in range(1000)]
    a = PrefixCache(alloc(), {"k": 1, "v": 1}, 16)
    b = PrefixCache(alloc(), {"k": 1, "v": 1}, 16)
    a.allocator.allocate({"k": 1000, "v": 1000})  # published blocks are live blocks
    assert a.publish({"k": range(1000), "v": range(1000)}, hashes) == 1000
    populate_index(b, hashes)
    for name in ("k", "v"):
        assert a._groups[name] == b._groups[name]
    assert a.stats == b.stats
    assert b.lookup(hashes[:40] + [1, 2]).num_blocks == 40
    assert b.block_of("v", hashes[7]) == 7 and b.hash_of("k", 999) == hashes[999]
    with pytest.raises(ValueError, match="empty prefix cache"):
        populate_index(b, hashes)


def test_default_lookup_size_is_one_million_blocks():
    from xllm_vmm.bench.prefix import PrefixBenchConfig

    assert PrefixBenchConfig().lookup_blocks == 1 << 20
