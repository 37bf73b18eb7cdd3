"""The API fuzzed from the server's own OpenAPI schema (``/openapi.json``): schemathesis drives
every public route of a real server on the embedded demo model with generated bodies, bounded
in examples per operation and in total time. No answer is a 5xx, every error is OpenAI-shaped,
and afterwards nothing is in flight, no KV block is held and the process's memory is bounded."""

from __future__ import annotations

import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from tests.server.fuzzing import assert_openai_error, fuzz_settings, past_budget  # noqa: E402

EXAMPLES = 25
"""Generated cases per operation."""
BUDGET_S = 60.0
"""Total time the fuzzing may take; cases past it are skipped (the run stays bounded)."""
RSS_GROWTH_MIB = 256
"""Most the process may grow over the whole run (the engine's pool excluded: it is measured
before the first case, after the model loaded)."""

_t0: list[float] = []


def _rss_mib() -> float:
    import os

    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


@pytest.fixture(scope="module")
def demo():
    from xllm_vmm.engine import LLMEngine
    from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

    eng = LLMEngine.from_flags(None, block_size=16, device_memory="128MiB")
    front = AsyncEngine(eng)
    srv = RunningServer(build_app(front, ServerSettings()), drain_timeout=5).start()
    httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    state = {"eng": eng, "front": front, "srv": srv, "rss": _rss_mib()}
    yield state
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(demo):
    return schemathesis.openapi.from_url(f"{demo['srv'].url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@fuzz_settings(EXAMPLES)
def test_no_5xx_and_openai_shaped_errors(case, demo):
    if past_budget(_t0, BUDGET_S):
        return
    if isinstance(case.body, dict):  # keep each generation short: the run is bounded in time
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(key), int) and not isinstance(case.body.get(key), bool):
                case.body[key] = max(-1, min(case.body[key], 8))
        if isinstance(case.body.get("n"), int) and not isinstance(case.body.get("n"), bool):
            case.body["n"] = min(case.body["n"], 2)
    resp = case.call(base_url=demo["srv"].url, timeout=60)
    assert resp.status_code < 500, f"{case.method} {case.path}: {resp.status_code} {resp.text[:500]}"
    if resp.status_code >= 400:
        assert_openai_error(resp, f"{case.method} {case.path}")


def test_after_the_fuzzing_nothing_is_held(demo):
    eng, front = demo["eng"], demo["front"]
    end = time.monotonic() + 30
    while (front.num_in_flight or eng.has_unfinished_requests()) and time.monotonic() < end:
        time.sleep(0.05)
    assert front.num_in_flight == 0 and not eng.has_unfinished_requests()
    assert eng.kv_cache_manager.stats()["live_blocks"] == 0
    grown = _rss_mib() - demo["rss"]
    assert grown < RSS_GROWTH_MIB, f"RSS grew {grown:.0f} MiB over the fuzzing"
    assert httpx.get(f"{demo['srv'].url}/health").status_code == 200
