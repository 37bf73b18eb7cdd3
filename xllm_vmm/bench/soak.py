"""``bench soak``: ``xllm-vmm serve`` on the demo model for a bounded time under a mixed load,
then the figures that say whether it stayed healthy.

The load (``concurrency`` asyncio workers on httpx, one request at a time each, seeded) mixes:

- good requests: completions and chat completions, streamed or not, a few with ``n=2``;
- bad requests, each of which must be a 4xx: a non-finite or boolean number, a seed out of
  range, a prompt past the context, an unknown model, a malformed body, a wrong type;
- clients that leave mid-stream (the connection closed after one to three events);
- and, on its own task, sleep/wake cycles through the admin routes (``/sleep?drain=true``,
  light and deep in turn, then ``/wake_up``): requests that arrive meanwhile get the
  documented 503; a drain that outlasts its 30 s (requests still running: the documented
  409, the engine stays awake) counts apart (``sleep_drain_timeouts``), not a failure.

Figures: counts by status and by kind, the slowest answer of each kind; every 5xx that is not the documented 503 (sleeping,
draining to sleep) with its body; answers of the wrong class (a good request refused, a bad one
served); the pool at the end (no live block, mapped KV at the prefix cache's packed floor and
0 once it is dropped, ``/metrics`` agreeing with ``/vmm/status``); the server's RSS at the end
of the warm-up and at the end, both measured idle (the load paused until nothing is in flight),
and their ratio; and the server's exit status after SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

from xllm_vmm.bench.serve import ServerProcess, parse_metric, rss_of

SERVE_ARGS = ("--model", "demo", "--enable-admin", "--device-memory=256MiB",
              "--enable_vmm_kvcache=true", "--vmm_elastic=true", "--enable_vmm_weights=true",
              "--drain-timeout=5")
"""The server under soak: the demo model, its KV cache and weights in an elastic VMM pool
(sleep and wake need the weights there)."""

DOCUMENTED_503 = ("sleeping", "draining to sleep", "shutting down")
"""Words of the 503s the docs name (docs/serving.md, "Errors and faults")."""


@dataclass
class SoakConfig:
    duration_s: float = 600.0
    concurrency: int = 8
    seed: int = 0
    warmup_fraction: float = 0.1
    """Share of the duration before the warm-up RSS is taken (at least 5 s)."""
    sleep_every_s: float = 15.0
    """Seconds between two sleep/wake cycles."""
    max_model_len: int = 1024

    def check(self) -> None:
        if not 5 <= self.duration_s <= 24 * 3600:
            raise ValueError(f"--seconds must be 5..86400, not {self.duration_s}")
        if not 1 <= self.concurrency <= 256:
            raise ValueError(f"--concurrency must be 1..256, not {self.concurrency}")
        if not 1 <= self.sleep_every_s <= 3600:
            raise ValueError(f"--sleep-every must be 1..3600 seconds, not {self.sleep_every_s}")


@dataclass
class _Tally:
    by_status: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    errors_5xx: list = field(default_factory=list)
    wrong_class: list = field(default_factory=list)
    stream_errors: list = field(default_factory=list)
    documented_503: int = 0
    disconnects: int = 0
    sleep_cycles: int = 0
    drain_timeouts: int = 0
    admin_failures: list = field(default_factory=list)
    slowest: dict = field(default_factory=dict)
    """kind -> seconds of its slowest answer."""

    def answer(self, kind: str, good: bool, status: int, body: str,
               seconds: float = 0.0) -> None:
        self.by_status[status] += 1
        self.by_kind[kind] += 1
        self.slowest[kind] = max(self.slowest.get(kind, 0.0), round(seconds, 2))
        if status >= 500:
            if status == 503 and any(w in body for w in DOCUMENTED_503):
                self.documented_503 += 1
            else:
                self.errors_5xx.append({"kind": kind, "status": status, "body": body[:500]})
            return
        if good and status not in (200, 429) or not good and not 400 <= status < 500:
            self.wrong_class.append({"kind": kind, "status": status, "body": body[:300]})


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 500) for _ in range(n)]


def _bad_bodies(max_len: int) -> list[tuple[str, Any]]:
    """(kind, body) of requests that must be refused with a 4xx; a str body is sent raw."""
    return [
        ("bad_nan", '{"prompt": "hi", "max_tokens": 4, "temperature": NaN}'),
        ("bad_seed", {"prompt": "hi", "max_tokens": 4, "seed": 2 ** 64}),
        ("bad_bool", {"prompt": "hi", "max_tokens": True}),
        ("bad_context", {"prompt": [7] * (max_len + 8), "max_tokens": 4}),
        ("bad_model", {"prompt": "hi", "max_tokens": 4, "model": "no-such-model"}),
        ("bad_json", '{"prompt": "hi", "max_tokens": '),
        ("bad_type", {"prompt": {"not": "a prompt"}, "max_tokens": 4}),
        ("bad_top_p", {"prompt": "hi", "max_tokens": 4, "top_p": 7}),
    ]


async def _request(c: httpx.AsyncClient, t: _Tally, rng: random.Random, max_len: int) -> None:
    t0 = time.monotonic()

    def answer(kind: str, good: bool, status: int, body: str) -> None:
        t.answer(kind, good, status, body, time.monotonic() - t0)

    roll = rng.random()
    if roll < 0.25:  # bad
        kind, body = rng.choice(_bad_bodies(max_len))
        kw = {"content": body, "headers": {"content-type": "application/json"}} \
            if isinstance(body, str) else {"json": body}
        r = await c.post("/v1/completions", **kw)
        answer(kind, False, r.status_code, r.text)
        return
    prompt = _prompt(rng, rng.randint(4, 200))
    max_tokens = rng.randint(1, 48)
    if roll < 0.40:  # a client that leaves mid-stream
        body = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
        leave_after = rng.randint(1, 3)
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                answer("disconnect", True, r.status_code, (await r.aread()).decode())
                return
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= leave_after:
                        break
        t.disconnects += 1
        answer("disconnect", True, 200, "")
        return
    chat = roll < 0.55
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": rng.choice([0, 0.7, 1.0]),
                            "seed": rng.randrange(2 ** 32)}
    if chat:
        body["messages"] = [{"role": "user", "content": " ".join(
            rng.choice(["hello", "cache", "page", "map", "pool", "token"])
            for _ in range(rng.randint(2, 30)))}]
    else:
        body["prompt"] = prompt
        if rng.random() < 0.1:
            body["n"] = 2
    stream = rng.random() < 0.5
    kind = ("chat" if chat else "completion") + ("_stream" if stream else "")
    if not stream:
        r = await c.post(path, json=body)
        answer(kind, True, r.status_code, r.text)
        return
    body["stream"] = True
    async with c.stream("POST", path, json=body) as r:
        text = (await r.aread()).decode()
    answer(kind, True, r.status_code, text if r.status_code != 200 else "")
    if r.status_code == 200:
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]" or any('"error"' in e for e in events):
            t.stream_errors.append({"kind": kind, "tail": events[-2:]})


async def _worker(c, t, rng, stop: asyncio.Event, gate: asyncio.Event, busy: list, max_len):
    while not stop.is_set():
        await gate.wait()
        if stop.is_set():
            return
        busy[0] += 1
        refused = t.by_status[503] + t.by_status[429]
        try:
            await _request(c, t, rng, max_len)
        except httpx.HTTPError as exc:
            t.wrong_class.append({"kind": "transport", "status": None, "body": repr(exc)[:300]})
        finally:
            busy[0] -= 1
        if t.by_status[503] + t.by_status[429] > refused:  # asleep or full: back off, as
            await asyncio.sleep(0.2)                       # a client that retries does


async def _sleeper(c: httpx.AsyncClient, t: _Tally, every: float, stop: asyncio.Event) -> None:
    level = 1
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except asyncio.TimeoutError:
            pass
        r = await c.post("/sleep", params={"level": level, "drain": "true", "timeout": 30})
        if r.status_code == 409 and "drain timed out" in r.text:
            t.drain_timeouts += 1  # the documented answer: requests ran past the timeout
        elif r.status_code != 200:
            st = (await c.get("/vmm/status")).json()
            t.admin_failures.append({"route": "sleep", "status": r.status_code,
                                     "body": r.text[:300], "in_flight": st.get("in_flight"),
                                     "running": st["stats"].get("num_requests_running")})
        await asyncio.sleep(0.5)
        w = await c.post("/wake_up")
        if w.status_code != 200:
            t.admin_failures.append({"route": "wake_up", "status": w.status_code,
                                     "body": w.text[:300]})
        t.sleep_cycles += 1
        level = 3 - level


async def _idle(c: httpx.AsyncClient, busy: list, timeout: float = 60.0) -> bool:
    """Wait until no worker has a request out and the server runs and queues none."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if busy[0] == 0:
            text = (await c.get("/metrics")).text
            if not (parse_metric(text, "vllm:num_requests_running") or 0) and \
                    not (parse_metric(text, "vllm:num_requests_waiting") or 0):
                return True
        await asyncio.sleep(0.05)
    return False


async def _pool(c: httpx.AsyncClient) -> dict:
    """The pool at rest: live blocks, mapped KV against its floor, /metrics against
    /vmm/status; then the same with the prefix cache dropped."""
    out: dict[str, Any] = {}
    for drop in (False, True):
        if drop:
            await c.post("/reset_prefix_cache")
        stats = (await c.get("/vmm/status")).json()["stats"]
        text = (await c.get("/metrics")).text
        kv = stats["kvcache"]
        sfx = "_after_reset" if drop else ""
        out[f"kv_live_blocks{sfx}"] = kv["live_blocks"]
        out[f"kv_mapped_bytes{sfx}"] = kv["mapped_bytes"]
        out[f"kv_floor_bytes{sfx}"] = kv["packed_floor_bytes"]
        out[f"metrics_agree{sfx}"] = (
            parse_metric(text, "xllm_vmm_mapped_bytes") == stats["pool"]["mapped_bytes"]
            and parse_metric(text, "xllm_vmm_kv_mapped_bytes") == kv["mapped_bytes"])
    out["pool_idle"] = (out["kv_live_blocks"] == 0 == out["kv_live_blocks_after_reset"]
                        and out["kv_mapped_bytes"] == out["kv_floor_bytes"]
                        and out["kv_mapped_bytes_after_reset"] == 0
                        and out["metrics_agree"] and out["metrics_agree_after_reset"])
    return out


async def _drive(url: str, pid: int, cfg: SoakConfig) -> dict:
    t = _Tally()
    stop, gate = asyncio.Event(), asyncio.Event()
    gate.set()
    busy = [0]
    limits = httpx.Limits(max_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        workers = [asyncio.create_task(_worker(c, t, random.Random(cfg.seed * 1000 + i), stop,
                                               gate, busy, cfg.max_model_len))
                   for i in range(cfg.concurrency)]
        sleeper = asyncio.create_task(_sleeper(c, t, cfg.sleep_every_s, stop))
        t0 = time.monotonic()
        warm = max(5.0, cfg.duration_s * cfg.warmup_fraction)
        await asyncio.sleep(warm)
        gate.clear()  # the warm-up RSS, idle: no request out, nothing running
        idle_warm = await _idle(c, busy)
        rss_warm = rss_of([pid])
        gate.set()
        await asyncio.sleep(max(0.0, cfg.duration_s - (time.monotonic() - t0)))
        stop.set()
        gate.set()
        await asyncio.gather(*workers, sleeper)
        await c.post("/wake_up")
        idle_end = await _idle(c, busy)
        rss_end = rss_of([pid])
        pool = await _pool(c)
        elapsed = time.monotonic() - t0
    requests = sum(t.by_status.values())
    return {
        "duration_s": round(elapsed, 1), "requests": requests,
        "requests_per_second": round(requests / elapsed, 2) if elapsed else 0.0,
        "by_status": dict(sorted(t.by_status.items())), "by_kind": dict(sorted(t.by_kind.items())),
        "documented_503": t.documented_503, "undocumented_5xx": len(t.errors_5xx),
        "errors_5xx": t.errors_5xx[:20], "wrong_class": len(t.wrong_class),
        "wrong_class_examples": t.wrong_class[:10], "stream_errors": len(t.stream_errors),
        "stream_error_examples": t.stream_errors[:5], "disconnects": t.disconnects,
        "sleep_cycles": t.sleep_cycles, "admin_failures": t.admin_failures[:10],
        "sleep_drain_timeouts": t.drain_timeouts, "slowest_s": dict(sorted(t.slowest.items())),
        "idle_at_warmup": idle_warm, "idle_at_end": idle_end,
        "rss_warm_bytes": rss_warm, "rss_end_bytes": rss_end,
        "rss_end_vs_warm_ratio": round(rss_end / rss_warm, 4) if rss_warm and rss_end else None,
        **pool,
    }


def run(cfg: SoakConfig, *, serve_args: Optional[list[str]] = None) -> dict:
    """Start ``xllm-vmm serve`` (:data:`SERVE_ARGS` plus ``serve_args``), soak it, stop it
    with SIGTERM; the figures (module docstring), ``exit_code`` and ``last_line`` of the
    server, and ``healthy``: no undocumented 5xx, no answer of the wrong class, no broken
    stream, every sleep/wake answered, the pool idle, RSS within 10 % of the warm-up's, exit 0."""
    cfg.check()
    args = [*SERVE_ARGS, f"--max-model-len={cfg.max_model_len}", *(serve_args or [])]
    srv = ServerProcess(args, start_timeout=300).start()
    try:
        assert srv.url is not None and srv.pid is not None
        out = asyncio.run(_drive(srv.url, srv.pid, cfg))
    finally:
        code = srv.stop()
    tail = [ln for ln in srv.log if ln.strip()]
    out["exit_code"] = code
    out["last_line"] = tail[-1] if tail else ""
    ratio = out["rss_end_vs_warm_ratio"]
    out["healthy"] = bool(out["undocumented_5xx"] == 0 and out["wrong_class"] == 0
                          and out["stream_errors"] == 0 and not out["admin_failures"]
                          and out["pool_idle"] and ratio is not None and ratio <= 1.10
                          and code == 0)
    return out


def flat(out: dict) -> dict:
    """The figures as one level (``by_status_200``...) for a table; lists as JSON text."""
    res: dict[str, Any] = {}
    for k, v in out.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                res[f"{k}_{kk}"] = vv
        elif isinstance(v, list):
            res[k] = json.dumps(v)[:400] if v else "none"
        else:
            res[k] = v
    return res
