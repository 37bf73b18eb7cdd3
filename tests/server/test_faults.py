"""Bad input and faults over HTTP: a request's own bad parameter is a 400 naming it, a request's
own bad numerics a 500 saying what failed, and neither touches the other requests."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server.conftest import FakeEngine
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

HTTP = httpx.Client(timeout=60)


@pytest.fixture
def fake(tokenizer):
    eng = FakeEngine(tokenizer)
    front = AsyncEngine(eng)
    srv = RunningServer(build_app(front, ServerSettings(enable_admin=True)), drain_timeout=5).start()
    yield eng, front, srv
    srv.stop()


def _post(srv, body):
    # json.dumps writes NaN as the bare token NaN, which Python's (and the server's) parser reads
    return HTTP.post(f"{srv.url}/v1/completions", content=json.dumps(body),
                     headers={"content-type": "application/json"})


@pytest.mark.parametrize("body,param,words", [
    ({"seed": 2 ** 64}, "seed", "18446744073709551615"),
    ({"seed": -(2 ** 63) - 1}, "seed", "-9223372036854775808"),
    ({"seed": 2 ** 64 - 2, "n": 3}, "seed", "seed + n - 1"),
    ({"temperature": float("nan")}, "temperature", "finite number"),
    ({"top_p": float("nan")}, "top_p", "finite number"),
    ({"presence_penalty": float("inf")}, "presence_penalty", "finite number"),
    ({"max_tokens": True}, "max_tokens", "not a boolean"),
    ({"n": True}, "n", "not a boolean"),
    ({"logprobs": False}, "logprobs", "not a boolean"),
])
def test_bad_numbers_are_400_naming_the_field(fake, body, param, words):
    _, _, srv = fake
    r = _post(srv, {"prompt": "x", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert "100" not in err["message"] or param != "temperature"


def test_a_bad_seed_beside_a_stream_leaves_the_stream_alone(fake):
    eng, _, srv = fake
    eng.step_delay = 0.01
    got: dict = {}

    def stream():
        with HTTP.stream("POST", f"{srv.url}/v1/completions",
                         json={"prompt": "hello", "max_tokens": 20, "stream": True}) as resp:
            got["status"] = resp.status_code
            got["lines"] = [ln for ln in resp.iter_lines() if ln]

    t = threading.Thread(target=stream)
    t.start()
    r = _post(srv, {"prompt": "x", "seed": 2 ** 64, "temperature": 1.0})
    t.join(60)
    assert r.status_code == 400
    assert got["status"] == 200 and got["lines"][-1] == "data: [DONE]"
    assert not any('"error"' in ln for ln in got["lines"])


@pytest.fixture(scope="module")
def real(tiny_llama_dir):
    from xllm_vmm.engine import LLMEngine

    eng = LLMEngine.from_flags(str(tiny_llama_dir), enable_vmm_kvcache=True, vmm_elastic=True,
                               block_size=16, max_model_len=256, device_memory="256MiB",
                               model_id="tiny-llama")
    front = AsyncEngine(eng)
    srv = RunningServer(build_app(front, ServerSettings()), drain_timeout=5).start()
    yield eng, front, srv
    srv.stop()


def test_non_finite_logits_are_a_500_for_that_request_alone(real, monkeypatch):
    eng, _, srv = real
    real_sample = eng.sampler.sample

    def sample(logits, rows):  # the request whose prompt starts with token 9 has NaN logits
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.prompt_token_ids[0] == 9:
                logits[i] = float("nan")
        return real_sample(logits, rows)

    monkeypatch.setattr(eng.sampler, "sample", sample)
    good: dict = {}

    def other():
        good["r"] = HTTP.post(f"{srv.url}/v1/completions",
                              json={"prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True,
                                    "temperature": 0})

    t = threading.Thread(target=other)
    t.start()
    bad = HTTP.post(f"{srv.url}/v1/completions",
                    json={"prompt": [9, 10], "max_tokens": 5, "temperature": 0.7})
    t.join(60)
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert "not finite" in err["message"] and err["type"] == "internal_error"
    assert good["r"].status_code == 200, good["r"].text
    assert good["r"].json()["usage"]["completion_tokens"] == 30
    assert not eng.has_unfinished_requests()
    assert eng.kv_cache_manager.stats()["live_blocks"] == 0


def test_retrieve_one_model_as_openai_does(fake):
    _, _, srv = fake
    listed = HTTP.get(f"{srv.url}/v1/models").json()["data"][0]
    one = HTTP.get(f"{srv.url}/v1/models/{listed['id']}")
    assert one.status_code == 200
    assert {k: v for k, v in one.json().items() if k != "created"} == \
        {k: v for k, v in listed.items() if k != "created"}
    missing = HTTP.get(f"{srv.url}/v1/models/org/nope")
    assert missing.status_code == 404
    err = missing.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "fake-model" in err["message"]


def test_deeper_sleep_while_asleep_is_refused_naming_the_level(fake):
    eng, _, srv = fake
    assert HTTP.post(f"{srv.url}/sleep?level=1").status_code == 200
    r = HTTP.post(f"{srv.url}/sleep?level=2")
    assert r.status_code == 409, r.text
    assert "level 1" in r.json()["error"]["message"]
    same = HTTP.post(f"{srv.url}/sleep?level=1")
    assert same.status_code == 200 and same.json()["already"] and same.json()["level"] == 1
    assert eng.sleep_calls == [1]
    assert HTTP.post(f"{srv.url}/wake_up").status_code == 200
    assert HTTP.post(f"{srv.url}/sleep?level=2").status_code == 200
    lighter = HTTP.post(f"{srv.url}/sleep?level=1")  # deep already holds less: nothing to do
    assert lighter.status_code == 200 and lighter.json()["level"] == 2
    assert eng.sleep_calls == [1, 2]


def _server_with(tokenizer, **settings):
    front = AsyncEngine(FakeEngine(tokenizer))
    return RunningServer(build_app(front, ServerSettings(**settings)), drain_timeout=5).start()


def _health_while(srv, body: bytes) -> tuple[httpx.Response, float]:
    """POST ``body`` to /v1/completions on a thread; /health's answer time meanwhile."""
    import time

    got: dict = {}

    def post():
        got["r"] = HTTP.post(f"{srv.url}/v1/completions", content=body,
                             headers={"content-type": "application/json"})

    t = threading.Thread(target=post)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
    took = time.monotonic() - t0
    t.join(60)
    return got["r"], took


TEN_MB = json.dumps({"prompt": "hello world " * (10_000_000 // 12), "max_tokens": 2}).encode()


def test_a_body_over_max_request_bytes_is_413_before_it_is_read(tokenizer):
    import time

    srv = _server_with(tokenizer, max_request_bytes=1024 * 1024)
    try:
        t0 = time.monotonic()
        r, health = _health_while(srv, TEN_MB)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert "--max-request-bytes" in err["message"] and str(len(TEN_MB)) in err["message"]
        assert err["type"] == "invalid_request_error" and err["code"] == 413
        assert health < 5 and time.monotonic() - t0 < 30
        ok = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        srv.stop()


def test_a_ten_mb_prompt_is_refused_at_once_and_never_blocks_health(tokenizer):
    import time

    srv = _server_with(tokenizer)  # under the default 32 MiB limit: parsed, then refused
    try:
        t0 = time.monotonic()
        r, health = _health_while(srv, TEN_MB)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "maximum context length is 128 tokens" in r.json()["error"]["message"]
        assert health < 5 and time.monotonic() - t0 < 8  # tokenized in full it took 16-20 s
    finally:
        srv.stop()


def _rss_mib() -> float:
    import os

    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def test_memory_returns_after_refused_large_prompts(tokenizer):
    import gc
    import time

    srv = _server_with(tokenizer)
    body = json.dumps({"prompt": "hello world " * (1_000_000 // 12), "max_tokens": 2}).encode()
    try:
        def refuse(n):
            for _ in range(n):
                r = HTTP.post(f"{srv.url}/v1/completions", content=body,
                              headers={"content-type": "application/json"})
                assert r.status_code == 400

        assert HTTP.post(f"{srv.url}/v1/completions",
                         json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        gc.collect()
        base = _rss_mib()
        refuse(50)
        time.sleep(2.5)  # the trim after the last refusal runs within TRIM_INTERVAL_S
        gc.collect()
        grown = _rss_mib() - base
        assert grown < 24, f"RSS grew {grown:.0f} MiB over 50 refused 1 MB prompts"
    finally:
        srv.stop()


@pytest.mark.parametrize("name,words", [
    ("x" * 65, "at most 64"), ("bad name", "letters, digits"), ("-lead", "letters, digits"),
    (7, "non-empty string"), ("a\n", "letters, digits"),
])
def test_fork_names_are_validated(fake, name, words):
    _, _, srv = fake
    r = HTTP.post(f"{srv.url}/fork", json={"name": name})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
    assert words in r.json()["error"]["message"]


def test_concurrent_forks_stop_at_the_limit(fake):
    from concurrent.futures import ThreadPoolExecutor

    _, _, srv = fake
    with ThreadPoolExecutor(10) as pool:
        codes = list(pool.map(lambda i: HTTP.post(f"{srv.url}/fork",
                                                  json={"name": f"f{i}"}).status_code, range(10)))
    assert sorted(codes) == [200] * 4 + [409] * 6, codes
    models = HTTP.get(f"{srv.url}/v1/models").json()["data"]
    assert len(models) == 5  # the model and its four forks
    r = HTTP.post(f"{srv.url}/fork", json={"name": "one-more"})
    assert r.status_code == 409 and "--max-forks 4" in r.json()["error"]["message"]


def test_chat_logprobs_stays_a_boolean(fake):
    _, _, srv = fake
    r = HTTP.post(f"{srv.url}/v1/chat/completions",
                  json={"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                        "max_tokens": 2})
    assert r.status_code == 200, r.text
