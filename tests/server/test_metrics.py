"""``/metrics`` series read from engine statistics: speculative decoding
rendered under vLLM's names only while the engine reports them."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.server.conftest import FakeEngine
from xllm_vmm.bench.serve import parse_metric
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app
from xllm_vmm.server.metrics import Metrics

SPEC = {"num_drafts": 7, "num_draft_tokens": 21, "num_accepted_tokens": 12,
        "num_accepted_tokens_per_pos": [6, 4, 2]}


def _render(stats: dict) -> str:
    return Metrics().render({"m": (stats, {"in_flight": 0})}).decode()


def test_spec_decode_counters_with_vllm_names():
    text = _render({"spec_decode": SPEC})
    assert re.search(r"# TYPE vllm:spec_decode_num_drafts(_total)? counter", text)
    assert parse_metric(text, "vllm:spec_decode_num_drafts_total", {"model_name": "m"}) == 7
    assert parse_metric(text, "vllm:spec_decode_num_draft_tokens_total") == 21
    assert parse_metric(text, "vllm:spec_decode_num_accepted_tokens_total") == 12
    for pos, v in enumerate(SPEC["num_accepted_tokens_per_pos"]):
        assert parse_metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                            {"position": str(pos), "model_name": "m"}) == v
    assert parse_metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == 12


def test_spec_decode_absent_when_the_engine_does_not_speculate():
    for stats in ({}, {"spec_decode": None}, {"spec_decode": {}}):
        assert "spec_decode" not in _render(stats)


def test_spec_decode_partial_dict_renders_what_is_there():
    text = _render({"spec_decode": {"num_drafts": 3}})
    assert parse_metric(text, "vllm:spec_decode_num_drafts_total") == 3
    assert "num_draft_tokens" not in text and "per_pos" not in text


class _SpeculatingEngine(FakeEngine):
    def stats(self):
        return {**super().stats(), "spec_decode": dict(SPEC)}


def test_spec_decode_on_the_metrics_route(tokenizer):
    app = build_app(AsyncEngine(_SpeculatingEngine(tokenizer)), ServerSettings())
    with RunningServer(app) as srv:
        text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    assert parse_metric(text, "vllm:spec_decode_num_accepted_tokens_total",
                        {"model_name": "fake-model"}) == 12
    assert parse_metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                        {"position": "2"}) == 2


def test_the_servers_own_costs_are_counted(tokenizer):
    """Output-thread and stream-encoding CPU seconds and the tokens handled reach /metrics and
    ``bench serve``'s per-token figures."""
    import asyncio

    from xllm_vmm.bench import serve as bs

    app = build_app(AsyncEngine(FakeEngine(tokenizer, max_model_len=256)), ServerSettings())
    with RunningServer(app) as srv:
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 5, "stream": True}) as r:
            assert sum(1 for line in r.iter_lines() if line.startswith("data: {")) == 5
        text = httpx.get(f"{srv.url}/metrics", timeout=30).text
        assert parse_metric(text, "xllm_vmm_output_tokens_total") == 5
        assert parse_metric(text, "xllm_vmm_output_thread_cpu_seconds_total") > 0
        assert parse_metric(text, "xllm_vmm_stream_encode_seconds_total") > 0
        cfg = bs.LoadConfig(num_prompts=4, request_rate=float("inf"), input_len=8, output_len=3)
        out = asyncio.run(bs.drive(srv.url, cfg))
    assert out["output_thread_us_per_token"] > 0 and out["stream_encode_us_per_token"] > 0
    assert 0 < out["output_thread_busy_fraction"] < 1
    assert 0 < out["stream_encode_busy_fraction"] < 1


def test_hot_histogram_renders_as_prometheus_histogram():
    """The hot-path histogram (server stages, inter-token latency) is the same exposition as
    prometheus_client's ``Histogram`` for the same samples (bounds included: a sample on a
    bound counts in it; past the last bound in +Inf), less the ``_created`` series, and
    ``observe(v, n)`` is n samples of v."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from xllm_vmm.server.metrics import SERVER_LATENCY_BUCKETS, HotHistogram

    rng = random.Random(3)
    r1, r2 = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
    ref = Histogram("x_seconds", "doc", ["model_name", "stage"],
                    buckets=SERVER_LATENCY_BUCKETS, registry=r1)
    hot = HotHistogram("x_seconds", "doc", ["model_name", "stage"],
                       buckets=SERVER_LATENCY_BUCKETS, registry=r2)
    samples = [0.0, 1e-5, 2.51e-3, 10.0, 11.0, *(rng.random() * 0.2 for _ in range(500))]
    for stage in ("emit", "queue"):
        for v in samples:
            ref.labels("m", stage).observe(v)
            hot.labels("m", stage).observe(v)
    for _ in range(3):
        ref.labels("m", "emit").observe(0.004)
    hot.labels("m", "emit").observe(0.004, 3)

    def lines(reg, sums: bool):
        return [ln for ln in generate_latest(reg).decode().splitlines()
                if "_created" not in ln and ("_sum{" in ln) == sums]

    assert lines(r1, False) == lines(r2, False)
    for a, b in zip(lines(r1, True), lines(r2, True), strict=True):  # float order of the sum
        assert a.rpartition(" ")[0] == b.rpartition(" ")[0]
        assert float(a.rpartition(" ")[2]) == pytest.approx(float(b.rpartition(" ")[2]))
    with pytest.raises(ValueError, match="label values"):
        hot.labels("m")
