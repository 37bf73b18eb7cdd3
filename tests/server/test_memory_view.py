"""``GET /vmm/memory`` (``xllm_vmm.server.memory_view``) on the embedded demo model: its figures
are the pool's and the KV cache manager's own ledgers and the same numbers ``/metrics``
exports, per model (the served one and a fork) and device; it is an admin route (off without
``--enable-admin``, behind the API key)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import FakeEngine
from xllm_vmm.bench.serve import parse_metric
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

HTTP = httpx.Client(timeout=60)
PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # several full blocks: cached


@pytest.fixture(scope="module")
def demo():
    from xllm_vmm.engine import LLMEngine

    eng = LLMEngine.from_flags(None, block_size=16, device_memory="128MiB",
                               enable_vmm_kvcache=True, vmm_elastic=True,
                               enable_vmm_weights=True)
    front = AsyncEngine(eng)
    srv = RunningServer(build_app(front, ServerSettings(enable_admin=True)),
                        drain_timeout=5).start()
    for i in range(3):  # the second and third reuse the first one's cached prefix
        r = HTTP.post(f"{srv.url}/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200
    yield eng, front, srv
    srv.stop()


def _metric(text, name, model):
    return parse_metric(text, name, {"model_name": model})


def test_figures_are_the_pool_ledger_and_metrics(demo):
    eng, front, srv = demo
    view = HTTP.get(f"{srv.url}/vmm/memory").json()
    text = HTTP.get(f"{srv.url}/metrics").text
    assert view["version"] == 1 and view["default_model"] == front.name
    [m] = view["models"]
    assert m["name"] == front.name and m["default"] and m["state"] == "awake"
    [d] = m["devices"]
    assert d["device"] == "cpu:0" and d["rank"] == 0

    # the ledgers, read directly (the server is idle: nothing moves in between)
    ps = eng.pool.stats()
    kv = eng.kv_cache_manager.stats()
    prefix = eng.kv_cache_manager.prefix.stats
    pool = d["pool"]
    for key in ("reserved_bytes", "mapped_bytes", "held_bytes", "ready_bytes", "pages_in_use",
                "map_calls", "unmap_calls", "pages_mapped_total", "pages_unmapped_total",
                "failed_maps", "page_bytes"):
        assert pool[key] == getattr(ps, key), key
    assert pool["mode"] == "elastic" and pool["tenants"] == ps.per_tenant_mapped_bytes
    assert pool["reserved_pages"] * ps.page_bytes == ps.reserved_bytes
    assert pool["mapped_pages"] * ps.page_bytes == ps.mapped_bytes
    assert d["kv"]["mapped_bytes"] == kv["mapped_bytes"] > 0
    assert d["kv"]["cached_blocks"] == kv["cached_blocks"] > 0
    assert d["kv"]["cached_bytes"] == prefix.cached_bytes > 0
    assert d["kv"]["live_blocks"] == kv["live_blocks"] == 0 and d["kv"]["active_bytes"] == 0
    assert d["kv"]["evictable_bytes"] == prefix.cached_bytes  # nothing pinned while idle
    assert d["weights"]["in_pool"] and d["weights"]["mapped_bytes"] == \
        ps.per_tenant_mapped_bytes[eng.weights.tenant] > 0
    assert d["weights"]["bytes"] == eng.weights.stats()["weight_bytes"]
    assert d["quota"] == {"max_cache_size_bytes": 0, "used_bytes": ps.held_bytes,
                          "used_fraction": None}
    assert d["host_tier"]["enabled"] is False

    # the same numbers as /metrics
    name = front.name
    pairs = {"xllm_vmm_mapped_bytes": pool["mapped_bytes"],
             "xllm_vmm_reserved_virtual_bytes": pool["reserved_bytes"],
             "xllm_vmm_held_bytes": pool["held_bytes"],
             "xllm_vmm_pages_in_use": pool["pages_in_use"],
             "xllm_vmm_map_calls_total": pool["map_calls"],
             "xllm_vmm_unmap_calls_total": pool["unmap_calls"],
             "xllm_vmm_pages_mapped_total": pool["pages_mapped_total"],
             "xllm_vmm_kv_mapped_bytes": d["kv"]["mapped_bytes"],
             "xllm_vmm_kv_cached_blocks": d["kv"]["cached_blocks"],
             "xllm_vmm_kv_live_blocks": d["kv"]["live_blocks"],
             "xllm_vmm_kv_packed_floor_bytes": d["kv"]["packed_floor_bytes"],
             "vllm:prefix_cache_queries_total": m["prefix_cache"]["query_tokens"],
             "vllm:prefix_cache_hits_total": m["prefix_cache"]["hit_tokens"],
             "vllm:num_requests_running": m["requests"]["running"],
             "vllm:num_requests_waiting": m["requests"]["waiting"]}
    for metric, value in pairs.items():
        assert _metric(text, metric, name) == value, metric
    assert m["prefix_cache"]["hit_tokens"] > 0
    assert m["prefix_cache"]["hit_rate"] == pytest.approx(
        m["prefix_cache"]["hit_tokens"] / m["prefix_cache"]["query_tokens"])
    assert m["prefix_cache"]["hit_rate"] == prefix.hit_rate
    assert m["requests"] == {"running": 0, "waiting": 0, "in_flight": 0}


def test_counters_grow_with_requests(demo):
    eng, front, srv = demo
    before = HTTP.get(f"{srv.url}/vmm/memory").json()["models"][0]
    r = HTTP.post(f"{srv.url}/v1/completions",
                  json={"prompt": "a different prompt that maps new blocks " * 8,
                        "max_tokens": 2})
    assert r.status_code == 200
    after = HTTP.get(f"{srv.url}/vmm/memory").json()["models"][0]
    assert after["prefix_cache"]["query_tokens"] > before["prefix_cache"]["query_tokens"]
    b, a = before["devices"][0], after["devices"][0]
    assert a["kv"]["cached_blocks"] > b["kv"]["cached_blocks"]
    assert a["pool"]["pages_mapped_total"] >= b["pool"]["pages_mapped_total"]


def test_a_fork_is_a_second_model_with_its_own_pool(demo):
    eng, front, srv = demo
    r = HTTP.post(f"{srv.url}/fork", json={"name": "demo-fork"})
    assert r.status_code == 200, r.text
    view = HTTP.get(f"{srv.url}/vmm/memory").json()
    names = [m["name"] for m in view["models"]]
    assert names == [front.name, "demo-fork"]
    fork = view["models"][1]
    assert not fork["default"] and fork["state"] == "awake"
    [d] = fork["devices"]
    child = srv.app.state.server.fronts["demo-fork"].engine
    assert d["pool"]["reserved_bytes"] == child.pool.stats().reserved_bytes
    assert d["weights"]["instances"] == 2  # the weight pages are shared with the parent
    only = HTTP.get(f"{srv.url}/vmm/memory", params={"model": "demo-fork"}).json()
    assert [m["name"] for m in only["models"]] == ["demo-fork"]
    bad = HTTP.get(f"{srv.url}/vmm/memory", params={"model": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"


def test_sleep_state_is_shown(demo):
    eng, front, srv = demo
    assert HTTP.post(f"{srv.url}/sleep", json={"level": 1,
                                               "model": "demo-fork"}).status_code == 200
    try:
        view = HTTP.get(f"{srv.url}/vmm/memory").json()
        fork = next(m for m in view["models"] if m["name"] == "demo-fork")
        assert fork["state"] == "sleeping" and fork["sleep_level"] == 1
        assert fork["devices"][0]["kv"]["mapped_bytes"] == 0
        assert view["models"][0]["state"] == "awake"
    finally:
        HTTP.post(f"{srv.url}/wake_up", json={"model": "demo-fork"})


def test_admin_only_and_behind_the_key(tokenizer):
    front = AsyncEngine(FakeEngine(tokenizer))
    srv = RunningServer(build_app(front, ServerSettings()), drain_timeout=5).start()
    try:
        r = HTTP.get(f"{srv.url}/vmm/memory")
        assert r.status_code == 404
    finally:
        srv.stop()
    front = AsyncEngine(FakeEngine(tokenizer))
    srv = RunningServer(build_app(front, ServerSettings(enable_admin=True, api_key="k")),
                        drain_timeout=5).start()
    try:
        assert HTTP.get(f"{srv.url}/vmm/memory").status_code == 401
        r = HTTP.get(f"{srv.url}/vmm/memory", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        [m] = r.json()["models"]
        # an engine without a VMM pool: what it has, and null for the rest
        assert m["devices"][0]["pool"]["reserved_bytes"] == 1 << 30
        assert m["devices"][0]["kv"]["active_bytes"] is None
    finally:
        srv.stop()
