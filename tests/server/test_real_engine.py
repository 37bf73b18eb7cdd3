"""The server over the REAL engine (tiny fp32 Llama built here, weights and KV in an elastic VMM
pool), driven by the official ``openai`` client and by raw loopback HTTP: greedy outputs token
for token against transformers, streaming, errors, 200 concurrent streams with random client
disconnects (none lost, the pool idle afterwards), sleep refused while requests run, outputs
identical after light and deep sleep."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading

import httpx
import openai
import pytest

from tests.engine.checkpoints import hf_greedy, load_hf_model
from tests.server.conftest import host_vmm_handles
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

KEY = "test-key"
MAX_LEN = 256


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf_model(model_dir)


@pytest.fixture(scope="module")
def served(model_dir):
    from xllm_vmm.engine import LLMEngine

    handles = host_vmm_handles()
    eng = LLMEngine.from_flags(str(model_dir), enable_vmm_kvcache=True, vmm_elastic=True,
                               enable_vmm_weights=True, block_size=16, max_model_len=MAX_LEN,
                               device_memory="512MiB", model_id="tiny-llama")
    front = AsyncEngine(eng)
    app = build_app(front, ServerSettings(api_key=KEY, enable_admin=True))
    srv = RunningServer(app, drain_timeout=5).start()
    yield eng, front, srv
    srv.stop()
    assert eng._closed  # the engine was shut down with the server (pool released)
    assert host_vmm_handles() == handles  # no memfd or mapping of its pool left behind


@pytest.fixture(scope="module")
def client(served):
    _, _, srv = served
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _http(srv) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=60)


@contextlib.contextmanager
def hold_engine(front, srv):
    """Keep the engine thread busy between two steps (requests stay in flight)."""
    ev = threading.Event()
    fut = asyncio.run_coroutine_threadsafe(front.call(lambda e: ev.wait(30)), srv._loop)
    try:
        yield
    finally:
        ev.set()
        fut.result(30)


def test_completion_greedy_matches_transformers(served, client, hf_model):
    eng, _, _ = served
    prompt = "The quick brown fox"
    ids = eng.tokenizer.encode(prompt)
    ref = hf_greedy(hf_model, ids, 12)
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == eng.tokenizer.decode(ref)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    again = client.completions.create(model="tiny-llama", prompt=prompt * 8, max_tokens=2,
                                      temperature=0)
    repeat = client.completions.create(model="tiny-llama", prompt=prompt * 8, max_tokens=2,
                                       temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert repeat.usage.prompt_tokens_details.cached_tokens >= 16  # a 16-token block hit
    # token-id prompt, streamed: the same text, chunk by chunk
    chunks = list(client.completions.create(model="tiny-llama", prompt=ids, max_tokens=12,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == eng.tokenizer.decode(ref)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_greedy_stream_and_not(served, client, hf_model):
    eng, _, _ = served
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(messages),
                               add_special_tokens=False)
    ref = eng.tokenizer.decode(hf_greedy(hf_model, ids, 10))
    r = client.chat.completions.create(model="tiny-llama", messages=messages,
                                       max_completion_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref
    stream = client.chat.completions.create(model="tiny-llama", messages=messages,
                                            max_completion_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_logprobs_and_seeded_sampling(served, client):
    r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=5,
                                  temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and max(top.values()) == pytest.approx(chosen)  # greedy = argmax
    chat = client.chat.completions.create(model="tiny-llama", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hello"}],
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    a = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=8, seed=7,
                                  temperature=1.0, n=2, extra_body={"ignore_eos": True})
    b = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=8, seed=7,
                                  temperature=1.0, n=2, extra_body={"ignore_eos": True})
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_errors_through_the_openai_client(served, client):
    _, _, srv = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=10_000)
    assert e.value.body["param"] == "max_tokens" and str(MAX_LEN) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="no-such-model", prompt="x")
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt=[10 ** 6], max_tokens=2)
    assert e.value.body["param"] == "prompt_token_ids"  # the engine's own check, passed through
    bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def _kv(srv) -> dict:
    with _http(srv) as c:
        return c.get("/vmm/status").json()["stats"]


def test_200_concurrent_streams_with_disconnects_none_lost(served):
    eng, front, srv = served
    rng = random.Random(0)
    with _http(srv) as c:
        before = sum(float(line.rsplit(" ", 1)[1]) for line in c.get("/metrics").text.splitlines()
                     if line.startswith("vllm:request_success_total{"))
    plan = []
    for _ in range(200):  # a third leave after their first token, long before their end
        leave = rng.random() < 0.3
        plan.append((rng.randrange(4, 300), rng.randint(150, 200) if leave else
                     rng.randint(2, 12), leave))

    async def one(client, i, first, n_tokens, disconnect):
        prompt = [first + k for k in range(rng.randint(3, 40))]
        body = {"model": "tiny-llama", "prompt": [t % 380 + 4 for t in prompt],
                "max_tokens": n_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
        got = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return ("done", got)
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                got += 1
                if disconnect and got >= 1:
                    return ("cancelled", got)  # leaves the stream: the connection is closed
        return ("truncated", got)

    async def main():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"}) as client:
            return await asyncio.gather(*(one(client, i, *p) for i, p in enumerate(plan)))

    results = asyncio.run(asyncio.wait_for(main(), 300))
    kinds = [k for k, _ in results]
    assert kinds.count("done") + kinds.count("cancelled") == 200, kinds
    assert kinds.count("cancelled") == sum(d for *_, d in plan)
    # every request ended exactly once in the server (finished or aborted): none lost
    deadline = 100
    while front.num_in_flight and deadline:
        deadline -= 1
        threading.Event().wait(0.05)
    assert front.num_in_flight == 0
    with _http(srv) as c:
        text = c.get("/metrics").text
    after = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("vllm:request_success_total{"))
    assert after - before == 200
    aborted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith('vllm:request_success_total{finished_reason="abort"'))
    assert aborted >= kinds.count("cancelled") // 2  # most left while running: aborted
    peak = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("xllm_vmm_kv_mapped_peak_bytes{")]
    assert peak and peak[0] > 0  # the pool grew with the load...
    stats = _kv(srv)
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["kvcache"]["live_blocks"] == 0 and stats["kvcache"]["requests"] == 0
    with _http(srv) as c:
        assert c.post("/reset_prefix_cache").status_code == 200
    stats = _kv(srv)
    assert stats["kvcache"]["cached_blocks"] == 0
    assert stats["cache_groups"]["attn"]["live_blocks"] == 0
    assert set(stats["tenants"]) == {"kv", "weights"}
    assert stats["tenants"]["kv"]["mapped_bytes"] == 0 < stats["tenants"]["kv"]["region_bytes"]
    assert stats["kvcache"]["mapped_bytes"] == stats["kvcache"]["packed_floor_bytes"] == 0
    assert stats["pool_tenant_mapped_bytes"]["kv"] == 0  # ...and went back to the floor


def _greedy(client, prompt="sleep and wake", n=10):
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=n,
                                  temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    seeded = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=n,
                                       temperature=0.8, seed=3, extra_body={"ignore_eos": True})
    return r.choices[0].text, r.choices[0].logprobs.token_logprobs, seeded.choices[0].text


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_refused_while_running_and_outputs_identical_after_wakeup(served, client, level):
    eng, front, srv = served
    before = _greedy(client)
    with _http(srv) as c:
        done = {}
        with hold_engine(front, srv):  # a request arrives and stays in flight while we ask
            t = threading.Thread(target=lambda: done.setdefault("r", c.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 20, "ignore_eos": True})))
            t.start()
            for _ in range(600):
                if front.num_in_flight:
                    break
                threading.Event().wait(0.01)
            assert front.num_in_flight == 1
            r = c.post("/sleep", params={"level": level})
            assert r.status_code == 409, r.text
            assert "in flight" in r.json()["error"]["message"]
            assert not eng.is_sleeping()
        t.join(30)
        assert done["r"].status_code == 200  # the request it protected ran to its end
        assert done["r"].json()["usage"]["completion_tokens"] == 20
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        r = c.post("/sleep", params={"level": level})
        assert r.status_code == 200, r.text
        assert c.get("/is_sleeping").json() == {"is_sleeping": True}
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"]
        stats = c.get("/vmm/status").json()["stats"]
        assert stats["pool_tenant_mapped_bytes"]["kv"] == 0
        assert stats["pool_tenant_mapped_bytes"]["weights"] == 0
        assert c.post("/wake_up").status_code == 200
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _greedy(client) == before


def test_fork_serves_the_same_weights_under_a_second_name(served, client):
    eng, front, srv = served
    ref = client.completions.create(model="tiny-llama", prompt="fork me", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    with _http(srv) as c:
        r = c.post("/fork_master", json={"name": "tiny-fork"})
        assert r.status_code == 200, r.text
        got = client.completions.create(model="tiny-fork", prompt="fork me", max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.model == "tiny-fork" and got.choices[0].text == ref.choices[0].text
        assert {m.id for m in client.models.list().data} == {"tiny-llama", "tiny-fork"}
        assert c.post("/fork", json={"name": "tiny-fork"}).status_code == 400
        text = c.get("/metrics").text
        assert 'vllm:num_requests_running{model_name="tiny-fork"}' in text


def test_sleep_with_drain_waits_for_running_requests(served, client):
    eng, front, srv = served
    before = _greedy(client)
    out = {}
    with _http(srv) as c:
        with hold_engine(front, srv):
            t1 = threading.Thread(target=lambda: out.setdefault("req", c.post(
                "/v1/completions", json={"prompt": "drain me", "max_tokens": 16,
                                         "ignore_eos": True})))
            t1.start()
            for _ in range(600):
                if front.num_in_flight:
                    break
                threading.Event().wait(0.01)
            t2 = threading.Thread(target=lambda: out.setdefault("sleep", c.post(
                "/sleep", json={"level": 1, "drain": True, "timeout": 60})))
            t2.start()
            for _ in range(600):
                if front._draining:
                    break
                threading.Event().wait(0.01)
            r = c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        t1.join(60)
        t2.join(60)
        assert out["req"].status_code == 200  # it ran to its end before the engine slept
        assert out["req"].json()["usage"]["completion_tokens"] == 16
        assert out["sleep"].status_code == 200, out["sleep"].text
        assert c.get("/is_sleeping").json() == {"is_sleeping": True}
        assert c.post("/wakeup").status_code == 200
    assert _greedy(client) == before
