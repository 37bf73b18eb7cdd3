"""``xllm-vmm bench engine`` smoke run: a tiny built model, every documented field present and
sane (speed itself is never asserted: the machine is shared)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from xllm_vmm.cli.app import app


def test_bench_engine_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = CliRunner().invoke(app, [
        "bench", "engine", "--prompts", "3", "--min-prompt", "5", "--max-prompt", "20",
        "--new-tokens", "3", "--batch-sizes", "1,2", "--equal-prompt", "6", "--hidden", "64",
        "--layers", "1", "--repeats", "2", "--device-memory", "256MiB", "--format", "json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    for k in ("vs_hf_generate_ratio", "vs_hf_generate_ratio_min", "engine_tokens_per_s_median",
              "hf_tokens_per_s_median", "ttft_s_median", "tpot_s_median",
              "engine_tokens_per_s_b1", "hf_tokens_per_s_b2", "peak_mapped_over_live_kv"):
        assert doc[k] > 0, k
    assert doc["vs_hf_generate_ratio_min"] <= doc["vs_hf_generate_ratio"]
    assert doc["peak_live_kv_bytes"] > 0
    assert doc["peak_mapped_kv_bytes"] >= doc["peak_live_kv_bytes"]
    assert 5 <= doc["prompt_tokens_min"] <= doc["prompt_tokens_max"] <= 20
    assert 0 <= doc["greedy_match_fraction"] <= 1


def test_bench_engine_bad_options_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = CliRunner().invoke(app, ["bench", "engine", "--min-prompt", "50", "--max-prompt", "10"])
    assert r.exit_code == 2 and "--max-prompt" in r.stderr
    r = CliRunner().invoke(app, ["bench", "engine", "--batch-sizes", "a,b"])
    assert r.exit_code == 2 and "--batch-sizes" in r.stderr
