"""``xllm-vmm bench serve``: start the server, drive a bounded loopback load, report latency,
throughput and the KV memory the pool mapped.

The load is ``vllm bench serve --dataset-name random``'s: ``num_prompts`` prompts of
``input_len`` ± ``range_ratio`` random token ids, each asking ``output_len`` tokens with
``ignore_eos`` (so every request produces exactly that many), streamed through
``/v1/completions``, arriving as a Poisson process of ``request_rate`` requests per second
(``inf``: all at once). The run is bounded: it stops after the last request or ``timeout``
seconds, whichever comes first (requests still open then count as failures).

Figures (names are the JSON fields; seconds are reported in milliseconds as ``*_ms``):
``output_throughput`` (output tokens / wall time of the load, tok/s), ``request_throughput``,
``ttft_ms_median``/``_p99`` (request sent → first token), ``tpot_ms_median``/``_p99`` ((e2e −
TTFT) / (output tokens − 1), per request), ``itl_ms_median``/``_p99`` (gap between two chunks
carrying tokens, divided by the tokens of the later chunk), ``failures``, ``completed``;
``kv_mapped_bytes_peak`` (the larger of ``xllm_vmm_tenant_mapped_bytes{tenant="kv"}`` sampled
every ``metrics_interval`` seconds (1) during the load and the server's own high-water mark
``xllm_vmm_kv_mapped_peak_bytes``, read after every engine step since it started — with
``url``, an earlier peak of that server counts too), ``kv_mapped_bytes_after`` (once no block is live
any more, waited for up to 5 s) beside ``kv_packed_floor_bytes_after`` (the least bytes the
blocks the prefix cache still keeps need: mapped KV at the floor means these two are close) and
``kv_live_blocks_after`` (0 when every request let go), ``kv_mapped_bytes_before``,
``reserved_virtual_bytes``; ``engine_steps``, ``engine_step_ms_mean`` and
``engine_busy_fraction`` (time inside ``LLMEngine.step()`` over the load's wall time, from
``xllm_vmm_engine_step_seconds``: near 1, the model is the bottleneck, not the HTTP path);
the server's own time beside it: ``output_thread_busy_fraction`` / ``_us_per_token``
(the output thread's CPU: detokenizing, stop strings, metrics, hand-off) and
``stream_encode_busy_fraction`` / ``_us_per_token`` (the event loop building and
JSON-encoding the SSE chunks, timed without awaits), over wall seconds or per output token, from
``xllm_vmm_output_thread_cpu_seconds``, ``xllm_vmm_stream_encode_seconds`` and
``xllm_vmm_output_tokens``;
against vLLM's server, its own stages from its ``/metrics`` (``vllm_queue_ms_mean``,
``vllm_prefill_ms_mean``, ``vllm_steps``: :func:`vllm_stage_figures`);
``arrival_span_s`` / ``send_span_s`` (first to last request: planned by the gaps, and as this
client sent them — well above the plan, the client fell behind; each request is sent at its
planned time, so one late send does not delay the rest), ``send_lag_ms_*`` and
``client_loop_lag_ms_*`` (median, p99, max: each send's lateness, the event loop's lateness
waking from 5 ms sleeps); CPU seconds over the load (:class:`_CostClock`: ``client_cpu_s``,
``client_wakeups`` (times this client blocked: each wake-up takes a core from the server),
``server_cpu_s`` and ``server_cpu_ms_per_output_token`` for the server's process tree,
``machine_cpu_s``, ``other_cpu_s``, ``machine_steal_s``, ``loadavg_start`` / ``_end``) and
ours' ``engine_step_cpu_ms_mean`` / ``engine_step_cpu_over_wall`` (the process's CPU during
its steps, ``xllm_vmm_engine_step_cpu_seconds``), ``engine_thread_cpu_over_wall`` (the engine
thread's own CPU over its steps' wall time) and ``engine_thread_runqueue_over_wall`` (the share
it was runnable but waited for a core, from Linux schedstat; None elsewhere) — 1 minus both is
the share it waited while not runnable (the interpreter lock, its compute threads);
``rss_bytes_peak`` (when the server's process id is known: the most resident bytes of its
process tree, every process's ``VmRSS`` summed, every ``sample_interval`` seconds — shared pages count
once per process, as ``ps`` shows them). One warm-up request (not counted) precedes the load.

Prompts are the same for every server given the same seed, ``vocab`` and context: token ids
are drawn in ``[4, vocab)`` (``vocab``: ``LoadConfig.vocab``, else the server's
``/v1/models`` ``vocab_size``, else 256) and lengths are capped by its ``max_model_len``.
``xllm_vmm.bench.serve_compare`` drives vLLM's server with this same load.

The server runs in its own process (``xllm-vmm serve --port 0``, its ready line read from
stdout) so that the load generator does not share its interpreter lock; ``url`` drives an
already running server instead. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from xllm_vmm.bench.proctree import (  # noqa: F401  (re-exported: the bench's process-tree figures)
    host_memory_used_bytes,
    machine_cpu_seconds,
    rss_of,
    signal_tree,
    tree_cpu_seconds,
    tree_pids,
    tree_rss_bytes,
)

READY_RE = re.compile(r"ready at (http://\S+)")


@dataclass
class LoadConfig:
    num_prompts: int = 64
    request_rate: float = 32.0
    input_len: int = 128
    range_ratio: float = 0.5
    output_len: int = 32
    seed: int = 0
    timeout: float = 300.0
    #: seconds between ``/metrics`` scrapes during the load (the KV peak; the server keeps its
    #: own high-water mark after every step, so a scrape only backs it up): each scrape costs
    #: the server's event loop a render (~20 ms under load) that delays every stream
    metrics_interval: float = 1.0
    #: seconds between RSS samples (``/proc`` reads on this side, and the per-worker scrapes
    #: of a worker set, whose peaks only scrapes see)
    sample_interval: float = 0.1
    api_key: Optional[str] = None
    vocab: Optional[int] = None  # token ids drawn below this (None: the server's vocab_size)

    def check(self) -> None:
        if not 1 <= self.num_prompts <= 100_000:
            raise ValueError(f"--num-prompts must be in 1..100000, got {self.num_prompts}")
        if not (self.request_rate > 0):
            raise ValueError(f"--request-rate must be > 0 (inf: all at once), got "
                             f"{self.request_rate}")
        if not 1 <= self.input_len <= 1 << 20:
            raise ValueError(f"--input-len must be in 1..1048576, got {self.input_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if not 1 <= self.output_len <= 1 << 20:
            raise ValueError(f"--output-len must be in 1..1048576, got {self.output_len}")
        if not 0 < self.timeout <= 86400:
            raise ValueError(f"--timeout must be in (0, 86400] seconds, got {self.timeout}")
        if self.vocab is not None and not 5 <= self.vocab <= 1 << 24:
            raise ValueError(f"vocab must be in 5..16777216 token ids, got {self.vocab}")


@dataclass
class _Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_load(coro):
    """Run the load's coroutine on a new event loop: the standard one, or uvloop's with
    ``XLLM_VMM_BENCH_LOOP=uvloop``. Not uvloop by default: a client parsing each stream in
    callbacks on uvloop used a quarter less CPU, yet in 7 of 8 interleaved loaded pairs the
    server it drove made fewer tokens/s (889-1,433 against 992-1,301) and got less of a core
    during its steps; a cheaper client can wake more often (one pair: 9,474 blocks against
    2,594; the count also moves with the machine's load, ``client_wakeups``), and on a 2-core
    machine each wake-up takes a core from the server's compute threads. The stream reader
    client of :func:`sse_post` is the one earlier figures were measured with."""
    factory = None
    if os.environ.get("XLLM_VMM_BENCH_LOOP", "").lower() == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def parse_metric(text: str, name: str, labels: dict[str, str] | None = None) -> Optional[float]:
    """Sum of the samples of ``name`` whose labels include ``labels`` in Prometheus text."""
    total = None
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        mname, _, lab = head.partition("{")
        if mname != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', lab))
        if labels and any(got.get(k) != v for k, v in labels.items()):
            continue
        total = (total or 0.0) + float(value)
    return total


def histogram_buckets(text: str, name: str, labels: dict[str, str] | None = None
                      ) -> list[tuple[float, float]]:
    """The cumulative buckets ``[(le, count), ...]`` (ascending ``le``, ``+Inf`` last) of the
    Prometheus histogram ``name`` (``name_bucket`` samples whose labels include ``labels``,
    summed over the other labels); empty when absent."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(f"{name}_bucket{{"):
            continue
        head, _, value = line.rpartition(" ")
        got = dict(re.findall(r'(\w+)="([^"]*)"', head.partition("{")[2]))
        if labels and any(got.get(k) != v for k, v in labels.items()):
            continue
        le = float(got.get("le", "inf"))
        out[le] = out.get(le, 0.0) + float(value)
    return sorted(out.items())


def histogram_quantile(before: list[tuple[float, float]], after: list[tuple[float, float]],
                       q: float) -> Optional[float]:
    """The ``q`` quantile (0..1) of what a histogram gained between two scrapes, by linear
    interpolation inside the bucket (Prometheus' ``histogram_quantile``; the first bucket
    from 0, a rank in ``+Inf`` answers the highest finite bound); None without samples."""
    base = dict(before)
    rows = [(le, c - base.get(le, 0.0)) for le, c in after]
    if not rows or rows[-1][1] <= 0:
        return None
    rank = q * rows[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in rows:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def server_latency_figures(before: str, after: str) -> dict:
    """``server_<stage>_us_median`` / ``_p99``: median and p99 in µs of each stage of the
    server's own latency (``xllm_vmm_server_latency_seconds{stage}``, the stages of
    ``server.metrics.SERVER_STAGES``) over what the load added between the scrapes ``before``
    and ``after`` (None where the server has none, e.g. vLLM's)."""
    from xllm_vmm.server.metrics import SERVER_STAGES  # the names' one home (no torch)

    out: dict = {}
    for stage in SERVER_STAGES:
        b = histogram_buckets(before, "xllm_vmm_server_latency_seconds", {"stage": stage})
        a = histogram_buckets(after, "xllm_vmm_server_latency_seconds", {"stage": stage})
        for tag, q in (("median", 0.5), ("p99", 0.99)):
            v = histogram_quantile(b, a, q)
            out[f"server_{stage}_us_{tag}"] = None if v is None else 1e6 * v
    return out


class _CostClock:
    """CPU clocks at construction; :meth:`since` gives what each used meanwhile: this
    process (``client_cpu_s``), the process tree of ``server_pid`` (``server_cpu_s``, None
    without a pid), the machine (``machine_cpu_s``, ``machine_steal_s``) and the rest
    (``other_cpu_s`` = machine - server - client), plus ``loadavg_start`` / ``_end``."""

    def __init__(self, server_pid: Optional[int]):
        self.pid = server_pid
        self.client = time.process_time()
        self.wakeups = _voluntary_switches()
        self.server = tree_cpu_seconds(server_pid) if server_pid is not None else None
        self.machine = machine_cpu_seconds()
        self.load = _loadavg()

    def since(self) -> dict:
        client = time.process_time() - self.client
        server = (tree_cpu_seconds(self.pid) if self.server is not None else None)
        server = server - self.server if server is not None and self.server is not None else None
        m = machine_cpu_seconds()
        busy = m[0] - self.machine[0] if m is not None and self.machine is not None else None
        steal = m[1] - self.machine[1] if m is not None and self.machine is not None else None
        other = (busy - client - server if busy is not None and server is not None else None)
        w = _voluntary_switches()
        return {"client_cpu_s": client, "client_wakeups": (w - self.wakeups if w is not None
                                                          and self.wakeups is not None
                                                          else None),
                "server_cpu_s": server, "machine_cpu_s": busy,
                "machine_steal_s": steal, "other_cpu_s": other,
                "loadavg_start": self.load, "loadavg_end": _loadavg()}


def _voluntary_switches() -> Optional[int]:
    """Times this process blocked so far (``getrusage``: voluntary context switches, every
    thread), None where it cannot be read."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw)
    except (ImportError, OSError):
        return None


def _loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


async def _loop_lag(done: asyncio.Event, out: list[float], period: float = 0.005) -> None:
    """Until ``done``: how late the event loop wakes from ``period``-second sleeps
    (seconds, appended to ``out``): the client's own lateness, which delays sends and the
    reading of every stream."""
    while not done.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        out.append(max(0.0, time.perf_counter() - t - period))


class _HTTPError(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:200]!r}")


async def sse_post(url: str, body: dict, headers: dict):
    """POST ``body`` as JSON to ``url`` (``http://host:port/path``, one connection, closed after)
    and yield the ``data:`` payload of every server-sent event as it arrives (``str``; the
    transfer's chunked or length framing undone). A status other than 200 raises with the
    start of the body. The load's client: httpx's streaming (h11 in Python, line decoding)
    cost ~125 µs of CPU per streamed chunk, more than the server spent on it, and on a 2-core
    machine that CPU is taken from the server being measured; this reads with asyncio's
    stream buffer and one ``find`` per event (what ``vllm bench serve``'s aiohttp client costs
    is of this order)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    payload = json.dumps(body).encode()
    head = [f"POST {u.path or '/'} HTTP/1.1", f"Host: {u.netloc}",
            "Content-Type: application/json", "Accept: text/event-stream",
            f"Content-Length: {len(payload)}", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items())]
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
        status = int((await reader.readline()).split(b" ", 2)[1])
        chunked, length = False, None
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "content-length":
                length = int(value)

        async def pieces():
            if chunked:
                while True:
                    size = int((await reader.readline()).split(b";", 1)[0], 16)
                    if size == 0:
                        return
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif length is not None:
                yield await reader.readexactly(length)
            else:
                while data := await reader.read(65536):
                    yield data

        if status != 200:
            raise _HTTPError(status, b"".join([p async for p in pieces()]))
        buf = b""
        async for piece in pieces():
            buf += piece.replace(b"\r\n", b"\n") if b"\r" in piece else piece
            while (end := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:end], buf[end + 2:]
                for ln in event.split(b"\n"):
                    if ln.startswith(b"data: "):
                        yield ln[6:].decode("utf-8")
    finally:
        writer.close()


async def _one(client, url: str, model: str, prompt: list[int], cfg: LoadConfig,
               headers: dict) -> _Result:
    res = _Result()
    body = {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    t0 = time.perf_counter()
    last = None
    try:
        async for data in sse_post(f"{url}/v1/completions", body, headers):
            if data == "[DONE]":
                break
            now = time.perf_counter()
            # a token chunk (compact JSON with a choice: both servers write it so; the
            # substring cannot occur inside a JSON string, whose quotes are escaped) needs
            # no parse; anything else is parsed
            if '"choices":[{' not in data or data.startswith('{"error"'):
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error event")
                    return res
                if chunk.get("usage") and not chunk.get("choices"):
                    res.output_tokens = int(chunk["usage"]["completion_tokens"])
                    continue
                if not chunk.get("choices"):
                    continue
            if last is None:
                res.ttft = now - t0
            else:
                res.itl.append(now - last)
            last = now
        res.e2e = time.perf_counter() - t0
        res.ok = res.output_tokens == cfg.output_len and last is not None
        if not res.ok and not res.error:
            res.error = f"{res.output_tokens} tokens instead of {cfg.output_len}"
    except Exception as exc:  # connection refused/reset, timeout: a failure, not a crash
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def make_load(cfg: LoadConfig, vocab: int, max_len: int
              ) -> tuple[list[list[int]], list[float], int]:
    """The load's prompts (token ids in ``[4, vocab)``, lengths ``input_len`` ± ``range_ratio``
    capped so that prompt + ``output_len`` fit ``max_len``), the gaps between arrivals
    (seconds; Poisson at ``request_rate``, 0 for ``inf``) and the shortest prompt length; the
    same for the same seed, vocabulary and context."""
    rng = random.Random(cfg.seed)
    lo = max(1, int(cfg.input_len * (1 - cfg.range_ratio)))
    hi = max(lo, int(cfg.input_len * (1 + cfg.range_ratio)))
    hi = min(hi, max_len - cfg.output_len - 1)
    if hi < 1 or lo > hi:
        raise ValueError(f"--input-len {cfg.input_len} + --output-len {cfg.output_len} do "
                         f"not fit the model's context of {max_len} tokens")
    low_id = min(4, vocab - 1)
    prompts = [[rng.randrange(low_id, vocab) for _ in range(rng.randint(lo, hi))]
               for _ in range(cfg.num_prompts)]
    gaps = [0.0 if math.isinf(cfg.request_rate) else rng.expovariate(cfg.request_rate)
            for _ in prompts]
    return prompts, gaps, lo


def latency_figures(ttft: list[float], tpot: list[float], itl: list[float]) -> dict:
    """Median and p99 of TTFT, TPOT and ITL (seconds in, milliseconds out)."""
    return {"ttft_ms_median": 1e3 * percentile(ttft, 50), "ttft_ms_p99": 1e3 * percentile(ttft, 99),
            "tpot_ms_median": 1e3 * percentile(tpot, 50), "tpot_ms_p99": 1e3 * percentile(tpot, 99),
            "itl_ms_median": 1e3 * percentile(itl, 50), "itl_ms_p99": 1e3 * percentile(itl, 99)}


async def _kv_mapped(client, url: str) -> Optional[float]:
    """The KV tenant's mapped bytes on the server's ``/metrics`` (None when it cannot be read)."""
    try:
        text = (await client.get(f"{url}/metrics")).text
    except Exception:
        return None
    return parse_metric(text, "xllm_vmm_tenant_mapped_bytes", {"tenant": "kv"})


class _PeakSampler:
    """While the load runs (:meth:`run` until ``done``): the highest KV mapped bytes, scraped
    every ``metrics_interval`` seconds, and the highest resident bytes of the process tree of
    ``rss_pid`` (None: not sampled), read every ``sample_interval`` seconds."""

    def __init__(self, client, url: str, cfg: LoadConfig, rss_pid: Optional[int],
                 kv_before: Optional[float]) -> None:
        self.client, self.url, self.cfg, self.rss_pid = client, url, cfg, rss_pid
        self.kv_peak = kv_before or 0.0
        self.rss_peak: Optional[int] = None
        # the tree's pids are listed again every 2 s only: listing scans every process of the
        # machine, ~15 % of this client's CPU when it ran every sample
        self._pids: list[int] = []
        self._listed_at = -math.inf

    def sample_rss(self) -> None:
        if self.rss_pid is None:
            return
        now = time.perf_counter()
        if now - self._listed_at >= 2.0:
            self._pids, self._listed_at = tree_pids(self.rss_pid), now
        v = rss_of(self._pids)
        if v is not None:
            self.rss_peak = max(self.rss_peak or 0, v)

    async def run(self, done: asyncio.Event) -> None:
        last = -math.inf
        while not done.is_set():
            if time.perf_counter() - last >= self.cfg.metrics_interval:
                last = time.perf_counter()
                v = await _kv_mapped(self.client, self.url)
                if v is not None:
                    self.kv_peak = max(self.kv_peak, v)
            self.sample_rss()
            await asyncio.sleep(self.cfg.sample_interval)


@dataclass
class _Sent:
    """What sending the load gave: every request's result, each send's lateness against its
    planned time, the send span, the load's wall time and the CPU it cost (:class:`_CostClock`)."""

    results: list[_Result]
    send_lags: list[float]
    send_span: float
    wall: float
    costs: dict


async def _send_load(client, url: str, model: str, prompts: list[list[int]], gaps: list[float],
                     cfg: LoadConfig, headers: dict, rss_pid: Optional[int]) -> _Sent:
    """Sends every prompt at its planned arrival and waits for the answers (``cfg.timeout``
    in all; requests still open then are cancelled and count as timed out)."""
    cost0 = _CostClock(rss_pid)
    t_start = time.perf_counter()
    tasks = []
    send_lags: list[float] = []
    due = 0.0
    for prompt, gap in zip(prompts, gaps):
        # on the planned arrival times (Poisson gaps summed from the start): a late send
        # does not delay the ones after it, so every server gets the same arrivals
        due += gap
        wait = t_start + due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        send_lags.append(time.perf_counter() - t_start - due)
        tasks.append(asyncio.create_task(_one(client, url, model, prompt, cfg, headers)))
    send_span = time.perf_counter() - t_start
    remaining = cfg.timeout - (time.perf_counter() - t_start)
    finished, pending = await asyncio.wait(tasks, timeout=max(0.0, remaining))
    for t in pending:
        t.cancel()
    wall = time.perf_counter() - t_start
    costs = cost0.since()
    results = [t.result() for t in finished if not t.cancelled()]
    results += [_Result(error="timed out") for _ in pending]
    return _Sent(results, send_lags, send_span, wall, costs)


async def _kv_after_load(client, url: str) -> tuple:
    """``(kv mapped bytes, packed floor bytes, live blocks)`` once no block is live any more
    (aborted and finishing requests let go), waited for up to 5 s."""
    async def idle_figures():
        text = (await client.get(f"{url}/metrics")).text
        return (parse_metric(text, "xllm_vmm_tenant_mapped_bytes", {"tenant": "kv"}),
                parse_metric(text, "xllm_vmm_kv_packed_floor_bytes"),
                parse_metric(text, "xllm_vmm_kv_live_blocks"))

    after, floor, live = await idle_figures()
    deadline = time.monotonic() + 5.0
    while live and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        after, floor, live = await idle_figures()
    return after, floor, live


def _step_counters(text: str) -> tuple[float, float]:
    """``(seconds, count)`` of ``xllm_vmm_engine_step_seconds`` (0 where absent)."""
    return (parse_metric(text, "xllm_vmm_engine_step_seconds_sum") or 0.0,
            parse_metric(text, "xllm_vmm_engine_step_seconds_count") or 0.0)


def _request_figures(cfg: LoadConfig, gaps: list[float], sent: _Sent,
                     loop_lags: list[float]) -> dict:
    """The client's side of :func:`drive`'s figures: completions, arrivals and sends, CPU,
    throughput and latency."""
    results, costs, wall, send_lags = sent.results, sent.costs, sent.wall, sent.send_lags
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    errors = sorted({r.error for r in results if not r.ok})[:5]
    return {
        "completed": len(ok), "failures": len(results) - len(ok), "errors": errors,
        "num_prompts": cfg.num_prompts,
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "input_len": cfg.input_len, "range_ratio": cfg.range_ratio,
        "output_len": cfg.output_len, "seed": cfg.seed, "duration_s": wall,
        # the arrivals as planned (the Poisson gaps) and as sent: a send span well above the
        # plan means this client fell behind, not the server
        "arrival_span_s": sum(gaps), "send_span_s": sent.send_span,
        # how late this client sent each request against its planned time, and how late its
        # event loop woke from a 5 ms sleep (its own load: parsing every stream's events)
        "send_lag_ms_median": 1e3 * percentile(send_lags, 50),
        "send_lag_ms_p99": 1e3 * percentile(send_lags, 99),
        "send_lag_ms_max": 1e3 * max(send_lags) if send_lags else None,
        "client_loop_lag_ms_median": 1e3 * percentile(loop_lags, 50) if loop_lags else None,
        "client_loop_lag_ms_p99": 1e3 * percentile(loop_lags, 99) if loop_lags else None,
        "client_loop_lag_ms_max": 1e3 * max(loop_lags) if loop_lags else None,
        # CPU seconds during the load (first send to last answer): this client's process, the
        # server's process tree, the whole machine (/proc/stat: every CPU's busy time) and
        # the rest of it (machine - server - client: other processes, the kernel's own
        # threads); the hypervisor's steal; the load average at the start and the end
        **costs,
        "server_cpu_ms_per_output_token": (1e3 * costs["server_cpu_s"] / out_tokens
                                           if costs.get("server_cpu_s") is not None
                                           and out_tokens else None),
        "output_throughput": out_tokens / wall if wall > 0 else 0.0,
        "request_throughput": len(ok) / wall if wall > 0 else 0.0,
        "total_output_tokens": out_tokens,
        **latency_figures(ttft, tpot, itl),
    }


def _engine_step_figures(step_s: float, steps: float, own: dict, wall: float) -> dict:
    """The engine's steps during the load: how many, their mean, the CPU they took and the
    share of the load's wall time they filled."""
    return {
        "engine_steps": int(steps), "engine_step_ms_mean": 1e3 * step_s / steps if steps else None,
        # the server process's CPU during its steps (every thread): per step, and over the
        # steps' wall time (below ~1 with 2 compute threads: the steps waited for the cores)
        "engine_step_cpu_ms_mean": (1e3 * own["step_cpu_s"] / steps
                                    if own["step_cpu_s"] is not None and steps else None),
        "engine_step_cpu_over_wall": (own["step_cpu_s"] / step_s
                                      if own["step_cpu_s"] is not None and step_s > 0
                                      else None),
        # the engine thread's own CPU over the steps' wall time (1 = it never waited)
        "engine_thread_cpu_over_wall": (own["step_thread_cpu_s"] / step_s
                                        if own.get("step_thread_cpu_s") is not None
                                        and step_s > 0 else None),
        # ... the share it was runnable but waited for a core (None without schedstat)
        "engine_thread_runqueue_over_wall": (own["step_runqueue_s"] / step_s
                                             if own.get("step_runqueue_s") is not None
                                             and step_s > 0 else None),
        "engine_busy_fraction": step_s / wall if wall > 0 else None,
    }


def _output_path_figures(own: dict, wall: float) -> dict:
    """The server's output thread and stream encoding: busy share of the load's wall time
    and microseconds per output token."""
    return {
        "output_thread_busy_fraction": (own["output_s"] / wall
                                        if own["output_s"] is not None and wall > 0 else None),
        "output_thread_us_per_token": (1e6 * own["output_s"] / own["tokens"]
                                       if own["output_s"] is not None and own["tokens"]
                                       else None),
        "stream_encode_busy_fraction": (own["stream_s"] / wall
                                        if own["stream_s"] is not None and wall > 0 else None),
        "stream_encode_us_per_token": (1e6 * own["stream_s"] / own["tokens"]
                                       if own["stream_s"] is not None and own["tokens"]
                                       else None),
    }


async def drive(url: str, cfg: LoadConfig, *, rss_pid: Optional[int] = None) -> dict:
    """Run the load against the server at ``url``; returns the figures (module docstring).
    ``rss_pid``: the server's process, whose tree's resident bytes are sampled."""
    import httpx

    cfg.check()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.num_prompts + 4,
                          max_keepalive_connections=cfg.num_prompts + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout), limits=limits) as client:
        models = (await client.get(f"{url}/v1/models", headers=headers)).json()["data"]
        model = models[0]["id"]
        vocab = int(cfg.vocab or models[0].get("vocab_size") or 256)
        max_len = int(models[0].get("max_model_len") or (cfg.input_len * 2 + cfg.output_len))
        prompts, gaps, lo = make_load(cfg, vocab, max_len)

        # One request first (not counted), as vllm bench serve does: the first step of a
        # fresh server pays one-time costs (allocator warm-up, lazy imports).
        warm = await asyncio.wait_for(
            _one(client, url, model, prompts[0][: max(1, lo)],
                 LoadConfig(output_len=min(cfg.output_len, 4)), headers), cfg.timeout)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        before = await _kv_mapped(client, url)
        reserved_text = (await client.get(f"{url}/metrics")).text
        reserved = parse_metric(reserved_text, "xllm_vmm_reserved_virtual_bytes")
        step_sum0, step_n0 = _step_counters(reserved_text)
        own0 = _own_costs(reserved_text)
        done = asyncio.Event()
        sampler = _PeakSampler(client, url, cfg, rss_pid, before)
        sampler_task = asyncio.create_task(sampler.run(done))
        workers: dict = {}  # a worker set: per-rank peaks, all-reduce per step
        wtask = (asyncio.create_task(_sample_workers(client, url, cfg, done, workers))
                 if "xllm_vmm_worker_mapped_bytes" in reserved_text else None)
        loop_lags: list[float] = []
        ticker = asyncio.create_task(_loop_lag(done, loop_lags))
        sent = await _send_load(client, url, model, prompts, gaps, cfg, headers, rss_pid)
        sampler.sample_rss()
        done.set()
        await sampler_task
        await ticker
        if wtask is not None:
            await wtask

        end_text = (await client.get(f"{url}/metrics")).text
        server_peak = parse_metric(end_text, "xllm_vmm_kv_mapped_peak_bytes")
        step_sum1, step_n1 = _step_counters(end_text)
        step_s, steps = step_sum1 - step_sum0, step_n1 - step_n0
        own = {k: (v - own0[k] if v is not None and own0[k] is not None else None)
               for k, v in _own_costs(end_text).items()}
        if server_peak is not None:  # the server's own high-water mark, read after every step
            sampler.kv_peak = max(sampler.kv_peak, server_peak)
        after, floor, live = await _kv_after_load(client, url)
    return {
        **_request_figures(cfg, gaps, sent, loop_lags),
        "kv_mapped_bytes_before": before, "kv_mapped_bytes_peak": sampler.kv_peak,
        "kv_mapped_bytes_after": after, "kv_packed_floor_bytes_after": floor,
        "kv_live_blocks_after": live, "reserved_virtual_bytes": reserved,
        **_engine_step_figures(step_s, steps, own, sent.wall),
        "rss_bytes_peak": sampler.rss_peak,
        **_output_path_figures(own, sent.wall),
        **server_latency_figures(reserved_text, end_text),
        **vllm_stage_figures(reserved_text, end_text),
        **workers,
    }


#: vLLM's own per-request stages (its /metrics histograms, seconds) -> bench field prefix:
#: ``queue`` (arrival in its engine core to first scheduled), ``prefill`` (first scheduled to
#: the first token), beside our ``server_pickup``/``server_queue`` and ``server_first_step``
VLLM_STAGES = (("vllm:request_queue_time_seconds", "vllm_queue"),
               ("vllm:request_prefill_time_seconds", "vllm_prefill"))


def vllm_stage_figures(before: str, after: str) -> dict:
    """``vllm_queue_ms_mean`` and ``vllm_prefill_ms_mean`` (what the load added to vLLM's
    histograms between two scrapes, sum / count: its buckets start at 0.3 s, too coarse for a
    median) and ``vllm_steps`` (its engine iterations, ``vllm:iteration_tokens_total_count``);
    empty for a server without them (ours)."""
    out: dict = {}
    for metric, field_ in VLLM_STAGES:
        n1 = parse_metric(after, f"{metric}_count")
        if n1 is None:
            continue
        n = n1 - (parse_metric(before, f"{metric}_count") or 0.0)
        s = (parse_metric(after, f"{metric}_sum") or 0.0) - (parse_metric(before, f"{metric}_sum")
                                                            or 0.0)
        out[f"{field_}_ms_mean"] = 1e3 * s / n if n > 0 else None
    steps = parse_metric(after, "vllm:iteration_tokens_total_count")
    if steps is not None:
        out["vllm_steps"] = int(steps - (parse_metric(before, "vllm:iteration_tokens_total_count")
                                         or 0.0))
    return out


def _own_costs(text: str) -> dict:
    """The server's own counters (``xllm_vmm_output_thread_cpu_seconds``, ``_output_tokens``,
    ``_stream_encode_seconds``; None where the server has none, e.g. vLLM's)."""
    return {"output_s": parse_metric(text, "xllm_vmm_output_thread_cpu_seconds_total"),
            "tokens": parse_metric(text, "xllm_vmm_output_tokens_total"),
            "stream_s": parse_metric(text, "xllm_vmm_stream_encode_seconds_total"),
            "step_cpu_s": parse_metric(text, "xllm_vmm_engine_step_cpu_seconds_total"),
            "step_thread_cpu_s": parse_metric(text,
                                              "xllm_vmm_engine_thread_step_cpu_seconds_total"),
            "step_runqueue_s": parse_metric(text,
                                            "xllm_vmm_engine_thread_runqueue_seconds_total")}


async def _sample_workers(client, url: str, cfg: LoadConfig, done: asyncio.Event,
                          out: dict) -> None:
    """Several workers (``serve --nnodes=N``): ``world_size``, ``worker_mapped_bytes_peak``
    and ``worker_kv_mapped_bytes_peak`` (rank -> highest sampled bytes during the load) and
    ``all_reduce_ms_per_step`` (rank 0's mean all-reduce time per engine step, at the end)."""
    peaks: dict[str, dict[str, float]] = {"mapped_bytes": {}, "kv_mapped_bytes": {}}
    text = ""
    while True:
        try:
            text = (await client.get(f"{url}/metrics")).text
        except Exception:
            text = ""
        for key, per in peaks.items():
            for line in text.splitlines():
                if line.startswith(f"xllm_vmm_worker_{key}{{"):
                    rank = dict(re.findall(r'(\w+)="([^"]*)"', line)).get("rank", "?")
                    per[rank] = max(per.get(rank, 0.0), float(line.rpartition(" ")[2]))
        if done.is_set():
            break
        await asyncio.sleep(cfg.sample_interval)
    out["world_size"] = len(peaks["mapped_bytes"])
    out["worker_mapped_bytes_peak"] = peaks["mapped_bytes"]
    out["worker_kv_mapped_bytes_peak"] = peaks["kv_mapped_bytes"]
    ar = parse_metric(text, "xllm_vmm_all_reduce_seconds_per_step")
    out["all_reduce_ms_per_step"] = None if ar is None else 1e3 * ar


class ServerProcess:
    """``xllm-vmm serve ARGS --port 0`` in a child process; ``url`` once its ready line came.
    Stopped with SIGTERM (graceful), SIGKILL after ``grace`` seconds.

    It runs in its own session, as ``vllm serve`` does in the comparison: with the kernel's
    autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) every session shares
    the CPU as one group, so a server in the load generator's session would split one share
    with its client while vLLM's got a share of its own (on a loaded machine ours got ~0.45
    of a core during its steps against vLLM's ~1)."""

    def __init__(self, serve_args: list[str], *, start_timeout: float = 600.0):
        self.args = [sys.executable, "-m", "xllm_vmm.cli", "serve", *serve_args]
        if not any(a == "--port" or a.startswith("--port=") for a in serve_args):
            self.args.append("--port=0")
        self.start_timeout = start_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        self.log: list[str] = []

    def start(self) -> "ServerProcess":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.append(line.rstrip("\n"))
            m = READY_RE.search(line)
            if m:
                self.url = m.group(1)
                return self
        self.stop()
        tail = "\n".join(self.log[-15:])
        raise RuntimeError(f"the server did not become ready (exit code {self.proc.returncode})"
                           f":\n{tail}")

    def stop(self, grace: float = 30.0) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            rest = self.proc.stdout.read()
            self.log.extend(rest.splitlines())
            self.proc.stdout.close()
        return self.proc.returncode

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run(cfg: LoadConfig, *, serve_args: list[str] | None = None, url: str | None = None) -> dict:
    """Drive ``url``, or start ``xllm-vmm serve serve_args`` and drive it; figures + where."""
    cfg.check()
    if url is not None:
        out = run_load(drive(url.rstrip("/"), cfg))
        out["server"] = url
        return out
    with ServerProcess(list(serve_args or [])) as srv:
        out = run_load(drive(srv.url, cfg, rss_pid=srv.pid))
        out["server"] = "xllm-vmm serve " + " ".join(serve_args or [])
        code = srv.stop()
    from xllm_vmm.engine.cpu_caps import caps
    from xllm_vmm.engine.paths import parse_paths_line

    out["cpu_model"] = caps().model
    out["compute_paths"] = next((p for p in map(parse_paths_line, srv.log) if p), None)
    out["server_exit_code"] = code
    return out


# What `bench serve` starts when not told otherwise: what an operator gets from `xllm-vmm serve`
# with the KV cache in an elastic VMM pool (mapped KV follows demand), 16-token blocks, an
# emulated 4 GiB device. The weights stay serve's default (plain tensors, not in the pool:
# `--enable_vmm_weights=false`): pool weights cannot be fused or oneDNN-packed, ~1.6x the
# matmul CPU at decode sizes; `--serve-arg=--enable_vmm_weights=true` measures them, and
# `--vllm-venv` runs that server too, beside the headline.
DEFAULT_SERVE_FLAGS = ("--enable_vmm_kvcache=true", "--vmm_elastic=true",
                       "--block_size=16", "--device-memory=4GiB")


def serve_args(model: Optional[str], extra: list[str], input_len: int, range_ratio: float,
               output_len: int) -> list[str]:
    """``xllm-vmm serve`` arguments: the model (default: ``bench engine``'s 4-layer,
    hidden-512 bf16 Llama, built on first use), :data:`DEFAULT_SERVE_FLAGS` for the flags
    ``extra`` does not set, a context that fits the longest request, then ``extra``."""
    if model is None:
        from xllm_vmm.bench.engine import bench_model_dir

        model = str(bench_model_dir(4, 512, "bfloat16"))
    given = {a.split("=", 1)[0].lstrip("-").replace("-", "_") for a in extra if a.startswith("-")}
    args = ["--model", model]
    for flag in DEFAULT_SERVE_FLAGS:
        if flag.split("=", 1)[0].lstrip("-").replace("-", "_") not in given:
            args.append(flag)
    if "max_model_len" not in given:
        longest = int(input_len * (1 + range_ratio)) + output_len + 1
        args.append(f"--max-model-len={max(longest, 64)}")
    return args + list(extra)
