"""``xllm-vmm bench weights --format json`` on a tiny checkpoint: every field the issue names,
with the values that do not depend on speed checked."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")

from xllm_vmm.cli.app import app  # noqa: E402
import xllm_vmm.cli.bench  # noqa: E402,F401  (registers the bench commands)

FIELDS = ("load_seconds", "light_sleep_seconds", "wakeup_seconds", "wakeup_vs_reload_ratio",
          "sleep_released_fraction", "deep_wakeup_seconds", "fork_extra_weight_bytes",
          "cycle_growth_bytes")


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_bench_weights_json(tmp_path, device):
    args = ["bench", "weights", "--size", "4MiB", "--shards", "2", "--repeats", "1",
            "--cycles", "3", "--device", device, "--format", "json"]
    if device == "npu":
        args += ["--acl-library", "emulation"]
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


def test_bench_weights_refuses_bad_options():
    runner = CliRunner()
    for args, text in ((["--size", "lots"], "is not a size"),
                       (["--size", "1KiB"], "--size must be"),
                       (["--repeats", "0"], "--repeats must be"),
                       (["--dtype", "int4"], "--dtype 'int4'")):
        out = runner.invoke(app, ["bench", "weights", *args])
        assert out.exit_code == 2 and text in out.output, out.output
