"""The server's own latency: the engine thread never waits while a request is
waiting (no poll, no timeout: counted, not timed), step outputs leave the engine thread before
its bookkeeping, and ``xllm_vmm_server_latency_seconds{stage}`` is recorded for every stage and
turned into medians and p99s by ``bench serve``. Nothing here depends on wall-clock speed."""

from __future__ import annotations

import asyncio
import json
import math
import queue
import threading

import httpx
import pytest

from tests.server.conftest import FakeEngine
from xllm_vmm.bench import serve as bs
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app
from xllm_vmm.server.metrics import SERVER_LATENCY_BUCKETS, SERVER_STAGES


class _RecordingInbox:
    """The front's inbox, recording every ``get`` the engine thread makes: whether it could
    block, its timeout, and whether the engine had unfinished requests at that moment."""

    def __init__(self, engine):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.engine = engine
        self.gets: list[tuple[bool, object, bool]] = []
        self.lock = threading.Lock()

    def put(self, item):
        self.q.put(item)

    def get(self, block=True, timeout=None):
        with self.lock:
            self.gets.append((block, timeout, self.engine.has_unfinished_requests()))
        return self.q.get(block, timeout)

    def get_nowait(self):
        return self.get(False)


def _stream(url: str, prompt: list[int], n_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": n_tokens, "stream": True, "ignore_eos": True}
    got = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += bool(json.loads(line[6:])["choices"])
    return got


def test_engine_loop_never_waits_while_work_is_waiting(tokenizer):
    eng = FakeEngine(tokenizer, max_model_len=512)
    front = AsyncEngine(eng)
    inbox = front._inbox = _RecordingInbox(eng)
    app = build_app(front, ServerSettings())
    with RunningServer(app) as srv:
        # one at a time: the engine goes idle between them
        for k in range(3):
            assert _stream(srv.url, [5 + k, 6, 7], 5) == 5

        async def many():
            async with httpx.AsyncClient(timeout=60) as c:
                async def one(i):
                    r = await c.post(f"{srv.url}/v1/completions",
                                     json={"prompt": [9, i + 1], "max_tokens": 4})
                    return r.status_code
                return await asyncio.gather(*(one(i) for i in range(8)))

        assert asyncio.run(many()) == [200] * 8
        steps = front.steps
    blocking = [g for g in inbox.gets if g[0]]
    # every wait that could block happened while the engine had nothing to compute, and
    # none has a timeout (no poll: a put wakes it)
    assert blocking and all(not busy for _, _, busy in blocking)
    assert all(timeout is None for _, timeout, _ in blocking)
    assert front.idle_waits == len(blocking)
    # while busy the loop only takes what is there (requests arrived mid-run: it did)
    assert any(not block and busy for block, _, busy in inbox.gets)
    # the engine stepped exactly as often as it had tokens to make when requests ran alone:
    # 3 x 5 tokens sequentially, then 8 x 4 tokens together (one token per request per step)
    assert 3 * 5 + 4 <= steps <= 3 * 5 + 8 * 4


def test_step_outputs_leave_before_the_bookkeeping(tokenizer):
    """The output thread has a step's outputs before the engine thread reads its statistics
    for the step (``num_waiting``), observed by order, not by time."""
    order: list[str] = []

    class Eng(FakeEngine):
        @property
        def num_waiting(self):
            order.append("bookkeeping")
            return 0

    class Outbox:
        def __init__(self):
            self.q = queue.SimpleQueue()

        def put(self, item):
            if item[0] == "outs":
                order.append("outs")
            self.q.put(item)

        def get(self, *a, **kw):
            return self.q.get(*a, **kw)

    eng = Eng(tokenizer, max_model_len=512)
    front = AsyncEngine(eng)
    front._outbox = Outbox()
    with RunningServer(build_app(front, ServerSettings())) as srv:
        assert _stream(srv.url, [4, 5], 3) == 3
    steps = [i for i, x in enumerate(order) if x == "outs"]
    assert len(steps) == 3
    for i in steps:
        assert order[i + 1] == "bookkeeping"


def test_every_stage_is_recorded_and_bench_reads_it(tokenizer):
    eng = FakeEngine(tokenizer, max_model_len=512)
    with RunningServer(build_app(AsyncEngine(eng), ServerSettings())) as srv:
        before = httpx.get(f"{srv.url}/metrics", timeout=30).text
        for k in range(4):
            assert _stream(srv.url, [4 + k, 5], 3) == 3
        after = httpx.get(f"{srv.url}/metrics", timeout=30).text
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [4], "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200
        last = httpx.get(f"{srv.url}/metrics", timeout=30).text
    for stage in SERVER_STAGES:
        labels = {"stage": stage, "model_name": "fake-model"}
        n0 = bs.parse_metric(before, "xllm_vmm_server_latency_seconds_count", labels) or 0
        n1 = bs.parse_metric(after, "xllm_vmm_server_latency_seconds_count", labels)
        # per request: admit, pickup, add, queue, first_step, overhead, ttft; per streamed
        # token chunk: handoff, emit
        want = 4 * 3 if stage in ("handoff", "emit") else 4
        assert n1 - n0 == want, stage
    figs = bs.server_latency_figures(before, after)
    assert set(figs) == {f"server_{s}_us_{t}" for s in SERVER_STAGES for t in ("median", "p99")}
    for k, v in figs.items():
        assert v is not None and 0 <= v <= 1e7, k
    for s in SERVER_STAGES:
        assert figs[f"server_{s}_us_p99"] >= figs[f"server_{s}_us_median"]
    # a non-streamed request: admit, pickup, add, queue and first_step, no emit (nothing is
    # streamed)
    for stage, extra in (("admit", 1), ("add", 1), ("queue", 1), ("first_step", 1),
                         ("emit", 0), ("overhead", 0), ("ttft", 0)):
        labels = {"stage": stage}
        assert (bs.parse_metric(last, "xllm_vmm_server_latency_seconds_count", labels)
                - bs.parse_metric(after, "xllm_vmm_server_latency_seconds_count", labels)
                == extra), stage


def _hist(samples: list[float]) -> list[tuple[float, float]]:
    bounds = [*SERVER_LATENCY_BUCKETS, math.inf]
    return [(b, float(sum(s <= b for s in samples))) for b in bounds]


def test_histogram_quantile_interpolates_like_prometheus():
    before = _hist([0.5] * 10)          # what was there before the load: subtracted
    load = [0.0012] * 50 + [0.003] * 49 + [0.02]
    after = _hist([0.5] * 10 + load)
    med = bs.histogram_quantile(before, after, 0.5)
    assert 0.001 <= med <= 0.00158      # inside the bucket holding the median sample
    p99 = bs.histogram_quantile(before, after, 0.99)
    assert 0.00251 <= p99 <= 0.00398
    assert bs.histogram_quantile(before, after, 1.0) <= 0.0251
    assert bs.histogram_quantile(after, after, 0.5) is None      # nothing added
    assert bs.histogram_quantile([], [], 0.5) is None
    over = _hist([100.0])                # past the last bound: the highest finite bound
    assert bs.histogram_quantile([], over, 0.5) == SERVER_LATENCY_BUCKETS[-1]


def test_buckets_cover_tens_of_microseconds_to_seconds():
    b = SERVER_LATENCY_BUCKETS
    assert b[0] == pytest.approx(1e-5) and b[-1] == pytest.approx(10.0)
    ratios = [y / x for x, y in zip(b, b[1:])]
    assert all(1.5 < r < 1.7 for r in ratios)  # five per decade


def test_event_loop_choice(monkeypatch):
    """uvloop when installed (as vLLM's server runs), asyncio's loop on request; a bad value
    is an error naming the variable."""
    from xllm_vmm.server import launch

    monkeypatch.setenv(launch.EVENT_LOOP_ENV, "asyncio")
    assert launch.loop_factory() is None
    monkeypatch.setenv(launch.EVENT_LOOP_ENV, "bogus")
    with pytest.raises(ValueError, match=launch.EVENT_LOOP_ENV):
        launch.loop_factory()
    monkeypatch.delenv(launch.EVENT_LOOP_ENV)
    try:
        import uvloop
    except ImportError:
        assert launch.loop_factory() is None
        monkeypatch.setenv(launch.EVENT_LOOP_ENV, "uvloop")
        with pytest.raises(ValueError, match="not installed"):
            launch.loop_factory()
    else:
        assert launch.loop_factory() is uvloop.new_event_loop

        async def kind():
            return type(asyncio.get_running_loop()).__module__

        assert launch.run_loop(kind()).startswith("uvloop")


@pytest.mark.parametrize("include_usage", [False, True])
def test_plain_chunks_are_the_json_chunks_byte_for_byte(include_usage):
    """The streamed chunk written from a precomputed head equals ``json.dumps`` of the chunk
    (the shape every client parses), for awkward text and every finish/stop reason."""
    from xllm_vmm.server.openai_routes import _PlainChunks, _sse

    texts = ["", "a", 'quo"te', "back\\slash", "new\nline\ttab", "é漢字🙂", "\x00\x1f\u2028",
             "</script>"]
    ends = [(None, None), ("length", None), ("stop", "###"), ("stop", 7), ("abort", None),
            ("stop", 'a"b')]
    for obj in ("text_completion", "chat.completion.chunk"):
        w = _PlainChunks('cmpl-1-"x"', obj, 1700000000, "mödel/ä", include_usage)
        for index in (0, 3):
            for text in texts:
                for fr, sr in ends:
                    c = {"id": 'cmpl-1-"x"', "object": obj, "created": 1700000000,
                         "model": "mödel/ä"}
                    if obj == "text_completion":
                        c["choices"] = [{"index": index, "text": text, "logprobs": None,
                                         "finish_reason": fr, "stop_reason": sr}]
                        got = w.completion(index, text, fr, sr)
                    else:
                        content = None if (fr and not text) else text
                        delta = {} if content is None else {"content": content}
                        c["choices"] = [{"index": index, "delta": delta, "logprobs": None,
                                         "finish_reason": fr, "stop_reason": sr}]
                        got = w.chat(index, content, fr, sr)
                    if include_usage:
                        c["usage"] = None
                    assert got == _sse(c)
                    json.loads(got[6:])


def test_ttft_is_the_sum_of_its_stages(tokenizer):
    """Per streamed request the stamps chain: admit + pickup + add + queue + first_step + the
    first token's emit equals the server-side ``ttft`` (one clock, nothing left out), and
    ``first_step`` is one step's duration, never longer than the ``ttft``."""
    from xllm_vmm.server.metrics import Metrics

    seen: dict[str, list[float]] = {}

    class Recording(Metrics):
        def observe_server(self, model, stage, seconds):
            seen.setdefault(stage, []).append(seconds)
            super().observe_server(model, stage, seconds)

    eng = FakeEngine(tokenizer, max_model_len=512)
    front = AsyncEngine(eng, metrics=Recording())
    with RunningServer(build_app(front, ServerSettings())) as srv:
        for k in range(3):  # one at a time: the samples of request i are at index i
            assert _stream(srv.url, [7 + k, 5], 3) == 3
    parts = ("admit", "pickup", "add", "queue", "first_step")
    assert all(len(seen[s]) == 3 for s in (*parts, "ttft", "overhead"))
    for i in range(3):
        first_emit = seen["emit"][3 * i]  # the first of its three token chunks
        total = sum(seen[s][i] for s in parts) + first_emit
        assert total == pytest.approx(seen["ttft"][i], abs=1e-6)
        assert all(seen[s][i] >= 0 for s in parts)
        assert seen["first_step"][i] <= seen["ttft"][i]
