"""``/v1/completions`` with ``echo`` + ``logprobs`` (the echoed prompt's tokens carry their
log-probabilities, OpenAI's legacy shape) and vLLM's ``prompt_logprobs`` extra parameter, over
the REAL engine (tiny fp32 Llama, KV and weights in an elastic VMM pool) through the official
``openai`` client; values checked against transformers' log-softmax of the prompt."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.engine.checkpoints import load_hf_model
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

MAX_LEN = 128
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    from xllm_vmm.engine import LLMEngine

    eng = LLMEngine.from_flags(str(tiny_llama_dir), enable_vmm_kvcache=True, vmm_elastic=True,
                               enable_vmm_weights=True, block_size=16, max_model_len=MAX_LEN,
                               device_memory="256MiB", model_id="tiny-llama")
    srv = RunningServer(build_app(AsyncEngine(eng), ServerSettings()), drain_timeout=5).start()
    yield eng, srv
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[1].url}/v1", api_key="x", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_llama_dir, served):
    """transformers' log-softmax rows of the prompt: row i predicts token i + 1."""
    import torch

    eng, _ = served
    ids = eng.tokenizer.encode(PROMPT)
    model = load_hf_model(tiny_llama_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def test_echo_logprobs_in_openai_shape(served, client, hf_prompt_logprobs):
    eng, _ = served
    ids, rows = hf_prompt_logprobs
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4, echo=True,
                                  logprobs=2, temperature=0.0)
    (choice,) = r.choices
    lp = choice.logprobs
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 4
    assert lp.tokens[:n] == [eng.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(float(rows[i - 1, ids[i]]), abs=1e-4)
        # the 2 most likely and the prompt token itself, keyed by text (the likelier id of
        # two with one text)
        best = rows[i - 1].topk(2)
        cand = sorted({*best.indices.tolist(), ids[i]}, key=lambda t: -float(rows[i - 1, t]))
        want: dict[str, float] = {}
        for t in cand:
            want.setdefault(eng.tokenizer.decode([t]), float(rows[i - 1, t]))
        assert lp.top_logprobs[i] == pytest.approx(want, abs=1e-4)
    # the completion part: as without echo (greedy, 2 alternatives each)
    assert all(x is not None for x in lp.token_logprobs[n:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[n:])
    assert choice.text.startswith(PROMPT)
    assert lp.text_offset[n] == len(PROMPT)  # completion offsets count from the echoed text
    assert lp.text_offset[:n] == sorted(lp.text_offset[:n]) and lp.text_offset[0] == 0
    plain = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=4,
                                      logprobs=2, temperature=0.0)
    assert plain.choices[0].logprobs.tokens == lp.tokens[n:]
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[n:],
                                                                     abs=1e-5)


def test_prompt_logprobs_extra_parameter(served, client, hf_prompt_logprobs):
    ids, rows = hf_prompt_logprobs
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2,
                                  temperature=0.0, extra_body={"prompt_logprobs": 1})
    (choice,) = r.choices
    plps = choice.model_extra["prompt_logprobs"]
    assert choice.logprobs is None and not choice.text.startswith(PROMPT)
    assert len(plps) == len(ids) and plps[0] is None
    for i in range(1, len(ids)):
        entry = plps[i]
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(float(rows[i - 1, ids[i]]), abs=1e-4)
        assert own["rank"] == int((rows[i - 1] > rows[i - 1, ids[i]]).sum()) + 1
        top = int(rows[i - 1].argmax())
        assert entry[str(top)]["rank"] == 1
        assert set(entry) <= {str(ids[i]), str(top)}
    zero = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=1,
                                     extra_body={"prompt_logprobs": 0})
    z = zero.choices[0].model_extra["prompt_logprobs"]
    assert all(set(e) == {str(t)} for e, t in zip(z[1:], ids[1:]))


def test_echo_logprobs_streamed_with_n(served, hf_prompt_logprobs):
    _, srv = served
    ids, rows = hf_prompt_logprobs
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 3, "echo": True,
            "logprobs": 1, "stream": True, "n": 2, "temperature": 0.0}
    firsts: dict[int, dict] = {}
    texts = {0: "", 1: ""}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                firsts.setdefault(c["index"], c)
                texts[c["index"]] += c["text"]
    for i in (0, 1):
        first = firsts[i]
        assert first["text"].startswith(PROMPT)  # the prompt with the first token
        lp = first["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids) + 1
        assert lp["token_logprobs"][1] == pytest.approx(float(rows[0, ids[1]]), abs=1e-4)
        assert texts[i].startswith(PROMPT) and texts[i].count(PROMPT) == 1


def test_prompt_logprobs_refusals(served, client):
    _, srv = served
    r = httpx.post(f"{srv.url}/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 2, "stream": True, "prompt_logprobs": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2,
                                  extra_body={"prompt_logprobs": 21})
    assert err.value.body["param"] == "prompt_logprobs"


# --------------------------------------------------------------------------- chat completions
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def chat_ids(served):
    """The rendered chat prompt's token ids, as the server encodes them (/tokenize)."""
    _, srv = served
    r = httpx.post(f"{srv.url}/tokenize", json={"messages": MESSAGES}, timeout=30)
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def hf_chat_rows(tiny_llama_dir, chat_ids):
    import torch

    model = load_hf_model(tiny_llama_dir)
    with torch.no_grad():
        logits = model(torch.tensor([chat_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_vllm_shape(plps, ids, rows, k):
    """vLLM's shape: None first, then {token id: {logprob, rank, decoded_token}} holding the
    prompt token and the k most likely; values equal transformers' log-softmax."""
    assert len(plps) == len(ids) and plps[0] is None
    for i in range(1, len(ids)):
        entry, row = plps[i], rows[i - 1]
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {str(t) for t in (ids[i], *top)}
        for t, v in entry.items():
            assert set(v) == {"logprob", "rank", "decoded_token"}
            assert v["logprob"] == pytest.approx(float(row[int(t)]), abs=1e-4)
            assert v["rank"] == int((row > row[int(t)]).sum()) + 1
            assert isinstance(v["decoded_token"], str)


def test_chat_prompt_logprobs_with_the_openai_client(served, client, chat_ids, hf_chat_rows):
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2,
                                       temperature=0.0, extra_body={"prompt_logprobs": 2})
    plps = r.model_extra["prompt_logprobs"]
    _check_vllm_shape(plps, chat_ids, hf_chat_rows, 2)
    assert r.usage.prompt_tokens == len(chat_ids)
    # the engine's own computation of the same prompt (completions over the token ids)
    same = client.completions.create(model="tiny-llama", prompt=chat_ids, max_tokens=1,
                                     extra_body={"prompt_logprobs": 2})
    # equal up to the float32 products' summation order: the second request hits the prefix
    # cache, so its rows come from a read-only recompute and a shorter chunk, products of other
    # shapes whose kernels may sum in another order on some CPUs
    again = same.choices[0].model_extra["prompt_logprobs"]
    assert len(again) == len(plps) and again[0] is None
    for a, b in zip(again[1:], plps[1:]):
        assert set(a) == set(b)
        for t in a:
            assert a[t]["rank"] == b[t]["rank"] and a[t]["decoded_token"] == b[t]["decoded_token"]
            assert a[t]["logprob"] == pytest.approx(b[t]["logprob"], abs=1e-5)
    # and the reply is the reply without prompt_logprobs
    plain = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2,
                                           temperature=0.0)
    assert plain.choices[0].message.content == r.choices[0].message.content
    assert "prompt_logprobs" not in (plain.model_extra or {})


def test_chat_prompt_logprobs_streamed(served, client, chat_ids, hf_chat_rows):
    _, srv = served
    body = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 3, "stream": True,
            "temperature": 0.0, "prompt_logprobs": 0, "n": 2}
    chunks = []
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    first = chunks[0]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    _check_vllm_shape(first["prompt_logprobs"], chat_ids, hf_chat_rows, 0)
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    assert {c["choices"][0]["index"] for c in chunks if c["choices"][0].get("finish_reason")} \
        == {0, 1}
    # the openai client's stream: the first chunk has them
    stream = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2,
                                            stream=True, extra_body={"prompt_logprobs": 1})
    got = [c for c in stream]
    _check_vllm_shape(got[0].model_extra["prompt_logprobs"], chat_ids, hf_chat_rows, 1)


@pytest.mark.parametrize("bad", [-1, 21, "x", 1.5])
def test_chat_prompt_logprobs_refusals(served, client, bad):
    _, srv = served
    for stream in (False, True):
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 2, "stream": stream, "prompt_logprobs": bad},
            timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2,
                                       extra_body={"prompt_logprobs": bad})
    assert err.value.body["param"] == "prompt_logprobs"


def test_minus_infinity_is_sent_as_vllm_does():
    from xllm_vmm.engine.output import Logprob
    from xllm_vmm.server.openai_routes import _prompt_logprobs_json

    got = _prompt_logprobs_json([None, {3: Logprob(float("-inf"), 7, "x"),
                                        5: Logprob(-0.5, 1, "y")}])
    assert got == [None, {"3": {"logprob": -9999.0, "rank": 7, "decoded_token": "x"},
                          "5": {"logprob": -0.5, "rank": 1, "decoded_token": "y"}}]
    json.dumps(got, allow_nan=False)  # valid JSON
