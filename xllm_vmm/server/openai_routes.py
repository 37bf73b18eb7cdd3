"""The OpenAI routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/tokenize``, ``/detokenize``.

Response shapes are OpenAI's (as vLLM sends them). Streaming is SSE: ``data: {chunk}\\n\\n``
events, ``data: [DONE]\\n\\n`` last; a chat stream's first delta of each choice carries the role;
with ``stream_options.include_usage`` every chunk has ``"usage": null`` and one chunk with
``"choices": []`` and the totals comes before ``[DONE]``; with ``continuous_usage_stats`` every
chunk carries the usage so far. An error after the stream started is one ``data: {"error":
...}`` event, then ``[DONE]``.

A client that disconnects cancels its request: streaming, the response generator is cancelled
(its ``finally`` aborts); otherwise a watcher polls ``request.is_disconnected()``. Either way
the engine frees the request's blocks.

Token budgets: ``max_completion_tokens`` wins over ``max_tokens``; unset, a completion gets 16
tokens (OpenAI's default) and a chat completion the rest of the context. A prompt whose length
plus the budget exceeds ``max_model_len`` is a 400 that states both numbers.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from xllm_vmm.server.errors import APIError, from_validation
from xllm_vmm.server.front import AsyncEngine, Delta, Generation
from xllm_vmm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16


PARSE_ON_LOOP_BYTES = 64 * 1024
"""Bodies up to this size are parsed on the event loop (microseconds); larger ones on a worker
thread, so that a megabytes-long prompt never holds up ``/health`` or the streams."""


def _parse(raw: bytes, model):
    try:
        data = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc.errors()) from None


async def _body(request: Request, model):
    """Parse the JSON body into ``model``; any problem is a 400 naming the field."""
    raw = await request.body()
    if len(raw) <= PARSE_ON_LOOP_BYTES:
        return _parse(raw, model)
    return await asyncio.to_thread(_parse, raw, model)


async def _encode(front: AsyncEngine, text: str) -> list[int]:
    return list(await asyncio.to_thread(front.tokenizer.encode, text))


HEAD_CHARS_PER_TOKEN = 8
"""A prompt more than ``HEAD_FACTOR`` times longer than its head of ``(max_model_len +
HEAD_SLACK) * HEAD_CHARS_PER_TOKEN`` characters is first tokenized in that head: when the head
alone has more tokens than the context, the prompt is refused without tokenizing the rest (a
10 MB prompt took 16-20 s to tokenize before its 400, and each refused 1 MB prompt left ~5 MB
of heap behind). Merges across the cut change at most a few tokens (``HEAD_SLACK``). Shorter
prompts are counted in full, so their 400 states the exact count."""
HEAD_SLACK = 8
HEAD_FACTOR = 16


def _prompt_ids(front: AsyncEngine, text: str, param: str,
                add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids (on a worker thread: the caller runs it there), or a 400 as soon as
    its head shows that it cannot fit the context (:data:`HEAD_CHARS_PER_TOKEN`)."""
    limit = front.max_model_len
    head = (limit + HEAD_SLACK) * HEAD_CHARS_PER_TOKEN
    if len(text) > head * HEAD_FACTOR:
        n = len(front.tokenizer.encode(text[:head], add_special_tokens=add_special_tokens))
        if n - HEAD_SLACK >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but "
                                f"the prompt has more than {n - HEAD_SLACK} tokens (its first "
                                f"{head} of {len(text)} characters alone). Shorten the prompt.",
                           param=param)
    return list(front.tokenizer.encode(text, add_special_tokens=add_special_tokens))


async def _encode_prompt(front: AsyncEngine, text: str, param: str = "prompt") -> list[int]:
    return await asyncio.to_thread(_prompt_ids, front, text, param)


async def _chat_prompt(front: AsyncEngine, messages: list[dict], add_generation_prompt: bool,
                       fit: bool = True) -> tuple[str, list[int]]:
    """The rendered chat prompt and its ids; ``fit``: refuse early one that cannot fit the
    context (``_prompt_ids``; ``/tokenize`` counts any length)."""
    def render():
        try:
            text = front.tokenizer.apply_chat_template(messages,
                                                       add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # no template, or a template that refuses the roles given
            raise APIError(400, f"the chat template refused the messages: {exc}",
                           param="messages") from None
        # The template writes the special tokens itself (as vLLM encodes chat prompts).
        if not fit:
            return text, list(front.tokenizer.encode(text, add_special_tokens=False))
        return text, _prompt_ids(front, text, "messages", add_special_tokens=False)

    return await asyncio.to_thread(render)


def _gather(deltas: list[Delta], n_choices: int
            ) -> tuple[list[str], list[list], dict[int, Delta], int, int]:
    """A non-streamed response's choices from its deltas: text and logprobs per choice index,
    each choice's finishing delta, completion tokens, and prompt tokens served from the cache
    (counted once per finished choice)."""
    text = ["" for _ in range(n_choices)]
    lps: list[list] = [[] for _ in range(n_choices)]
    final: dict[int, Delta] = {}
    completion_tokens = cached = 0
    for d in deltas:
        text[d.index] += d.text
        if d.logprobs:
            lps[d.index].extend(d.logprobs)
        completion_tokens += len(d.token_ids)
        if d.finished:
            final[d.index] = d
            cached += d.num_cached_tokens
    return text, lps, final, completion_tokens, cached


def _budget(front: AsyncEngine, prompt_len: int, req, default: Optional[int],
            prompt_param: str) -> int:
    """The completion's token budget: what the request asks (``default`` when it asks
    nothing; the rest of the context without a default), cut to what the context has left
    beside the prompt — as vLLM does: ``vllm bench serve``'s random loads ask budgets that
    overrun the context, and it serves them to the context's end (``finish_reason``
    ``length``). A 400 stating both numbers when the prompt leaves no room, or when the budget
    asked is above the whole context."""
    limit = front.max_model_len
    asked = req.requested_max_tokens()
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens, but the "
                            f"prompt has {prompt_len} tokens (at least one token must be left "
                            "for the completion). Shorten the prompt.", param=prompt_param)
    if asked is None:
        asked = default if default is not None else limit - prompt_len
    elif asked > limit:
        raise APIError(400, f"{req.max_tokens_param()}={asked} is more than this model's "
                            f"maximum context length of {limit} tokens; with this prompt "
                            f"({prompt_len} tokens) at most {limit - prompt_len} can be "
                            f"generated. Request fewer.", param=req.max_tokens_param())
    asked = min(asked, limit - prompt_len)
    if req.min_tokens > asked:
        raise APIError(400, f"min_tokens ({req.min_tokens}) must not exceed the completion's "
                            f"budget ({asked} tokens)", param="min_tokens")
    return asked


def _usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # prefix-cache hits


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


_DONE = "data: [DONE]\n\n"

_js_str = json.encoder.encode_basestring  # json.dumps(s, ensure_ascii=False) of one str


def _js(v) -> str:
    """``v`` as ``json.dumps(v, ensure_ascii=False)`` writes it, fast for None/str/int."""
    if v is None:
        return "null"
    if type(v) is str:
        return _js_str(v)
    if type(v) is int:
        return str(v)
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


class _PlainChunks:
    """The SSE events of the common streamed chunk — one choice, no logprobs, no continuous
    usage — from a head written once per stream: the same text as ``_sse(chunk(...))`` byte
    for byte (``tests/server/test_latency.py``), without a ``json.dumps`` of the whole chunk
    per token (the event loop's largest cost per chunk after the socket write)."""

    def __init__(self, rid: str, obj: str, created: int, model: str, include_usage: bool):
        self.head = (f'data: {{"id":{_js(rid)},"object":{_js(obj)},"created":{int(created)},'
                     f'"model":{_js(model)},"choices":[{{"index":')
        self.tail = ',"usage":null}\n\n' if include_usage else '}\n\n'

    def completion(self, index: int, text: str, finish_reason, stop_reason) -> str:
        return (f'{self.head}{int(index)},"text":{_js_str(text)},"logprobs":null,'
                f'"finish_reason":{_js(finish_reason)},"stop_reason":{_js(stop_reason)}}}]'
                f'{self.tail}')

    def chat(self, index: int, content: Optional[str], finish_reason, stop_reason) -> str:
        delta = "{}" if content is None else f'{{"content":{_js_str(content)}}}'
        return (f'{self.head}{int(index)},"delta":{delta},"logprobs":null,'
                f'"finish_reason":{_js(finish_reason)},"stop_reason":{_js(stop_reason)}}}]'
                f'{self.tail}')


class _Tokens:
    """Token strings for logprobs (decoded one token at a time; cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.cache[tid] = self.tokenizer.decode([tid])
        return s


def _completion_logprobs(tok: _Tokens, entries, offset: int) -> dict:
    """OpenAI's legacy ``logprobs`` object of ``entries`` (``(token_id, logprob, top)``; a
    ``logprob`` of None — the prompt's first token, which nothing predicts — gives None in
    ``token_logprobs`` and ``top_logprobs``), text offsets counted from ``offset``."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for tid, lp, top in entries:
        s = tok(tid)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        if lp is None:
            out["top_logprobs"].append(None)
        else:
            best: dict[str, float] = {}
            for t, v in top:  # most likely first: two ids with one text keep the likelier
                best.setdefault(tok(t), v)
            out["top_logprobs"].append(best)
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def _prompt_entries(prompt_ids: list[int], plps) -> list:
    """The engine's prompt logprobs (one entry per prompt token, None first) as
    ``_completion_logprobs`` entries, most likely first."""
    if plps is None or len(plps) != len(prompt_ids):
        raise APIError(500, "the engine returned no prompt logprobs for an echoed prompt "
                            f"({0 if plps is None else len(plps)} for {len(prompt_ids)} tokens)")
    out = []
    for tid, entry in zip(prompt_ids, plps):
        if entry is None:
            out.append((int(tid), None, None))
            continue
        items = sorted(((int(k), float(v.logprob)) for k, v in dict(entry).items()),
                       key=lambda kv: -kv[1])
        chosen = next((v for k, v in items if k == tid), float("nan"))
        out.append((int(tid), chosen, items))
    return out


def _echo_logprobs(tok: _Tokens, prompt_ids: list[int], plps, entries, prefix_len: int) -> dict:
    """``logprobs`` of an echoed choice: the prompt's tokens (offsets from 0, the first one's
    logprob None), then the completion's (offsets from the echoed text's length)."""
    head = _completion_logprobs(tok, _prompt_entries(prompt_ids, plps), 0)
    tail = _completion_logprobs(tok, entries, prefix_len)
    return {k: head[k] + tail[k] for k in head}


_NEG_INF_LOGPROB = -9999.0  # what vLLM sends for -inf (JSON has no infinity)


def _prompt_logprobs_json(plps) -> Optional[list]:
    """vLLM's ``prompt_logprobs`` field: per prompt position None or ``{"token_id":
    {"logprob", "rank", "decoded_token"}}`` (a -inf log-probability as -9999.0, as vLLM
    clamps it)."""
    if plps is None:
        return None
    return [None if e is None else
            {str(k): {"logprob": max(float(v.logprob), _NEG_INF_LOGPROB), "rank": v.rank,
                      "decoded_token": v.decoded_token} for k, v in dict(e).items()}
            for e in plps]


def _chat_logprobs(tok: _Tokens, entries, k: int) -> dict:
    content = []
    for tid, lp, top in entries:
        s = tok(tid)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": tok(t), "logprob": v,
                                          "bytes": list(tok(t).encode("utf-8"))}
                                         for t, v in top[:k]]})
    return {"content": content}


async def _collect(gen: Generation, request: Request) -> list[Delta]:
    """All deltas of a non-streaming request; a client that goes away aborts it."""
    deltas: list[Delta] = []

    async def consume():
        async for d in gen:
            deltas.append(d)

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                task.cancel()
                gen.abort()
                raise APIError(499, "the client closed the connection")
        task.result()
    finally:
        if not task.done():
            task.cancel()
    return deltas


def register(app: FastAPI, server) -> None:
    """Add the OpenAI routes to ``app`` (``server``: the app's :class:`~.app.Server`)."""

    def _model_card(name: str, f, now: int) -> dict:
        return {"id": name, "object": "model", "created": now, "owned_by": "xllm-vmm",
                "root": name, "parent": None, "max_model_len": f.max_model_len,
                "vocab_size": f.vocab_size}

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_key(request)
        now = int(time.time())
        return {"object": "list",
                "data": [_model_card(name, f, now) for name, f in server.fronts.items()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        """One model object (OpenAI's retrieve route; ids may hold ``/``, as HF names do)."""
        server.check_key(request)
        f = server.fronts.get(model_id)
        if f is None:
            raise APIError(404, f"the model {model_id!r} does not exist (served: "
                                f"{', '.join(server.fronts) or 'none'})", param="model",
                           code="model_not_found")
        return _model_card(model_id, f, int(time.time()))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        server.check_key(request)
        body: TokenizeRequest = await _body(request, TokenizeRequest)
        front = server.front_for(body.model)
        if body.messages is not None:
            _, ids = await _chat_prompt(front, [{"role": m.role, "content": m.text()}
                                                for m in body.messages],
                                        body.add_generation_prompt, fit=False)
        else:
            ids = await _encode(front, body.prompt or "")
        return {"tokens": ids, "count": len(ids), "max_model_len": front.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        server.check_key(request)
        body: DetokenizeRequest = await _body(request, DetokenizeRequest)
        front = server.front_for(body.model)
        vocab = front.vocab_size
        bad = [t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise APIError(400, f"token ids outside the vocabulary (0..{vocab - 1 if vocab else '?'}"
                                f"): {bad[:8]}", param="tokens")
        text = await asyncio.to_thread(front.tokenizer.decode, list(body.tokens))
        return {"prompt": text}

    @app.post("/v1/completions")
    async def completions(request: Request):
        received = time.monotonic()
        server.check_key(request)
        body: CompletionRequest = await _body(request, CompletionRequest)
        front = server.front_for(body.model)
        err = front.admission_error(body.n)
        if err is not None:
            raise err
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "prompt_logprobs are not available with stream=true (a "
                                "streamed echo with logprobs carries them in its first chunk)",
                           param="prompt_logprobs")
        prompts: list[list[int]] = []
        texts: list[str] = []
        for p in body.prompts():
            if isinstance(p, str):
                ids = await _encode_prompt(front, p)
                texts.append(p)
            else:
                ids = [int(t) for t in p]
                texts.append(await asyncio.to_thread(front.tokenizer.decode, ids)
                             if body.echo else "")
            prompts.append(ids)
        budgets = [_budget(front, len(ids), body, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
                   for ids in prompts]
        want_plps = body.engine_prompt_logprobs()
        kwargs = body.sampling_kwargs(max_tokens=min(budgets), logprobs=body.logprobs,
                                      prompt_logprobs=want_plps)
        rid = front.new_request_id("cmpl")
        gen = await front.generate(rid, prompts, kwargs, n=body.n, cache_salt=body.cache_salt,
                                   received=received)
        created = int(time.time())
        tok = _Tokens(front.tokenizer)

        def echo_text(index: int) -> str:
            return texts[index // body.n] if body.echo else ""

        def choice_logprobs(index: int, entries, plps, prefix_len: int) -> Optional[dict]:
            if body.logprobs is None:
                return None
            if body.echo:  # the echoed prompt's tokens first, as OpenAI's legacy completions
                return _echo_logprobs(tok, prompts[index // body.n], plps, entries, prefix_len)
            return _completion_logprobs(tok, entries, prefix_len)

        if body.stream:
            return StreamingResponse(
                _completion_stream(gen, body, front.name, rid, created, tok, echo_text,
                                   choice_logprobs),
                media_type="text/event-stream")
        deltas = await _collect(gen, request)
        n_choices = len(prompts) * body.n
        text, lps, final, completion_tokens, cached = _gather(deltas, n_choices)
        plps = {d.index: d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None}
        choices = []
        for i in range(n_choices):
            d = final.get(i)
            prefix = echo_text(i)
            choice = {
                "index": i, "text": prefix + text[i],
                "logprobs": choice_logprobs(i, lps[i], plps.get(i), len(prefix)),
                "finish_reason": d.finish_reason if d else None,
                "stop_reason": d.stop_reason if d else None}
            if want_plps is not None:
                choice["prompt_logprobs"] = _prompt_logprobs_json(plps.get(i))
            choices.append(choice)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": front.name, "choices": choices,
                             "usage": _usage(gen.num_prompt_tokens, completion_tokens, cached)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        received = time.monotonic()
        server.check_key(request)
        body: ChatCompletionRequest = await _body(request, ChatCompletionRequest)
        front = server.front_for(body.model)
        err = front.admission_error(body.n)
        if err is not None:
            raise err
        _, ids = await _chat_prompt(front, body.chat_messages(), body.add_generation_prompt)
        budget = _budget(front, len(ids), body, None, "messages")
        k = body.num_logprobs()
        kwargs = body.sampling_kwargs(max_tokens=budget, logprobs=k,
                                      prompt_logprobs=body.prompt_logprobs)
        rid = front.new_request_id("chatcmpl")
        gen = await front.generate(rid, [ids], kwargs, n=body.n, cache_salt=body.cache_salt,
                                   received=received)
        created = int(time.time())
        tok = _Tokens(front.tokenizer)
        if body.stream:
            return StreamingResponse(_chat_stream(gen, body, front.name, rid, created, tok, k),
                                     media_type="text/event-stream")
        deltas = await _collect(gen, request)
        text, lps, final, completion_tokens, cached = _gather(deltas, body.n)
        choices = []
        for i in range(body.n):
            d = final.get(i)
            choices.append({
                "index": i, "message": {"role": "assistant", "content": text[i]},
                "logprobs": _chat_logprobs(tok, lps[i], k) if k is not None else None,
                "finish_reason": d.finish_reason if d else None,
                "stop_reason": d.stop_reason if d else None})
        out = {"id": rid, "object": "chat.completion", "created": created, "model": front.name,
               "choices": choices,
               "usage": _usage(gen.num_prompt_tokens, completion_tokens, cached)}
        if body.prompt_logprobs is not None:  # vLLM's: one list for the (one) prompt
            out["prompt_logprobs"] = _prompt_logprobs_json(
                next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None))
        return JSONResponse(out)


async def _guarded(gen: Generation, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The SSE events of ``events``; an error mid-stream is one error event then [DONE]; a
    cancelled stream (client gone) aborts every choice."""
    try:
        async for e in events:
            yield e
    except APIError as err:
        yield _sse(err.body())
        yield _DONE
    finally:
        gen.abort()


def _completion_stream(gen: Generation, body: CompletionRequest, model: str, rid: str,
                       created: int, tok: _Tokens, echo_text, choice_logprobs
                       ) -> AsyncIterator[str]:
    """With ``echo`` the prompt's text comes first: in a chunk of its own before any token,
    or — with ``logprobs`` — in each choice's first token chunk, whose ``logprobs`` then start
    with the prompt's tokens (``choice_logprobs``)."""
    async def events():
        include_usage = body.include_usage()
        continuous = body.continuous_usage()
        completion_tokens = 0
        cached = 0
        offsets: dict[int, int] = {}

        def chunk(choices, usage=None) -> dict:
            c = {"id": rid, "object": "text_completion", "created": created, "model": model,
                 "choices": choices}
            if include_usage:
                c["usage"] = usage
            if continuous:
                c["usage"] = _usage(gen.num_prompt_tokens, completion_tokens)
            return c

        plain = None if continuous else _PlainChunks(rid, "text_completion", created, model,
                                                     include_usage)
        # echo + logprobs: each choice's prompt goes out with its first token chunk
        to_echo = set(range(len(gen.reqs))) if body.echo and body.logprobs is not None else set()
        plps: dict[int, list] = {}
        if body.echo and not to_echo:
            for i in range(len(gen.reqs)):
                prefix = echo_text(i)
                offsets[i] = len(prefix)
                yield _sse(chunk([{"index": i, "text": prefix, "logprobs": None,
                                   "finish_reason": None, "stop_reason": None}]))
        async for d in gen:
            t0 = time.perf_counter()  # no await until the event: its time is the loop's
            completion_tokens += len(d.token_ids)
            if d.prompt_logprobs is not None:
                plps[d.index] = d.prompt_logprobs
            if not (d.text or d.finished or d.token_ids):
                continue
            text, lp = d.text, None
            if d.index in to_echo:
                to_echo.discard(d.index)
                prefix = echo_text(d.index)
                text = prefix + d.text
                lp = choice_logprobs(d.index, d.logprobs or [], plps.pop(d.index, None),
                                     len(prefix))
                offsets[d.index] = len(prefix)
            elif body.logprobs is not None and d.logprobs:
                lp = _completion_logprobs(tok, d.logprobs, offsets.get(d.index, 0))
            offsets[d.index] = offsets.get(d.index, 0) + len(d.text)
            if d.finished:
                cached += d.num_cached_tokens
            if lp is None and plain is not None:
                event = plain.completion(d.index, text, d.finish_reason, d.stop_reason)
            else:
                event = _sse(chunk([{"index": d.index, "text": text, "logprobs": lp,
                                     "finish_reason": d.finish_reason,
                                     "stop_reason": d.stop_reason}]))
            gen.front.stream_busy_s += time.perf_counter() - t0
            gen.emitted(d)
            yield event
        if include_usage:
            final = {"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [], "usage": _usage(gen.num_prompt_tokens, completion_tokens,
                                                    cached)}
            yield _sse(final)
        yield _DONE

    return _guarded(gen, events())


def _chat_stream(gen: Generation, body: ChatCompletionRequest, model: str, rid: str,
                 created: int, tok: _Tokens, k: Optional[int]) -> AsyncIterator[str]:
    async def events():
        include_usage = body.include_usage()
        continuous = body.continuous_usage()
        completion_tokens = 0
        cached = 0

        def chunk(choices, usage=None) -> dict:
            c = {"id": rid, "object": "chat.completion.chunk", "created": created,
                 "model": model, "choices": choices}
            if include_usage:
                c["usage"] = usage
            if continuous:
                c["usage"] = _usage(gen.num_prompt_tokens, completion_tokens)
            return c

        deltas = gen.__aiter__()
        head: list[Delta] = []
        first_extra = {}
        if body.prompt_logprobs is not None:
            # the first chunk carries them: wait for the first delta (the engine's first
            # output of a request holds its prompt's list)
            try:
                head.append(await deltas.__anext__())
            except StopAsyncIteration:
                pass
            plps = next((d.prompt_logprobs for d in head if d.prompt_logprobs is not None), None)
            first_extra = {"prompt_logprobs": _prompt_logprobs_json(plps)}
        for i in range(body.n):
            c = chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}])
            if i == 0:
                c.update(first_extra)
            yield _sse(c)

        async def rest():
            for d in head:
                yield d
            async for d in deltas:
                yield d

        plain = None if continuous else _PlainChunks(rid, "chat.completion.chunk", created,
                                                     model, include_usage)
        async for d in (rest() if head else deltas):
            t0 = time.perf_counter()  # no await until the event: its time is the loop's
            completion_tokens += len(d.token_ids)
            if not (d.text or d.finished or d.token_ids):
                continue
            lp = _chat_logprobs(tok, d.logprobs, k) if k is not None and d.logprobs else None
            delta: dict[str, Union[str, None]] = {"content": d.text} if d.text or not d.finished \
                else {}
            if d.finished:
                cached += d.num_cached_tokens
            if lp is None and plain is not None:
                event = plain.chat(d.index, delta.get("content"), d.finish_reason,
                                   d.stop_reason)
            else:
                event = _sse(chunk([{"index": d.index, "delta": delta, "logprobs": lp,
                                     "finish_reason": d.finish_reason,
                                     "stop_reason": d.stop_reason}]))
            gen.front.stream_busy_s += time.perf_counter() - t0
            gen.emitted(d)
            yield event
        if include_usage:
            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [],
                        "usage": _usage(gen.num_prompt_tokens, completion_tokens, cached)})
        yield _DONE

    return _guarded(gen, events())
