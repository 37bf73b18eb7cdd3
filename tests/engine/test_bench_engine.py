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
    assert doc["peak_mapped_over_packed_floor"] >= 1 and doc["kv_slot_bytes"] > 0
    assert 5 <= doc["prompt_tokens_min"] <= doc["prompt_tokens_max"] <= 20
    assert 0 <= doc["greedy_match_fraction"] <= 1
    assert doc["layer_ops"] in ("avx512", "portable", "off")
    assert doc["cpu_model"] and doc["compute_paths"]["cpu_model"] == doc["cpu_model"]
    assert doc["compute_paths"]["packed_linear"].startswith(("on (", "off ("))
    assert doc["compute_paths"]["bf16_compute"].startswith(("bf16 (", "fp32 ("))
    assert doc["host_malloc_tuned"] in (True, False)  # False only off glibc / switched off
    assert doc["max_tokens_per_batch"] == 2048 and doc["prefix_caching"] is False
    assert "vllm_prefix_caching" not in doc  # no vLLM side asked for


def test_bench_engine_token_budget_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = CliRunner().invoke(app, _small(["--max-tokens-per-batch", "8"]))
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["max_tokens_per_batch"] == 8
    r = CliRunner().invoke(app, _small(["--max-tokens-per-batch", "0"]))
    assert r.exit_code == 2 and "--max-tokens-per-batch" in r.stderr


def test_bench_engine_bad_options_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = CliRunner().invoke(app, ["bench", "engine", "--min-prompt", "50", "--max-prompt", "10"])
    assert r.exit_code == 2 and "--max-prompt" in r.stderr
    r = CliRunner().invoke(app, ["bench", "engine", "--batch-sizes", "a,b"])
    assert r.exit_code == 2 and "--batch-sizes" in r.stderr


FAKE_VLLM = r'''
import json, sys, time
spec = json.load(open(sys.argv[-1]))
print("not json: log noise", flush=True)
# echo what the bench asked for, as the real runner reads it back from vLLM's config
print(json.dumps({"ready": True, "enable_prefix_caching": spec["enable_prefix_caching"],
                  "max_num_batched_tokens": 4096, "max_num_seqs": 256}), flush=True)
for line in sys.stdin:
    if line.strip() == "quit":
        break
    time.sleep(0.01)
    outs = [[1] * spec["new_tokens"] for _ in spec["prompts"]]
    print(json.dumps({"seconds": 0.5, "output_tokens": sum(map(len, outs)), "outputs": outs}),
          flush=True)
'''


def _small(extra):
    return ["bench", "engine", "--prompts", "2", "--min-prompt", "5", "--max-prompt", "9",
            "--new-tokens", "2", "--batch-sizes", "1", "--equal-prompt", "4", "--hidden", "64",
            "--layers", "1", "--repeats", "2", "--device-memory", "256MiB", "--format", "json",
            *extra]


def test_bench_engine_vllm_side_by_side_protocol(tmp_path, monkeypatch):
    """A stand-in for the venv's Python speaking the runner's protocol: the ratios come from
    its answers, every repeat; a missing venv is an exact error, the run still completes."""
    import sys

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "fake.py").write_text(FAKE_VLLM)
    py = venv / "bin" / "python"
    py.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake.py'} \"$@\"\n")
    py.chmod(0o755)
    r = CliRunner().invoke(app, _small(["--vllm-venv", str(venv)]))
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert "vllm_error" not in doc
    assert doc["vllm_tokens_per_s_median"] == doc["vllm_tokens_per_s_min"] == 2 * 2 / 0.5
    assert 0 < doc["vs_vllm_ratio_min"] <= doc["vs_vllm_ratio"]
    assert 0 <= doc["vllm_greedy_match_fraction"] <= 1
    # both sides without prefix caching (the trace repeats), both budgets printed
    assert doc["prefix_caching"] is False and doc["vllm_prefix_caching"] is False
    assert doc["max_tokens_per_batch"] == 2048 and doc["vllm_max_num_batched_tokens"] == 4096
    assert doc["max_seqs_per_batch"] == 256 and doc["vllm_max_num_seqs"] == 256
    # exclusive (the default): vLLM's runner started for each of its runs, after ours and
    # HF's, so never resident while they ran
    assert doc["residency"] == "exclusive" and doc["vllm_startups"] == 2
    assert "vllm_paused_while_others_ran" not in doc and doc["vllm_startup_s"] > 0
    # shared: started once, its process stopped while ours and HF ran, resumed for its runs
    r = CliRunner().invoke(app, _small(["--vllm-venv", str(venv), "--residency", "shared"]))
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["residency"] == "shared" and doc["vllm_startups"] == 1
    assert doc["vllm_paused_while_others_ran"] is True
    assert doc["vllm_tokens_per_s_median"] == 2 * 2 / 0.5 and "vllm_error" not in doc
    r = CliRunner().invoke(app, _small(["--vllm-venv", str(venv), "--residency", "both"]))
    assert r.exit_code == 2 and "--residency must be one of exclusive, shared" in r.stderr
    r = CliRunner().invoke(app, _small(["--vllm-venv", str(tmp_path / "nowhere")]))
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert "no " in doc["vllm_error"] and doc["vs_vllm_ratio"] is None
