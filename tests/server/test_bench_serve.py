"""``bench serve``: the load generator's figures, and one bounded run against a real server."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.server.conftest import FakeEngine
from xllm_vmm.bench import serve as bs
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app


def test_percentile_is_numpys_linear():
    rng = np.random.default_rng(0)
    xs = list(rng.random(37))
    for q in (0, 50, 90, 99, 100):
        assert bs.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(bs.percentile([], 50))


def test_parse_metric_sums_matching_labels():
    text = ('# HELP x y\nxllm_vmm_tenant_mapped_bytes{model_name="a",tenant="kv"} 4.0\n'
            'xllm_vmm_tenant_mapped_bytes{model_name="a",tenant="weights"} 8.0\n'
            'xllm_vmm_tenant_mapped_bytes{model_name="b",tenant="kv"} 2.0\n'
            'xllm_vmm_tenant_mapped_bytes_other{tenant="kv"} 100\n')
    assert bs.parse_metric(text, "xllm_vmm_tenant_mapped_bytes", {"tenant": "kv"}) == 6.0
    assert bs.parse_metric(text, "xllm_vmm_tenant_mapped_bytes") == 14.0
    assert bs.parse_metric(text, "nothing") is None


def test_drive_counts_every_request(tokenizer):
    eng = FakeEngine(tokenizer, max_model_len=512)
    app = build_app(AsyncEngine(eng), ServerSettings())
    with RunningServer(app) as srv:
        cfg = bs.LoadConfig(num_prompts=20, request_rate=200.0, input_len=16, output_len=6)
        out = asyncio.run(bs.drive(srv.url, cfg))
    assert out["completed"] == 20 and out["failures"] == 0 and out["errors"] == []
    assert out["total_output_tokens"] == 120
    # the planned arrivals (the sum of the Poisson gaps: 20 at 200/s, ~0.1 s) and the span
    # this client sent them in (each send waits for its planned time, never less)
    assert 0 < out["arrival_span_s"] < 1.0
    assert out["send_span_s"] >= out["arrival_span_s"] * 0.99
    # each send's lateness against its planned time; the loop's wake-up lateness
    assert 0 <= out["send_lag_ms_median"] <= out["send_lag_ms_p99"] <= out["send_lag_ms_max"]
    # (a late send does not delay the next: the span is the plan plus the last one's lag)
    assert out["send_span_s"] * 1e3 <= (out["arrival_span_s"] * 1e3 + out["send_lag_ms_max"]
                                        + 50)
    assert 0 <= out["client_loop_lag_ms_median"] <= out["client_loop_lag_ms_max"]
    # CPU during the load: this process ran the client and the in-process server, so the
    # machine's busy time covers at least this process's; no server pid, no server CPU
    assert out["client_cpu_s"] > 0 and out["server_cpu_s"] is None
    assert out["client_wakeups"] > 0  # it blocked at least between the sends
    assert out["machine_cpu_s"] >= out["client_cpu_s"] - 0.05
    assert out["other_cpu_s"] is None and out["loadavg_end"] >= 0
    # the server process's CPU during its steps, per step and over the steps' wall time
    assert out["engine_step_cpu_ms_mean"] > 0 and out["engine_step_cpu_over_wall"] > 0
    # the engine thread alone: a share of the whole process's CPU during the steps (its
    # window lies inside the process's; a fake engine's steps are microseconds, so the clock
    # reads themselves show and the ratio may pass 1 here, unlike a real engine's)
    assert 0 < out["engine_thread_cpu_over_wall"] <= out["engine_step_cpu_over_wall"]
    # and the share of the steps it waited for a core (schedstat, where Linux keeps it)
    if os.path.exists("/proc/thread-self/schedstat"):
        assert 0 <= out["engine_thread_runqueue_over_wall"] < 1
    else:
        assert out["engine_thread_runqueue_over_wall"] is None
    for k in ("ttft_ms_median", "ttft_ms_p99", "tpot_ms_median", "itl_ms_median", "itl_ms_p99"):
        assert out[k] >= 0 and math.isfinite(out[k]), k
    assert out["ttft_ms_p99"] >= out["ttft_ms_median"]
    assert out["output_throughput"] > 0


def test_drive_reports_failures_not_crashes(tokenizer):
    eng = FakeEngine(tokenizer, max_model_len=512)
    app = build_app(AsyncEngine(eng, max_waiting=0 + 10 ** 9), ServerSettings(api_key="k"))
    with RunningServer(app) as srv:
        cfg = bs.LoadConfig(num_prompts=3, request_rate=float("inf"), input_len=8,
                            output_len=2, api_key="wrong")
        with pytest.raises(Exception):  # /v1/models refuses the key: nothing to drive
            asyncio.run(bs.drive(srv.url, cfg))


@pytest.mark.parametrize("field,value", [("num_prompts", 0), ("request_rate", 0.0),
                                         ("range_ratio", 1.0), ("output_len", 0),
                                         ("timeout", -1.0)])
def test_config_ranges(field, value):
    cfg = bs.LoadConfig(**{field: value})
    with pytest.raises(ValueError, match=field.replace("_", "-")):
        cfg.check()


def test_bench_serve_cli_json_on_a_real_server(tiny_llama_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "xllm_vmm.cli", "bench", "serve", "--model", str(tiny_llama_dir),
         "--num-prompts", "12", "--request-rate", "inf", "--input-len", "24",
         "--output-len", "64", "--timeout", "120", "--serve-arg=--device-memory=256MiB",
         "--format", "json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["completed"] == 12 and out["failures"] == 0
    assert out["total_output_tokens"] == 12 * 64
    assert out["server_exit_code"] == 0
    assert out["kv_live_blocks_after"] == 0
    assert out["kv_mapped_bytes_peak"] >= out["kv_mapped_bytes_after"] > 0
    assert out["kv_mapped_bytes_after"] <= out["kv_packed_floor_bytes_after"] + (2 << 20) * 8
    assert out["reserved_virtual_bytes"] > out["kv_mapped_bytes_peak"]
    assert out["engine_steps"] >= 64 and 0 < out["engine_busy_fraction"] <= 1.0
    # the server's process tree's CPU over the load (from /proc), per output token too
    assert out["server_cpu_s"] > 0 and out["server_cpu_ms_per_output_token"] == pytest.approx(
        1e3 * out["server_cpu_s"] / out["total_output_tokens"])
    assert out["other_cpu_s"] == pytest.approx(out["machine_cpu_s"] - out["server_cpu_s"]
                                               - out["client_cpu_s"])
    assert "--enable_vmm_weights=true" not in out["server"]  # serve's own default weights
    # the CPU and the compute path each part took, from the server's start-up line
    assert out["cpu_model"] and out["compute_paths"]["cpu_model"] == out["cpu_model"]
    assert {"bf16_compute", "layer_ops", "attention_decode"} <= set(out["compute_paths"])
    # the server's own latency by stage (median <= p99, in µs; what the load added)
    for stage in ("overhead", "admit", "pickup", "add", "handoff", "emit"):
        med, p99 = out[f"server_{stage}_us_median"], out[f"server_{stage}_us_p99"]
        assert med is not None and 0 <= med <= p99 <= 1e7, stage


def test_sse_client_framings_and_errors(tokenizer):
    """The load's client (``sse_post``): chunked transfer from the real server, a
    length-framed body with CRLF event ends, and a refusal with its status and body."""

    async def raw_server(payload: bytes, status: str = "200 OK"):
        async def handle(reader, writer):
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/event-stream\r\n"
                         f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            await writer.drain()
            writer.close()

        return await asyncio.start_server(handle, "127.0.0.1", 0)

    async def collect(url, body=None):
        return [d async for d in bs.sse_post(url, body or {}, {})]

    async def main():
        srv = await raw_server(b'data: {"a":1}\r\n\r\ndata: [DONE]\r\n\r\n')
        port = srv.sockets[0].getsockname()[1]
        got = await collect(f"http://127.0.0.1:{port}/v1/completions")
        srv.close()
        bad = await raw_server(b'{"error":"no"}', "400 Bad Request")
        port = bad.sockets[0].getsockname()[1]
        with pytest.raises(Exception, match=r"HTTP 400: b'\{\"error\":\"no\"\}'"):
            await collect(f"http://127.0.0.1:{port}/x")
        bad.close()
        return got

    assert asyncio.run(main()) == ['{"a":1}', "[DONE]"]
    eng = FakeEngine(tokenizer, max_model_len=512)
    with RunningServer(build_app(AsyncEngine(eng), ServerSettings())) as srv:
        events = asyncio.run(collect(f"{srv.url}/v1/completions", {
            "prompt": [5, 6], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}))
        assert events[-1] == "[DONE]" and len(events) == 3 + 2
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 3
        with pytest.raises(Exception, match="HTTP 400"):
            asyncio.run(collect(f"{srv.url}/v1/completions", {"prompt": [5], "n": 99}))
