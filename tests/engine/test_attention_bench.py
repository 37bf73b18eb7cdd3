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
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    for case in ("b5_d64_t1_bfloat16", "b5_d64_t2_float32"):
        assert out[f"{case}_native_cpu_min_ms"] >= 0
        assert out[f"{case}_sdpa_cpu_median_ms"] >= 0
        assert out[f"{case}_native_speedup_ratio"] > 0
    assert out["b5_d64_t1_float32_max_abs_diff"] < 1e-4  # same attention, both paths
    assert out["b5_d64_t1_bfloat16_max_abs_diff"] < 3e-2
    assert out["native_impl"] in ("avx512-bf16", "portable")
    assert out["min_native_speedup_ratio"] > 0


@pytest.mark.parametrize("args, message", [
    (["--heads", "6"], "--heads 6 must be a multiple of --kv-heads 4"),
    (["--min-keys", "80", "--max-keys", "70"], "need 1 <= min <= max"),
    (["--dtype", "float16"], "dtype 'float16' is not one of"),
    (["--repeats", "0"], "--repeats"),
])
def test_bench_attention_bad_options(args, message):
    r = CliRunner().invoke(app, ["bench", "attention", "--batch", "2", "--head-dim", "64",
                                 "--threads", "1", "--repeats", "1", *args])
    assert r.exit_code == 2
    assert message in r.output
