"""Cached KV given back (``xllm_vmm.server.kv_reclaim``) on the embedded demo model over an
elastic pool: ``POST /kvcache/trim`` (all, or down to a target), the per-model bound
(``max_cached_kv_bytes``) and the idle TTL (``cached_kv_ttl``); the pages leave the pool (its
held bytes fall) and every figure is the ledgers' (``/vmm/memory``, ``/metrics``)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from xllm_vmm.bench.serve import parse_metric
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

HTTP = httpx.Client(timeout=60)
PROMPTS = [f"prompt number {i} says: " + "the quick brown fox jumps over the lazy dog " * 5
           for i in range(3)]


def _server(engine_flags=None, **settings):
    from xllm_vmm.engine import LLMEngine

    eng = LLMEngine.from_flags(None, block_size=16, device_memory="128MiB",
                               enable_vmm_kvcache=True, vmm_elastic=True,
                               enable_vmm_weights=True, **(engine_flags or {}))
    front = AsyncEngine(eng)
    app = build_app(front, ServerSettings(enable_admin=True, **settings))
    return eng, front, RunningServer(app, drain_timeout=5).start()


def _load_one(url, prompt):
    r = HTTP.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200


def _load(url):
    for p in PROMPTS:
        _load_one(url, p)


def _dev(url):
    m = HTTP.get(f"{url}/vmm/memory").json()["models"][0]
    return m, m["devices"][0]


@pytest.fixture(scope="module")
def served():
    eng, front, srv = _server()
    yield eng, front, srv
    srv.stop()


def test_trim_all_releases_the_pages(served):
    eng, front, srv = served
    _load(srv.url)
    m, d = _dev(srv.url)
    cached, held = d["kv"]["cached_bytes"], d["pool"]["held_bytes"]
    assert cached > 0 and d["kv"]["mapped_bytes"] > 0 and d["kv"]["live_blocks"] == 0
    ev0 = parse_metric(HTTP.get(f"{srv.url}/metrics").text, "xllm_vmm_prefix_cache_evictions_total")
    r = HTTP.post(f"{srv.url}/kvcache/trim")
    assert r.status_code == 200, r.text
    [t] = r.json()["models"]
    assert t["model"] == front.name and t["target"] == 0
    assert t["cached_bytes_before"] == cached and t["cached_bytes_after"] == 0
    assert t["blocks_evicted"] == d["kv"]["cached_blocks"]
    assert t["kv_mapped_bytes_after"] == 0 and t["kv_mapped_bytes_before"] == \
        d["kv"]["mapped_bytes"]
    m2, d2 = _dev(srv.url)
    assert d2["kv"]["cached_bytes"] == 0 and d2["kv"]["mapped_bytes"] == 0
    # back to the driver: the pool holds what the weights map, nothing for KV
    assert t["released_bytes"] == held - d2["pool"]["held_bytes"] >= d["kv"]["mapped_bytes"]
    assert d2["pool"]["held_bytes"] == d2["pool"]["tenants"].get("weights", 0)
    assert d2["pool"]["held_bytes"] == eng.pool.stats().held_bytes
    assert m2["reclaim"]["trim_blocks"] == t["blocks_evicted"]
    ev1 = parse_metric(HTTP.get(f"{srv.url}/metrics").text, "xllm_vmm_prefix_cache_evictions_total")
    assert ev1 - ev0 == t["blocks_evicted"]
    # nothing left: a second trim does nothing
    [t2] = HTTP.post(f"{srv.url}/kvcache/trim", json={"model": front.name}).json()["models"]
    assert t2["blocks_evicted"] == 0 and t2["released_bytes"] == 0


def test_trim_to_a_target_keeps_the_most_recent(served):
    eng, front, srv = served
    _load(srv.url)
    _, d = _dev(srv.url)
    per_block = d["kv"]["cached_bytes"] // d["kv"]["cached_blocks"]
    keep = 2 * per_block
    r = HTTP.post(f"{srv.url}/kvcache/trim", params={"target": str(keep)})
    [t] = r.json()["models"]
    assert t["cached_bytes_after"] <= keep < t["cached_bytes_before"]
    assert t["cached_bytes_after"] == keep
    _, d2 = _dev(srv.url)
    assert d2["kv"]["cached_bytes"] == keep and d2["kv"]["mapped_bytes"] > 0
    assert eng.kv_cache_manager.prefix.num_evictable("attn") == 2
    # the last prompt's first blocks are the most recently released ones kept: it hits again
    hits = parse_metric(HTTP.get(f"{srv.url}/metrics").text, "vllm:prefix_cache_hits_total")
    _load_one(srv.url, PROMPTS[-1])
    assert parse_metric(HTTP.get(f"{srv.url}/metrics").text,
                        "vllm:prefix_cache_hits_total") > hits
    HTTP.post(f"{srv.url}/kvcache/trim")


@pytest.mark.parametrize("body,param", [({"target": "lots"}, "target"),
                                        ({"target": -1}, "target"),
                                        ({"model": "nope"}, "model")])
def test_trim_bad_parameters_are_400(served, body, param):
    _, _, srv = served
    r = HTTP.post(f"{srv.url}/kvcache/trim", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_trim_is_an_admin_route(tokenizer):
    from tests.server.conftest import FakeEngine

    front = AsyncEngine(FakeEngine(tokenizer))
    srv = RunningServer(build_app(front, ServerSettings()), drain_timeout=5).start()
    try:
        assert HTTP.post(f"{srv.url}/kvcache/trim").status_code == 404
    finally:
        srv.stop()


def test_the_bound_keeps_cached_kv_under_it():
    eng, front, srv = _server(max_cached_kv_bytes=3 * 32 * 1024)
    try:
        _load(srv.url)
        bound = 3 * 32 * 1024
        deadline = time.monotonic() + 60  # the reclaimer checks once a second
        while time.monotonic() < deadline:
            m, d = _dev(srv.url)
            if d["kv"]["cached_bytes"] <= bound:
                break
            time.sleep(0.2)
        assert d["kv"]["cached_bytes"] <= bound
        assert m["reclaim"]["max_cached_bytes"] == bound and m["reclaim"]["bound_blocks"] > 0
        assert eng.kv_cache_manager.prefix.stats.cached_bytes <= bound
    finally:
        srv.stop()


def test_the_idle_ttl_releases_everything_once():
    eng, front, srv = _server(cached_kv_ttl=1000.0)
    try:
        _load(srv.url)
        reclaimer = srv.app.state.kv_reclaim

        def tick(now):
            fut = asyncio.run_coroutine_threadsafe(reclaimer.tick(front.name, front, now),
                                                   srv._loop)
            fut.result(30)

        now = time.monotonic()
        tick(now)  # just active: nothing goes
        _, d = _dev(srv.url)
        assert d["kv"]["cached_bytes"] > 0
        cached_blocks = d["kv"]["cached_blocks"]
        tick(now + 1001)  # idle past the TTL: every cached block goes
        m, d = _dev(srv.url)
        assert d["kv"]["cached_bytes"] == 0 and d["kv"]["mapped_bytes"] == 0
        assert m["reclaim"]["ttl_blocks"] == cached_blocks
        assert m["reclaim"]["ttl_released_bytes"] > 0
        calls = eng.num_steps
        tick(now + 1002)  # once per idle spell
        assert m["reclaim"]["ttl_blocks"] == _dev(srv.url)[0]["reclaim"]["ttl_blocks"]
        assert eng.num_steps == calls
    finally:
        srv.stop()


def test_a_trimmed_prefix_is_restored_from_the_host_tier():
    eng, front, srv = _server({"host_blocks_factor": 2})
    try:
        _load_one(srv.url, PROMPTS[0])
        _load_one(srv.url, PROMPTS[1])  # the engine steps: the first one's copies run
        _, d = _dev(srv.url)
        assert d["host_tier"]["enabled"] and d["host_tier"]["used_bytes"] > 0
        [t] = HTTP.post(f"{srv.url}/kvcache/trim").json()["models"]
        assert t["cached_bytes_after"] == 0 and t["released_bytes"] > 0
        _load_one(srv.url, PROMPTS[0])  # its prefix comes back from host memory
        _, d2 = _dev(srv.url)
        assert d2["host_tier"]["restore_bytes"] > d["host_tier"]["restore_bytes"]
        assert d2["host_tier"]["restore_bytes"] == eng.kv_cache_manager.stats()[
            "host_restore_bytes"]
    finally:
        srv.stop()


def test_serve_options():
    from xllm_vmm.cli.serve import UsageError, parse_argv

    opts = parse_argv(["--max-cached-kv", "64MiB", "--cached-kv-ttl=30"])
    assert opts["max_cached_kv"] == 64 << 20 and opts["cached_kv_ttl"] == 30.0
    assert parse_argv([])["max_cached_kv"] is None and parse_argv([])["cached_kv_ttl"] is None
    for argv, flag in ((["--max-cached-kv", "lots"], "--max-cached-kv"),
                       (["--cached-kv-ttl", "0"], "--cached-kv-ttl"),
                       (["--cached-kv-ttl", "inf"], "--cached-kv-ttl")):
        with pytest.raises(UsageError, match=flag):
            parse_argv(argv)
