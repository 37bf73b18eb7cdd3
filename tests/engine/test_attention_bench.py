"""``xllm-vmm bench attention`` runs (tiny sizes) and refuses bad options with exit 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from xllm_vmm.cli.app import app
from xllm_vmm.engine.attention import native_decode as nd

pytestmark = pytest.mark.skipif(nd.load() is None, reason="libxllm_paged_attn.so is not built")


def test_bench_attention_json():
    r = CliRunner().invoke(app, ["bench", "attention", "--batch", "5", "--head-dim", "64",
                                 "--threads", "1", "--threads", "2", "--dtype", "bfloat16",
                                 "--dtype", "float32", "--max-keys", "70", "--repeats", "1",
                                 "--prefill", "20", "--prefill", "7:30", "--prefill-tokens",
                                 "40", "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    for case in ("b5_d64_t1_bfloat16", "b5_d64_t2_float32"):
        assert out[f"{case}_native_cpu_min_ms"] >= 0
        assert out[f"{case}_sdpa_cpu_median_ms"] >= 0
        assert out[f"{case}_native_speedup_ratio"] > 0
    assert out["b5_d64_t1_float32_max_abs_diff"] < 1e-4  # same attention, both paths
    assert out["b5_d64_t1_bfloat16_max_abs_diff"] < 3e-2
    assert out["native_impl"] in ("amx-bf16", "avx512-bf16", "portable")
    assert out["min_native_speedup_ratio"] > 0
    # the roofline: the kernel's K/V read rate against a plain read of the same bytes
    for case in ("b5_d64_t1_bfloat16", "b5_d64_t2_float32"):
        assert out[f"{case}_stream_read_gbps"] > 0 and out[f"{case}_native_read_gbps"] > 0
        # both rates are rounded to 0.01 GB/s (tiny cases read at well under 1 GB/s), the
        # ratio to 0.001 from the unrounded ones: it lies within the rounded rates' bounds
        k, s = out[f"{case}_native_read_gbps"], out[f"{case}_stream_read_gbps"]
        lo, hi = max(k - 0.005, 0.0) / (s + 0.005), (k + 0.005) / max(s - 0.005, 1e-9)
        assert lo - 1e-3 <= out[f"{case}_roofline_ratio"] <= hi + 1e-3
    # prefill cases: the backend with its chunks on the native kernel against SDPA
    for case, chunks in (("p20_o0_d64_t1_bfloat16", 2), ("p7_o30_d64_t2_float32", 5)):
        assert out[f"{case}_native_cpu_median_ms"] >= 0
        assert out[f"{case}_sdpa_wall_min_ms"] >= 0
        assert out[f"{case}_native_speedup_ratio"] > 0
        assert out[f"{case}_chunks"] == chunks
    assert out["p20_o0_d64_t1_float32_max_abs_diff"] < 1e-4
    assert out["p7_o30_d64_t1_bfloat16_max_abs_diff"] < 3e-2
    assert out["prefill_impl"] in ("amx-bf16", "avx512-bf16", "portable")
    assert out["min_prefill_speedup_ratio"] > 0


@pytest.mark.parametrize("args, message", [
    (["--heads", "6"], "--heads 6 must be a multiple of --kv-heads 4"),
    (["--min-keys", "80", "--max-keys", "70"], "need 1 <= min <= max"),
    (["--dtype", "float16"], "dtype 'float16' is not one of"),
    (["--repeats", "0"], "--repeats"),
    (["--prefill", "0:5"], "--prefill '0:5': expected N or N:OFFSET"),
    (["--prefill", "abc"], "--prefill 'abc'"),
    (["--prefill-tokens", "0"], "--prefill-tokens"),
])
def test_bench_attention_bad_options(args, message):
    r = CliRunner().invoke(app, ["bench", "attention", "--batch", "2", "--head-dim", "64",
                                 "--threads", "1", "--repeats", "1", *args])
    assert r.exit_code == 2
    assert message in r.output


FAKE_VLLM = '''
import json, sys
spec = json.load(sys.stdin)
out = {"vllm_isa": "fake"}
for c in spec["cases"]:
    assert c["kind"] in ("decode", "prefill") and spec["repeats"] >= 1
    k = c["key"]
    out.update({k + "_vllm_cpu_min_ms": 1.0, k + "_vllm_cpu_median_ms": 2.0,
                k + "_vllm_wall_median_ms": 2.5})
print("a line vLLM logs")
print(json.dumps(out))
'''


def test_bench_attention_vllm_side(tmp_path):
    """``--vllm-venv``: the venv's python gets every case (decode and prefill) and its figures
    come back with the ratios; a venv without python, or a failing side, is exit 2 naming the
    option."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE_VLLM)
    py = venv / "bin" / "python"
    import sys

    py.write_text(f"#!/bin/sh\nexec {sys.executable} {fake}\n")
    py.chmod(0o755)
    args = ["bench", "attention", "--batch", "4", "--head-dim", "64", "--threads", "1",
            "--min-keys", "8", "--max-keys", "40", "--repeats", "1", "--prefill", "16",
            "--prefill-tokens", "32",
            "--format", "json"]
    r = CliRunner().invoke(app, args + ["--vllm-venv", str(venv)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    for key in ("b4_d64_t1_bfloat16", "p16_o0_d64_t1_bfloat16"):
        assert out[f"{key}_vllm_cpu_median_ms"] == 2.0
        assert out[f"{key}_native_vs_vllm_ratio"] == pytest.approx(
            2.0 / out[f"{key}_native_cpu_median_ms"], rel=1e-2)
    assert out["min_native_vs_vllm_ratio"] == out["b4_d64_t1_bfloat16_native_vs_vllm_ratio"]
    assert out["min_prefill_vs_vllm_ratio"] == out["p16_o0_d64_t1_bfloat16_native_vs_vllm_ratio"]
    assert out["vllm_isa"] == "fake"
    r = CliRunner().invoke(app, args + ["--vllm-venv", str(tmp_path / "none")])
    assert r.exit_code == 2 and "--vllm-venv" in r.output and "no " in r.output
    fake.write_text("import sys; sys.stderr.write('boom\\n'); sys.exit(3)\n")
    r = CliRunner().invoke(app, args + ["--vllm-venv", str(venv)])
    assert r.exit_code == 2 and "--vllm-venv" in r.output and "boom" in r.output
