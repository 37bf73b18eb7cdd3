"""``xllm-vmm bench weights --format json`` on a tiny checkpoint: every field the issue names,
the phases of sleep and wakeup, the memcpy reference, the engine (weights + KV) sleep, and the
host driver's figures per huge-page backing, with the values that do not depend on speed
checked."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")

from xllm_vmm.cli.app import app  # noqa: E402
import xllm_vmm.cli.bench  # noqa: E402,F401  (registers the bench commands)

FIELDS = ("load_seconds", "light_sleep_seconds", "wakeup_seconds", "wakeup_vs_reload_ratio",
          "sleep_released_fraction", "deep_wakeup_seconds", "fork_extra_weight_bytes",
          "cycle_growth_bytes", "memcpy_seconds", "wakeup_vs_memcpy_ratio", "backing",
          "engine_light_sleep_seconds", "engine_kv_sleep_seconds", "engine_wakeup_seconds")
SLEEP_PHASES = ("sync", "unmap", "release", "other")
WAKE_PHASES = ("commit", "map", "copy", "other")


def _phases_add_up(r: dict, prefix: str = "") -> None:
    sleep = sum(r[f"{prefix}light_sleep_{p}_seconds"] for p in SLEEP_PHASES)
    wake = sum(r[f"{prefix}wakeup_{p}_seconds"] for p in WAKE_PHASES)
    assert sleep == pytest.approx(r[f"{prefix}light_sleep_seconds"], rel=1e-6, abs=1e-9)
    assert wake == pytest.approx(r[f"{prefix}wakeup_seconds"], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_bench_weights_json(tmp_path, device):
    args = ["bench", "weights", "--size", "4MiB", "--shards", "2", "--repeats", "1",
            "--cycles", "3", "--kv-size", "8MiB", "--device", device, "--format", "json"]
    if device == "npu":
        args += ["--acl-library", "emulation"]
    else:
        args += ["--hugepages", "off"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    r = json.loads(out.stdout)
    for f in FIELDS:
        assert f in r, f
    assert r["weight_bytes"] >= 4 << 20 and r["files"] == 2
    assert r["fork_extra_weight_bytes"] == 0
    assert r["cycle_growth_bytes"] == 0 and r["cycle_fd_growth"] == 0
    assert r["cycle_mapping_growth"] <= 1  # a host buffer may merge with a neighbour VMA or not
    assert r["sleep_released_fraction"] >= 0.99
    assert r["bytes_identical"] is True
    assert isinstance(r["page_cache_dropped"], bool)
    assert r["wakeup_vs_reload_ratio"] == pytest.approx(r["wakeup_seconds"] / r["load_seconds"])
    assert r["wakeup_vs_memcpy_ratio"] == pytest.approx(r["wakeup_seconds"] / r["memcpy_seconds"])
    _phases_add_up(r)
    assert r["backing"] == ("off" if device == "cpu" else "device")
    # the engine's sleep: weights + the KV cache's cached blocks, all released
    assert r["kv_bytes"] >= 8 << 20
    assert r["engine_bytes_freed"] == r["kv_bytes"] + r["device_bytes"]
    assert 0 < r["engine_kv_sleep_seconds"] <= r["engine_light_sleep_seconds"]


def test_bench_weights_per_backing(tmp_path):
    """Every host backing in one run: each measured (root sets its setting and restores it)
    or named unavailable with the reason; the first measured gives the top-level fields."""
    out = CliRunner().invoke(app, ["bench", "weights", "--size", "4MiB", "--shards", "1",
                                   "--repeats", "1", "--cycles", "2", "--kv-size", "0",
                                   "--hugepages", "hugetlb,thp,off", "--format", "json"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.stdout)
    measured = r["backings"].split(",")
    assert measured[-1] == "off" and r["backing"] == measured[0]
    for mode in ("hugetlb", "thp", "off"):
        if mode not in measured:
            assert r[f"{mode}_backing"].startswith("unavailable: ")
            continue
        assert r[f"{mode}_backing"] == mode
        assert r[f"{mode}_sleep_released_fraction"] >= 0.99
        assert r[f"{mode}_cycle_growth_bytes"] == 0 and r[f"{mode}_fork_extra_weight_bytes"] == 0
        assert r[f"{mode}_bytes_identical"] is True
    assert r[f"{measured[0]}_light_sleep_ms_per_gib"] == r["light_sleep_ms_per_gib"]
    assert "engine_light_sleep_seconds" not in r  # --kv-size 0


def test_bench_weights_refuses_bad_options():
    runner = CliRunner()
    for args, text in ((["--size", "lots"], "is not a size"),
                       (["--size", "1KiB"], "--size must be"),
                       (["--repeats", "0"], "--repeats must be"),
                       (["--dtype", "int4"], "--dtype 'int4'"),
                       (["--hugepages", "huge"], "--hugepages 'huge': 'huge' is not one of"),
                       (["--kv-size", "lots"], "--kv-size 'lots' is not a size")):
        out = runner.invoke(app, ["bench", "weights", *args])
        assert out.exit_code == 2 and text in out.output, out.output
