"""Smoke tests of ``bench map`` and ``bench copy``: tiny sizes, field presence and sanity,
never speed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from xllm_vmm.cli.app import app


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_bench_map_json_fields(device, monkeypatch):
    monkeypatch.setenv("XLLM_VMM_ACL_LIBRARY", "emulation")
    r = CliRunner().invoke(app, ["bench", "map", "--device", device, "--pages", "4", "--rounds", "2",
                                 "--repeats", "1", "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["pages"] == 4 and out["page_bytes"] == 2 * 1024 * 1024
    for key in ("batched_vs_raw_ratio", "python_overhead_us_per_page", "batched_us_per_page",
                "raw_us_per_page", "per_call_us_per_page"):
        assert isinstance(out[key], float), key
    assert out["batched_us_per_page"] > 0 and out["raw_us_per_page"] > 0
    assert out["batched_vs_raw_ratio"] == pytest.approx(out["batched_us_per_page"] / out["raw_us_per_page"])
    populated = ("populated_batched_us_per_page", "populated_raw_us_per_page",
                 "populated_batched_vs_raw_ratio", "map_write_us_per_page",
                 "populated_map_write_us_per_page", "fresh_map_write_us_per_page",
                 "populated_fresh_map_write_us_per_page", "populate_map_write_speedup",
                 "populate_fresh_map_write_speedup")
    if device == "cpu":  # populated maps on both sides (MAP_POPULATE in the raw loop too)
        for key in populated:
            assert isinstance(out[key], float) and out[key] > 0, key
        assert out["populated_batched_vs_raw_ratio"] == pytest.approx(
            out["populated_batched_us_per_page"] / out["populated_raw_us_per_page"])
        assert out["populate_map_write_speedup"] == pytest.approx(
            out["map_write_us_per_page"] / out["populated_map_write_us_per_page"])
    else:  # device memory has no page faults to populate
        assert out["populated_batched_us_per_page"] is None and "map_write_us_per_page" not in out


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_bench_copy_json_fields_and_data(device, monkeypatch):
    monkeypatch.setenv("XLLM_VMM_ACL_LIBRARY", "emulation")
    r = CliRunner().invoke(app, ["bench", "copy", "--device", device, "--blocks", "5", "--repeats", "1",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    # sizes cycle 64K, 128K, 256K, 512K, 1M
    assert out["total_bytes"] == (64 + 128 + 256 + 512 + 1024) * 1024
    assert out["copy_vs_memcpy_ratio"] > 0 and out["data_verified"] is True


def test_bench_rejects_bad_device_and_block_sizes():
    r = CliRunner().invoke(app, ["bench", "map", "--device", "tpu"])
    assert r.exit_code == 2 and "--device 'tpu'" in r.output
    r = CliRunner().invoke(app, ["bench", "copy", "--max-block", str(4 << 20)])
    assert r.exit_code == 2 and "--max-block" in r.output
