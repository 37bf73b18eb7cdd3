"""The admin routes (``--enable-admin``: sleep, wake, fork, prefix-cache reset, status) fuzzed
from the server's own OpenAPI schema against a real server on the demo model, bounded in
examples and time. No answer is a 5xx but the documented 503 (the model sleeps or drains to
sleep), every error is OpenAI-shaped, and afterwards every model wakes, answers, and holds no
KV block."""

from __future__ import annotations

import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from tests.server.fuzzing import assert_openai_error, fuzz_settings, past_budget  # noqa: E402

EXAMPLES = 12
"""Generated cases per operation."""
BUDGET_S = 25.0
"""Total time the fuzzing may take; cases past it are skipped (the run stays bounded)."""
ADMIN = ("/sleep", "/wakeup", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/fork",
         "/fork_master", "/vmm/status")

_t0: list[float] = []


@pytest.fixture(scope="module")
def admin_demo():
    from xllm_vmm.engine import LLMEngine
    from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

    eng = LLMEngine.from_flags(None, block_size=16, device_memory="256MiB", max_model_len=512,
                               enable_vmm_kvcache=True, vmm_elastic=True)
    front = AsyncEngine(eng)
    srv = RunningServer(build_app(front, ServerSettings(enable_admin=True, max_forks=2)),
                        drain_timeout=5).start()
    yield {"eng": eng, "front": front, "srv": srv}
    srv.stop()


@pytest.fixture(scope="module")
def admin_schema(admin_demo):
    return schemathesis.openapi.from_url(f"{admin_demo['srv'].url}/openapi.json")


schema = schemathesis.pytest.from_fixture("admin_schema")


def test_the_schema_describes_the_admin_routes(admin_demo):
    doc = httpx.get(f"{admin_demo['srv'].url}/openapi.json").json()
    assert set(ADMIN) <= set(doc["paths"])
    sleep = doc["paths"]["/sleep"]["post"]
    assert {p["name"] for p in sleep["parameters"]} == {"level", "drain", "timeout", "model"}
    assert "409" in sleep["responses"] and "503" in sleep["responses"]
    assert "name" in doc["paths"]["/fork"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]


@schema.include(path_regex="^/(sleep|wakeup|wake_up|is_sleeping|reset_prefix_cache|fork|"
                           "fork_master|vmm/status)$").parametrize()
@fuzz_settings(EXAMPLES)
def test_admin_routes_no_5xx_and_openai_shaped_errors(case, admin_demo):
    if past_budget(_t0, BUDGET_S):
        return
    url = admin_demo["srv"].url
    resp = case.call(base_url=url, timeout=60)
    assert resp.status_code < 500 or resp.status_code == 503, \
        f"{case.method} {case.path}: {resp.status_code} {resp.text[:500]}"
    if resp.status_code >= 400:
        err = assert_openai_error(resp, f"{case.method} {case.path}")
        if resp.status_code == 503:
            assert "sleep" in err["message"], err
    # a completion between two admin calls: served, or refused as documented while asleep
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                   timeout=60)
    assert r.status_code in (200, 503), r.text
    if r.status_code == 503:
        assert "sleeping" in r.json()["error"]["message"]


def test_after_the_admin_fuzzing_every_model_wakes_and_nothing_is_held(admin_demo):
    srv, front = admin_demo["srv"], admin_demo["front"]
    models = [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]]
    assert 1 <= len(models) <= 3  # the model and at most --max-forks 2 forks
    for name in models:
        assert httpx.post(f"{srv.url}/wake_up", json={"model": name}, timeout=60).status_code == 200
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                       json={"model": name, "prompt": "hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    end = time.monotonic() + 30
    fronts = list(srv.app.state.server.fronts.values())
    while any(f.num_in_flight for f in fronts) and time.monotonic() < end:
        time.sleep(0.05)
    for f in fronts:
        assert f.num_in_flight == 0
        status = httpx.get(f"{srv.url}/vmm/status", params={"model": f.name}).json()["stats"]
        assert status["kvcache"]["live_blocks"] == 0 and status["num_requests_running"] == 0
    assert front.num_in_flight == 0
    assert httpx.get(f"{srv.url}/health").status_code == 200
