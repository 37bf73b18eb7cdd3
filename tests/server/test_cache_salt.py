"""vLLM's ``cache_salt`` end to end: two requests with the same prompt
and different salts never share prefix-cache blocks, the same salt (or none on both) does —
through ``LLM.generate``'s dict prompts (block ids read from the engine while the requests
run) and through the HTTP API (``usage.prompt_tokens_details.cached_tokens`` and
``/metrics``' ``vllm:prefix_cache_hits`` / ``xllm_vmm_kv_cached_blocks``), on the REAL engine
(tiny fp32 Llama, KV in an elastic VMM pool, 16-token blocks)."""

from __future__ import annotations

import httpx
import openai
import pytest

from xllm_vmm.bench.serve import parse_metric
from xllm_vmm.engine.request import RequestError
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

BS = 16
PROMPT = list(range(10, 74))          # 64 tokens: 3 full blocks can be served from the cache
HIT = (len(PROMPT) - 1) // BS * BS    # 48 tokens
FLAGS = dict(enable_vmm_kvcache=True, vmm_elastic=True, block_size=BS, max_model_len=128,
             device_memory="256MiB")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from xllm_vmm import LLM

    with LLM(str(tiny_llama_dir), **FLAGS) as llm:
        yield llm


def _run(llm, prompts):
    """Generate ``prompts`` (2 greedy tokens each); returns the outputs and every request's
    block ids as seen after its first step (the prefix hit's blocks come first)."""
    from xllm_vmm import SamplingParams

    mgr = llm.llm_engine.kv_cache_manager
    seen: dict[str, list[int]] = {}

    def hook():
        for req in list(llm.llm_engine.scheduler.running):
            if req.request_id not in seen and mgr.has_request(req.request_id):
                seen[req.request_id] = [b for ids in mgr.block_tables(req.request_id).values()
                                        for b in ids]

    llm._step_hook = hook
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2))
    finally:
        llm._step_hook = None
    return outs, [seen[o.request_id] for o in outs]


def _hits(llm) -> int:
    return int(llm.llm_engine.stats()["prefix_cache_hits"])


def test_llm_salts_never_share_blocks(llm):
    llm.reset_prefix_cache()
    (a1,), (blocks_a1,) = _run(llm, {"prompt_token_ids": PROMPT, "cache_salt": "alice"})
    assert a1.num_cached_tokens == 0
    before = _hits(llm)
    # both at once, after alice's blocks were cached: alice hits hers, bob shares nothing
    (a2, b1), (blocks_a2, blocks_b1) = _run(llm, [
        {"prompt_token_ids": PROMPT, "cache_salt": "alice"},
        {"prompt_token_ids": PROMPT, "cache_salt": "bob"}])
    assert a2.num_cached_tokens == HIT and b1.num_cached_tokens == 0
    assert _hits(llm) - before == HIT
    assert blocks_a2[:HIT // BS] == blocks_a1[:HIT // BS]
    assert not set(blocks_b1) & set(blocks_a1)
    # bob's own blocks are now cached under bob's salt; no salt shares neither
    (b2, plain), (blocks_b2, blocks_plain) = _run(llm, [
        {"prompt_token_ids": PROMPT, "cache_salt": "bob"}, PROMPT])
    assert b2.num_cached_tokens == HIT and plain.num_cached_tokens == 0
    assert blocks_b2[:HIT // BS] == blocks_b1[:HIT // BS]
    assert not set(blocks_plain) & (set(blocks_a1) | set(blocks_b1))
    # the same tokens and outputs whatever the salt (the salt only keys the cache)
    assert a1.outputs[0].token_ids == b1.outputs[0].token_ids == plain.outputs[0].token_ids
    # no salt on both: shared as before
    (p2,), _ = _run(llm, {"prompt_token_ids": PROMPT})
    assert p2.num_cached_tokens == HIT


def test_llm_text_prompt_with_salt(llm):
    llm.reset_prefix_cache()
    text = "the cache salt keeps tenants apart " * 4
    (x,), _ = _run(llm, {"prompt": text, "cache_salt": "t1"})
    (y,), _ = _run(llm, {"prompt": text, "cache_salt": "t2"})
    (z,), _ = _run(llm, {"prompt": text, "cache_salt": "t1"})
    n = len(x.prompt_token_ids)
    assert x.num_cached_tokens == 0 and y.num_cached_tokens == 0
    assert z.num_cached_tokens == (n - 1) // BS * BS > 0


@pytest.mark.parametrize("bad", ["", 7, ["a"]])
def test_llm_bad_salt_names_cache_salt(llm, bad):
    with pytest.raises(RequestError) as err:
        llm.generate({"prompt_token_ids": PROMPT, "cache_salt": bad})
    assert err.value.param == "cache_salt"
    with pytest.raises(RequestError) as err:
        from xllm_vmm import SamplingParams

        llm.llm_engine.add_request("bad-salt", PROMPT, SamplingParams(), cache_salt=bad)
    assert err.value.param == "cache_salt"
    assert not llm.llm_engine.has_unfinished_requests()


# --------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    from xllm_vmm.engine import LLMEngine

    eng = LLMEngine.from_flags(str(tiny_llama_dir), model_id="tiny-llama", **FLAGS)
    srv = RunningServer(build_app(AsyncEngine(eng), ServerSettings()), drain_timeout=5).start()
    yield eng, srv
    srv.stop()


def _metric(srv, name) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    return parse_metric(text, name, {"model_name": "tiny-llama"})


def _complete(srv, salt=None, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_http_completions_salts_never_share_blocks(served):
    eng, srv = served
    eng.reset_prefix_cache()  # idle: safe from this thread before any request
    hits0 = _metric(srv, "vllm:prefix_cache_hits_total")
    assert _cached(_complete(srv, "alice")) == 0
    blocks_one = _metric(srv, "xllm_vmm_kv_cached_blocks")
    assert blocks_one >= HIT // BS
    assert _cached(_complete(srv, "bob")) == 0
    # bob's prompt got blocks of its own (the same tokens, greedy): the cache keeps both copies
    assert _metric(srv, "xllm_vmm_kv_cached_blocks") == 2 * blocks_one
    assert _metric(srv, "vllm:prefix_cache_hits_total") == hits0
    assert _cached(_complete(srv, "alice")) == HIT
    assert _cached(_complete(srv, "bob")) == HIT
    assert _metric(srv, "vllm:prefix_cache_hits_total") == hits0 + 2 * HIT
    assert _cached(_complete(srv)) == 0          # no salt shares with neither
    assert _cached(_complete(srv)) == HIT        # ... but with itself
    streamed = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 2, "stream": True, "cache_salt": "carol",
        "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200
    usage = [line for line in streamed.text.splitlines() if '"usage":{' in line][-1]
    assert '"cached_tokens":0' in usage


def test_http_chat_salt_with_the_openai_client(served):
    eng, srv = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "tell me about the cache salt " * 6}]

    def cached(salt):
        r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2,
                                           temperature=0.0, extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens

    first, n = cached("tenant-1")
    assert first == 0 and n > BS
    assert cached("tenant-2")[0] == 0
    assert cached("tenant-1")[0] == (n - 1) // BS * BS


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("bad", [7, "", ["s"], {"a": 1}, True])
def test_http_bad_salt_is_400_naming_cache_salt(served, route, bad):
    _, srv = served
    body = {"max_tokens": 2, "cache_salt": bad}
    if route.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = httpx.post(f"{srv.url}{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and "cache_salt" in err["message"]


def test_hybrid_model_salts_through_the_linear_state_wrapper(tmp_path):
    """Qwen3-Next: the scheduler sees ``LinearStateKVManager``, whose lookup passes the salt on;
    a hit under the same salt resumes from the state checkpoint, another salt computes all."""
    from tests.engine.checkpoints import qwen3_next_checkpoint, random_prompt
    from xllm_vmm import LLM, SamplingParams

    d = qwen3_next_checkpoint(tmp_path / "m")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = random_prompt(2 * BS + 5, 8)
    with LLM(model=str(d), enable_prefix_cache=True, block_size=BS) as h:
        assert type(h.llm_engine.kv_cache_manager).__name__ == "LinearStateKVManager"
        got = [h.generate({"prompt_token_ids": prompt, "cache_salt": s}, params)[0]
               for s in ("a", "b", "a")]
        stats = h.llm_engine.kv_cache_manager.stats()
    assert [o.num_cached_tokens for o in got] == [0, 0, 2 * BS]
    assert stats["linear_state_restores"] == 1 and stats["prefix_hit_tokens"] == 2 * BS
    assert got[0].outputs[0].token_ids == got[1].outputs[0].token_ids == got[2].outputs[0].token_ids


def test_two_workers_salts_as_one(tiny_llama_dir):
    """A worker set (rank 0 spawns rank 1): the scheduler's lookup runs on rank 0 and every
    worker maps the same slots (the fan-out sits below the manager), so salts isolate and
    share exactly as on one worker."""
    from xllm_vmm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM(str(tiny_llama_dir), nnodes=2, **FLAGS) as two:
        got = [two.generate({"prompt_token_ids": PROMPT, "cache_salt": s}, params)[0]
               for s in ("a", "b", "a")]
    assert [o.num_cached_tokens for o in got] == [0, 0, HIT]
    assert got[0].outputs[0].token_ids == got[1].outputs[0].token_ids == got[2].outputs[0].token_ids
