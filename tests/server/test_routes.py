"""HTTP mechanics over the engine double: routes, OpenAI shapes, errors, key, limits, admin."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server.conftest import FakeEngine
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

# One client for the module: a new httpx client per call loads the TLS context each time
# (hundreds of ms on a loaded machine), which races streams in the tests below.
HTTP = httpx.Client(timeout=30)


def _server(tokenizer, *, settings=None, **kw):
    front_kw = {k: kw.pop(k) for k in ("max_waiting", "max_concurrent") if k in kw}
    drain = kw.pop("drain_timeout", 5.0)
    eng = FakeEngine(tokenizer, **kw)
    front = AsyncEngine(eng, **front_kw)
    app = build_app(front, settings or ServerSettings(enable_admin=True))
    return eng, front, RunningServer(app, drain_timeout=drain).start()


@pytest.fixture
def served(tokenizer):
    eng, front, srv = _server(tokenizer)
    yield eng, front, srv
    srv.stop()


def _sse(resp_or_lines) -> list:
    events = []
    lines = resp_or_lines.iter_lines() if hasattr(resp_or_lines, "iter_lines") else resp_or_lines
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completion_text_matches_engine_tokens(served, tokenizer):
    eng, front, srv = served
    prompt = "hello world"
    ids = tokenizer.encode(prompt)
    r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": prompt, "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    (choice,) = body["choices"]
    assert choice["text"] == tokenizer.decode(eng.expected(ids, 5))
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 5,
                             "total_tokens": len(ids) + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # the engine was only ever touched by the engine thread
    assert len(eng.thread_ids) == 1 and threading.get_ident() not in eng.thread_ids


def test_completion_echo_token_prompt_and_n(served, tokenizer):
    eng, front, srv = served
    ids = tokenizer.encode("abc")
    r = HTTP.post(f"{srv.url}/v1/completions",
                   json={"prompt": [ids, ids], "max_tokens": 3, "n": 2, "echo": True})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for c in body["choices"]:
        assert c["text"] == tokenizer.decode(ids) + tokenizer.decode(eng.expected(ids, 3))
    assert body["usage"]["prompt_tokens"] == 2 * len(ids)
    assert body["usage"]["completion_tokens"] == 12


def test_chat_stream_role_usage_done(served, tokenizer):
    eng, front, srv = served
    with HTTP.stream("POST", f"{srv.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}]), add_special_tokens=False)
    assert text == tokenizer.decode(eng.expected(prompt_ids, 4))


def test_continuous_usage_stats(served):
    _, _, srv = served
    with HTTP.stream("POST", f"{srv.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        chunks = _sse(r)[:-1]
    assert all(c["usage"] is not None for c in chunks)
    seen = [c["usage"]["completion_tokens"] for c in chunks]
    assert seen == sorted(seen) and seen[-1] == 3


def test_stop_string_aborts_in_engine(served, tokenizer):
    eng, front, srv = served
    ids = tokenizer.encode("hello")
    full = tokenizer.decode(eng.expected(ids, 12))
    stop = full[4:6]
    assert stop and full.find(stop) >= 0
    r = HTTP.post(f"{srv.url}/v1/completions",
                   json={"prompt": "hello", "max_tokens": 12, "stop": stop})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
    assert c["text"] == full[: full.find(stop)]
    _wait(lambda: not eng.reqs)


def _wait(cond, timeout=5.0):
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": []}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "model": "nope"}, "model"),
    ({"prompt": "x", "max_tokens": 10, "min_tokens": 11}, "min_tokens"),
])
def test_bad_parameters_are_400_naming_param(served, body, param):
    _, _, srv = served
    r = HTTP.post(f"{srv.url}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_prompt_too_long_states_both_numbers(served, tokenizer):
    _, front, srv = served
    prompt = "hello world " * 200
    n = len(tokenizer.encode(prompt))
    r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": prompt})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert str(front.max_model_len) in msg and str(n) in msg
    r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    msg = r.json()["error"]["message"]
    assert "1000" in msg and str(front.max_model_len) in msg  # above the whole context


def test_budget_past_the_context_is_cut_to_what_is_left(served, tokenizer):
    """A budget that fits the context but not beside the prompt is served to the context's
    end, as vLLM does (`vllm bench serve`'s random loads ask such budgets): finish_reason
    length, the completion exactly what was left. A min_tokens above what is left is a 400."""
    _, front, srv = served
    limit = front.max_model_len
    prompt = list(range(5, 5 + limit - 10))  # 10 tokens left
    for key in ("max_tokens", "max_completion_tokens"):
        r = HTTP.post(f"{srv.url}/v1/completions",
                      json={"prompt": prompt, key: limit // 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["usage"]["prompt_tokens"] == limit - 10
        assert d["usage"]["completion_tokens"] == 10
        assert d["choices"][0]["finish_reason"] == "length"
    r = HTTP.post(f"{srv.url}/v1/completions",
                  json={"prompt": prompt, "max_tokens": limit // 2, "min_tokens": 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert "10" in r.json()["error"]["message"]
    r = HTTP.post(f"{srv.url}/v1/chat/completions",
                  json={"messages": [{"role": "user", "content": "hi"}],
                        "max_completion_tokens": limit, "ignore_eos": True})
    assert r.status_code == 200, r.text  # the whole context asked: cut to what is left
    d = r.json()
    assert d["usage"]["prompt_tokens"] + d["usage"]["completion_tokens"] == limit
    assert d["choices"][0]["finish_reason"] == "length"


def test_not_json_and_unknown_route(served):
    _, _, srv = served
    r = HTTP.post(f"{srv.url}/v1/completions", content=b"{nope")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = HTTP.get(f"{srv.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_models_health_version_tokenize(served, tokenizer):
    _, front, srv = served
    assert HTTP.get(f"{srv.url}/health").status_code == 200
    assert HTTP.get(f"{srv.url}/health").content == b""
    assert "version" in HTTP.get(f"{srv.url}/version").json()
    models = HTTP.get(f"{srv.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    r = HTTP.post(f"{srv.url}/tokenize", json={"prompt": "hello world"}).json()
    assert r["tokens"] == tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
    d = HTTP.post(f"{srv.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == "hello world"
    bad = HTTP.post(f"{srv.url}/detokenize", json={"tokens": [10 ** 6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_metrics_names(served):
    _, _, srv = served
    HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
    text = HTTP.get(f"{srv.url}/metrics").text
    for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{",
                 "vllm:kv_cache_usage_perc{", "vllm:prompt_tokens_total{",
                 "vllm:generation_tokens_total{", "vllm:time_to_first_token_seconds_bucket{",
                 "vllm:inter_token_latency_seconds_bucket{",
                 "vllm:e2e_request_latency_seconds_bucket{",
                 'vllm:request_success_total{finished_reason="length",model_name="fake-model"}',
                 "xllm_vmm_reserved_virtual_bytes{", "xllm_vmm_engine_step_seconds_bucket{", 'xllm_vmm_tenant_mapped_bytes{model_name='
                 '"fake-model",tenant="kv"}'):
        assert name in text, name


def test_api_key(tokenizer):
    eng, front, srv = _server(tokenizer, settings=ServerSettings(api_key="sekret",
                                                                 enable_admin=True))
    try:
        r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x"},
                       headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert HTTP.post(f"{srv.url}/sleep").status_code == 401
        r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        assert HTTP.get(f"{srv.url}/health").status_code == 200  # probes carry no key
    finally:
        srv.stop()


def test_admin_routes_off_by_default(tokenizer):
    eng, front, srv = _server(tokenizer, settings=ServerSettings())
    try:
        assert HTTP.post(f"{srv.url}/sleep").status_code == 404
        assert HTTP.get(f"{srv.url}/is_sleeping").status_code == 404
    finally:
        srv.stop()


def test_waiting_queue_limit_429(tokenizer):
    eng, front, srv = _server(tokenizer, max_waiting=0)
    try:
        r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        srv.stop()


def test_concurrency_limit_503(tokenizer):
    eng, front, srv = _server(tokenizer, max_concurrent=1)
    try:
        eng.run.clear()  # hold the engine: the request stays in flight
        with HTTP.stream("POST", f"{srv.url}/v1/completions",
                          json={"prompt": "x", "max_tokens": 50, "stream": True}) as s:
            lines = s.iter_lines()
            _wait(lambda: eng.reqs)
            r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "y"})
            assert r.status_code == 503 and "max_concurrent_requests=1" in r.text
            eng.run.set()
            list(lines)
        assert HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "y"}).status_code == 200
    finally:
        eng.run.set()
        srv.stop()


def test_sleep_refused_while_running_then_sleep_wake(tokenizer):
    eng, front, srv = _server(tokenizer)
    try:
        eng.run.clear()
        with HTTP.stream("POST", f"{srv.url}/v1/completions",
                          json={"prompt": "x", "max_tokens": 40, "stream": True}) as s:
            lines = s.iter_lines()
            _wait(lambda: eng.reqs)
            r = HTTP.post(f"{srv.url}/sleep?level=1")
            assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error"
            assert not eng.sleep_calls
            eng.run.set()
            list(lines)
        assert HTTP.get(f"{srv.url}/is_sleeping").json() == {"is_sleeping": False}
        r = HTTP.post(f"{srv.url}/sleep?level=2")
        assert r.status_code == 200 and eng.sleep_calls == [2]
        assert HTTP.get(f"{srv.url}/is_sleeping").json() == {"is_sleeping": True}
        r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"]
        assert HTTP.post(f"{srv.url}/wake_up").status_code == 200
        assert HTTP.post(f"{srv.url}/wakeup").json()["already"] is True
        r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
        r = HTTP.post(f"{srv.url}/sleep", json={"level": "medium"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "level"
    finally:
        srv.stop()


def test_sleep_drain_waits_for_running(tokenizer):
    eng, front, srv = _server(tokenizer)
    try:
        eng.run.clear()
        with HTTP.stream("POST", f"{srv.url}/v1/completions",
                          json={"prompt": "x", "max_tokens": 30, "stream": True}) as s:
            lines = s.iter_lines()
            _wait(lambda: eng.reqs)
            result = {}
            t = threading.Thread(target=lambda: result.setdefault(
                "r", HTTP.post(f"{srv.url}/sleep", json={"level": 1, "drain": True},
                                timeout=30)))
            t.start()
            _wait(lambda: front._draining)
            r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "y"})
            assert r.status_code == 503 and "draining" in r.text
            assert "r" not in result  # still waiting for the running request
            eng.run.set()
            events = _sse(lines)
        t.join(30)
        assert result["r"].status_code == 200
        finals = [e for e in events if e != "[DONE]" and e["choices"][0]["finish_reason"]]
        assert finals[0]["choices"][0]["finish_reason"] == "length"  # it ran to completion
        assert eng.sleeping
    finally:
        srv.stop()


def test_fork_serves_second_model(served):
    eng, front, srv = served
    r = HTTP.post(f"{srv.url}/fork_master", json={"name": "child"})
    assert r.status_code == 200 and r.json()["model"] == "child"
    ids = [m["id"] for m in HTTP.get(f"{srv.url}/v1/models").json()["data"]]
    assert ids == ["fake-model", "child"]
    r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x", "model": "child",
                                                      "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "child"
    status = HTTP.get(f"{srv.url}/vmm/status").json()
    assert status["stats"]["pool"]["reserved_bytes"] == 1 << 30


def test_stream_disconnect_aborts(tokenizer):
    eng, front, srv = _server(tokenizer, step_delay=0.01)
    try:
        with HTTP.stream("POST", f"{srv.url}/v1/completions",
                          json={"prompt": "x", "max_tokens": 100, "stream": True}) as s:
            lines = s.iter_lines()
            next(lines)
            assert eng.reqs
        _wait(lambda: not eng.reqs and front.num_in_flight == 0)
        assert len(eng.aborted) == 1
    finally:
        srv.stop()


def test_shutdown_cancels_and_closes(tokenizer):
    eng, front, srv = _server(tokenizer, step_delay=0.01, drain_timeout=0.2)
    with HTTP.stream("POST", f"{srv.url}/v1/completions",
                      json={"prompt": "x", "max_tokens": 100, "stream": True}) as s:
        lines = s.iter_lines()
        next(lines)
        threading.Thread(target=srv.stop).start()
        events = _sse(lines)
    assert events[-1] == "[DONE]"
    assert any(isinstance(e, dict) and "error" in e for e in events)
    _wait(lambda: eng.shut)
    assert not eng.reqs


def test_non_streaming_disconnect_aborts(tokenizer):
    eng, front, srv = _server(tokenizer, step_delay=0.01)
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the socket
            httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 100},
                       timeout=httpx.Timeout(30, read=0.3))
        _wait(lambda: not eng.reqs and front.num_in_flight == 0)
        assert len(eng.aborted) == 1  # aborted in the engine long before its 100 tokens
    finally:
        srv.stop()


def test_stream_never_splits_a_multibyte_character(served, tokenizer):
    eng, front, srv = served
    text = "héllo wörld ✓ 日本 🙂 naïve"
    ids = tokenizer.encode(text)
    # byte-level BPE: some characters span several tokens, so a token-by-token decode breaks them
    assert any("\ufffd" in tokenizer.decode(ids[:k]) for k in range(1, len(ids)))
    eng.script = ids
    with HTTP.stream("POST", f"{srv.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": len(ids),
            "stream": True}) as r:
        chunks = _sse(r)[:-1]
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert sum(1 for d in deltas if d) > 5  # streamed piece by piece, not all at the end


def test_engine_failure_is_500_and_the_server_keeps_serving(served):
    eng, front, srv = served
    real_step = eng.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return real_step()

    eng.step = failing_step
    r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 500 and "device fell over" in r.json()["error"]["message"]
    _wait(lambda: not eng.reqs)  # the failed request was aborted in the engine
    r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 200


def test_weights_not_loaded_is_503(served):
    eng, front, srv = served

    class WeightsNotLoaded(RuntimeError):  # the weights package's typed error, by name
        pass

    def refuse(*a, **k):
        raise WeightsNotLoaded("the model's weights are not loaded (state DEEP_SLEEP)")

    eng.add_request = refuse
    r = HTTP.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 503 and "not loaded" in r.json()["error"]["message"]


def test_metrics_answer_while_the_engine_is_stuck(tokenizer, monkeypatch):
    import xllm_vmm.server.app as app_mod

    monkeypatch.setattr(app_mod, "STATS_TIMEOUT_S", 0.2)
    eng, front, srv = _server(tokenizer)
    try:
        eng.run.clear()  # the engine thread stays inside step()
        with HTTP.stream("POST", f"{srv.url}/v1/completions",
                         json={"prompt": "x", "max_tokens": 5, "stream": True}):
            _wait(lambda: eng.reqs and eng.in_step)
            r = HTTP.get(f"{srv.url}/metrics")
            assert r.status_code == 200
            assert 'xllm_vmm_requests_in_flight{model_name="fake-model"} 1.0' in r.text
            assert "xllm_vmm_reserved_virtual_bytes" not in r.text  # no engine figures
            eng.run.set()
    finally:
        eng.run.set()
        srv.stop()
