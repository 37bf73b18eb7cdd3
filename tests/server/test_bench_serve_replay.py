"""``bench serve --engine-only``: the same load straight on the engine (no server)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from xllm_vmm.bench import serve as bs
from xllm_vmm.bench import serve_replay as sr


def test_engine_args_split_serve_args():
    args = bs.serve_args("/m", ["--max_seqs_per_batch=8", "--port=0"], 16, 0.5, 8)
    model, flags, options = sr.engine_args(args + ["--dtype", "float32"])
    assert model == "/m"
    assert options == {"max_model_len": 64, "device_memory": "4GiB", "dtype": "float32"}
    assert "--max_seqs_per_batch=8" in flags and "--enable_vmm_kvcache=true" in flags
    assert not any(f.startswith(("--port", "--model", "--max-model-len")) for f in flags)
    with pytest.raises(ValueError, match="--block_size=VALUE"):
        sr.engine_args(["--block_size", "16"])


def test_make_load_is_the_same_for_the_same_seed():
    cfg = bs.LoadConfig(num_prompts=9, input_len=20, output_len=4, seed=3)
    a, b = bs.make_load(cfg, 300, 64), bs.make_load(cfg, 300, 64)
    assert a == b
    prompts, gaps, lo = a
    assert all(10 <= len(p) <= 30 and all(4 <= t < 300 for t in p) for p in prompts)
    assert lo == 10 and len(gaps) == 9 and all(g > 0 for g in gaps)
    with pytest.raises(ValueError, match="context of 12 tokens"):
        bs.make_load(cfg, 300, 12)  # 10-token prompts + 4 do not fit


def test_replay_on_the_real_engine(tiny_llama_dir):
    cfg = bs.LoadConfig(num_prompts=6, request_rate=float("inf"), input_len=12, output_len=8)
    args = bs.serve_args(str(tiny_llama_dir), ["--device-memory=256MiB"], 12, 0.5, 8)
    out = sr.replay(cfg, args)
    assert out["mode"] == "engine-only"
    assert "omp_wait_policy" in out  # torch came first here: left as the environment has it
    assert out["completed"] == 6 and out["failures"] == 0 and out["total_output_tokens"] == 48
    assert out["engine_steps"] >= 8 and 0 < out["engine_busy_fraction"] <= 1
    for k in ("ttft_ms_median", "tpot_ms_median", "itl_ms_median", "output_throughput"):
        assert out[k] > 0 and math.isfinite(out[k]), k


def test_engine_only_cli_refuses_url():
    proc = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "bench", "serve",
                           "--engine-only", "--url", "http://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--engine-only" in proc.stderr
