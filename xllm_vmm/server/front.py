"""``AsyncEngine``: the asynchronous front of one :class:`~xllm_vmm.engine.LLMEngine`.

Threads and who owns what (the HTTP event loop never waits on model execution):

- **engine thread** (one per engine): the only code that touches the engine. It drains an inbox
  (adds, aborts, commands such as sleep or stats) between steps without waiting, runs
  ``engine.step()`` while requests are unfinished and blocks on the inbox otherwise (no
  timeout, no poll: a put wakes it). Its step outputs go to the output thread untouched, the
  moment the step returns (its own bookkeeping comes after).
- **output thread**: incremental detokenization through the engine's ``OutputProcessor`` (no
  broken multi-byte characters), stop strings (a hit aborts the request in the engine: its
  blocks are freed), latency metrics; each result goes to the request's ``asyncio.Queue`` with
  ``loop.call_soon_threadsafe``.
- **event loop** (the HTTP server): tokenization happens in a worker thread
  (``asyncio.to_thread``) before a request enters the inbox; routes only await queues and
  futures.

Invariants:

1. Every request that entered ``generate`` ends with exactly one final delta (finished, aborted
   or failed) or with its abort when the consumer goes away (client disconnect), and leaves
   ``_streams``; nothing is lost and no blocks stay behind (an abort frees them in the engine).
2. Admission limits are counted at the front: ``max_waiting`` bounds requests queued but not yet
   running in the engine (the inbox + ``engine.num_waiting``), ``max_concurrent`` bounds
   requests in flight. Over a limit the request is refused before anything is queued (429/503).
3. While the engine sleeps, drains for a sleep, or shuts down, new requests are refused with 503;
   sleep without ``drain`` is refused (409) while any request is in flight.

The server's own latency (``xllm_vmm_server_latency_seconds{stage}``, monotonic seconds):
``admit`` (the HTTP request's arrival to its inbox entry: body, validation, tokenization),
``pickup`` (inbox to the engine thread taking it: the step in progress, engine-bound),
``add`` (``engine.add_request``), ``queue`` (added to the start of the step that made its first
token: the step in progress and any step that did not finish its prefill; engine-bound),
``first_step`` (that step's duration: its prefill beside the running decodes; engine-bound),
per streamed chunk ``handoff`` (the step's end to the delta on the event loop: output thread,
wake-up) and ``emit`` (the step's end to the SSE event written), and per streamed request
``overhead`` = admit + add + the first token's emit (what the server adds to TTFT beyond
waiting for and running engine steps) and ``ttft`` (arrival to the first token's SSE event:
the server's view of TTFT, = admit + pickup + add + queue + first_step + the first emit).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from xllm_vmm.server.errors import APIError
from xllm_vmm.server.sched_clock import SchedClock

log = logging.getLogger("xllm_vmm.server")


@dataclass
class Delta:
    """What one request gained since the last delta. ``text`` is new, complete UTF-8 text;
    ``logprobs``, when asked for, holds one entry per new token: ``(token_id, logprob,
    [(top_id, top_logprob), ...])``. ``prompt_logprobs``, on the first delta of a request that
    asked for them (``SamplingParams.prompt_logprobs``), is the engine's list as it gave it:
    one entry per prompt token, None for position 0, else ``{token_id: Logprob}``. A final
    delta has ``finished`` set; ``error`` is an :class:`APIError` when the request failed
    instead."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[tuple[int, float, list[tuple[int, float]]]]] = None
    finished: bool = False
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: Optional[APIError] = None
    prompt_logprobs: Optional[list] = None
    #: monotonic seconds: the step that produced it returned (0: not from a step); the event
    #: loop received it (0: not yet)
    step_time: float = 0.0
    loop_time: float = 0.0


class _Req:
    """Front-side state of one engine request (one choice of a client request)."""

    __slots__ = ("rid", "index", "prompt_ids", "params", "queue", "loop", "arrival",
                 "first_token", "last_token", "n_out", "done", "accepted", "cache_salt",
                 "t_queued", "t_picked", "t_added", "emitted")

    def __init__(self, rid, index, prompt_ids, params, q, loop, accepted, cache_salt=None,
                 arrival=None):
        self.rid = rid
        self.cache_salt = cache_salt
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.queue = q
        self.loop = loop
        #: monotonic seconds: the HTTP request arrived (else this object was made), entered
        #: the inbox, was taken by the engine thread, was added to the engine
        self.arrival = time.monotonic() if arrival is None else arrival
        self.t_queued = self.t_picked = self.t_added = 0.0
        self.emitted = False  # its first token's SSE event was written
        self.first_token: Optional[float] = None
        self.last_token: Optional[float] = None
        self.n_out = 0
        self.done = False
        self.accepted = accepted


_STOP = object()


class AsyncEngine:
    """Serve one engine to many coroutines. See the module docstring for the threads.

    ``engine`` has the contract-section-4 API (``add_request``, ``abort_request``, ``step``,
    ``has_unfinished_requests``, ``num_running``, ``num_waiting``, ``stats``, ``sleep``,
    ``wake_up``, ``is_sleeping``, ``reset_prefix_cache``, ``fork``, ``shutdown``, ``tokenizer``,
    ``model_name``, ``max_model_len``). ``make_params`` builds the engine's ``SamplingParams``
    from vLLM keyword arguments (default: the engine package's class); ``output_processor`` the
    engine's ``OutputProcessor`` over the tokenizer (default: the engine package's).
    ``metrics`` (optional) receives ``observe_*`` calls from the output thread.
    """

    def __init__(self, engine, *, name: Optional[str] = None, max_waiting: Optional[int] = None,
                 max_concurrent: Optional[int] = None, make_params: Optional[Callable] = None,
                 output_processor: Any = None, metrics: Any = None):
        self.engine = engine
        self.name = name or engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        self.max_waiting = max_waiting
        self.max_concurrent = max_concurrent
        if make_params is None:
            from xllm_vmm.engine import SamplingParams as make_params  # noqa: N813
        self.make_params = make_params
        if output_processor is None:
            from xllm_vmm.engine import OutputProcessor

            output_processor = OutputProcessor(self.tokenizer)
        self.processor = output_processor
        self.metrics = metrics
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._outbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._streams: dict[str, _Req] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending_adds = 0            # in the inbox, not yet added to the engine
        self._num_waiting = 0             # engine.num_waiting after the last step
        self._num_running = 0
        self._sleeping = bool(engine.is_sleeping())
        #: the level the engine sleeps at (None while awake or when it was asleep at start)
        self._sleep_level: Optional[int] = None
        self._draining = False
        self._closing = False
        self._shut = False  # engine.shutdown() called
        self._hurry = False  # a second signal: drain() cancels at once
        self._engine_error: Optional[str] = None
        self._engine_thread: Optional[threading.Thread] = None
        self._output_thread: Optional[threading.Thread] = None
        self.steps = 0
        #: the engine thread's blocking inbox waits (each ends with an item: no timeout)
        self.idle_waits = 0
        #: CPU seconds (``time.thread_time``: waits for the interpreter lock or the kernel
        #: not counted) the output thread spent on step outputs (detokenizing, stop strings,
        #: metrics, hand-off to the event loop) and the tokens it handled; seconds the event
        #: loop spent building and encoding SSE chunks (``openai_routes``; ``perf_counter``
        #: over a section without awaits: ``thread_time`` is a system call, and two per
        #: streamed chunk cost more than the encoding under load): the server's own cost
        #: beside the engine's step (``xllm_vmm_output_thread_cpu_seconds``,
        #: ``xllm_vmm_stream_encode_seconds``, ``xllm_vmm_output_tokens``)
        self.output_busy_s = 0.0
        self.output_tokens = 0
        self.stream_busy_s = 0.0
        #: the process's CPU seconds (``time.process_time``: every thread, the engine's OpenMP
        #: workers and the server's own threads meanwhile) summed over the engine steps
        #: (``xllm_vmm_engine_step_cpu_seconds``): beside the steps' wall time it tells a step
        #: that computed more from one that waited (another process had the cores)
        self.step_cpu_s = 0.0
        self.step_thread_cpu_s = 0.0
        self.step_runqueue_s: float | None = None  # None: no schedstat here (sched_clock)
        self._kv_cache = getattr(getattr(engine, "kv_cache_manager", None), "cache", None)
        self.kv_mapped_peak_bytes: Optional[int] = 0 if self._kv_cache is not None else None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncEngine":
        if self._engine_thread is None:
            self._engine_thread = threading.Thread(target=self._engine_loop,
                                                   name=f"engine[{self.name}]", daemon=True)
            self._output_thread = threading.Thread(target=self._output_loop,
                                                   name=f"output[{self.name}]", daemon=True)
            self._engine_thread.start()
            self._output_thread.start()
        return self

    @property
    def vocab_size(self) -> Optional[int]:
        """Token ids valid in prompts: below both the model's and the tokenizer's vocabulary."""
        sizes = [v for v in (getattr(self.engine, "vocab_size", None),
                             getattr(self.tokenizer, "vocab_size", None)) if v]
        return min(int(v) for v in sizes) if sizes else None

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def sleeping(self) -> bool:
        return self._sleeping

    def availability_error(self) -> Optional[APIError]:
        """The 503 a new request gets now, or None when requests are accepted."""
        if self._closing:
            return APIError(503, "the server is shutting down; retry on another instance")
        if self._sleeping:
            return APIError(503, f"model {self.name!r} is sleeping (its KV cache and weights are "
                                 "released); POST /wakeup first")
        if self._draining:
            return APIError(503, f"model {self.name!r} is draining to sleep; retry after "
                                 "POST /wakeup")
        if self._engine_error is not None:
            return APIError(503, f"the engine failed and cannot serve: {self._engine_error}")
        return None

    def mark_failed(self, message: str) -> None:
        """The engine cannot serve any more (a lost worker of a worker set):
        ``/health`` and every new request get 503 with ``message``; the engine thread stops
        stepping. Thread-safe."""
        self._engine_error = message

    def admission_error(self, n: int) -> Optional[APIError]:
        err = self.availability_error()
        if err is not None:
            return err
        with self._lock:
            in_flight = len(self._streams)
            waiting = self._pending_adds + self._num_waiting
        if self.max_concurrent is not None and in_flight + n > self.max_concurrent:
            return APIError(503, f"the server is at max_concurrent_requests="
                                 f"{self.max_concurrent} ({in_flight} in flight); retry later")
        if self.max_waiting is not None and waiting + n > self.max_waiting:
            return APIError(429, f"the waiting queue is full ({waiting} waiting, "
                                 f"--max-waiting-requests {self.max_waiting}); retry later")
        return None

    # ------------------------------------------------------------------ generation
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids):x}-{int(time.time() * 1000) & 0xffffffff:08x}"

    async def generate(self, request_id: str, prompts: list[list[int]], params_kwargs: dict,
                       n: int = 1, cache_salt: Optional[str] = None,
                       received: Optional[float] = None) -> "Generation":
        """Submit ``n`` choices of each prompt (choice index ``p * n + i``); returns once the
        engine accepted every one (or raises the :class:`APIError` it refused them with: a 400
        naming the parameter, a 503/429 at the limits; then nothing stays queued). Iterate the
        returned :class:`Generation` for the deltas of every choice, in arrival order.
        ``cache_salt`` goes to every choice's ``engine.add_request`` (vLLM's field: requests
        with different salts never share prefix-cache blocks). ``received``: when the HTTP
        request arrived (``time.monotonic()``; default now), the start of its TTFT and of the
        server's ``admit`` latency."""
        err = self.admission_error(n * len(prompts))
        if err is not None:
            raise err
        base = self._params(params_kwargs)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        reqs = []
        single = n == 1 and len(prompts) == 1
        for p, prompt_ids in enumerate(prompts):
            for i in range(n):
                params = base if n == 1 else self._sibling(base, i)
                index = p * n + i
                rid = request_id if single else f"{request_id}-{index}"
                accepted: concurrent.futures.Future = concurrent.futures.Future()
                reqs.append(_Req(rid, index, list(prompt_ids), params, q, loop, accepted,
                                 cache_salt, received))
        with self._lock:
            for r in reqs:
                self._streams[r.rid] = r
            self._pending_adds += len(reqs)
        now = time.monotonic()
        for r in reqs:
            r.t_queued = now
            self._inbox.put(("add", r))
        if self.metrics is not None:
            self.metrics.observe_server(self.name, "admit", now - reqs[0].arrival)
        gen = Generation(self, reqs, q, [len(x) for x in prompts])
        try:
            for r in reqs:
                await asyncio.wrap_future(r.accepted)
        except BaseException:
            gen.abort()
            raise
        return gen

    def _params(self, kwargs: dict):
        try:
            return self.make_params(**kwargs)
        except APIError:
            raise
        except Exception as exc:  # RequestError(param=..., message=...) or a TypeError
            raise _as_api_error(exc) from None

    @staticmethod
    def _sibling(params, index: int):
        sib = getattr(params, "for_sibling", None)
        if sib is not None:
            return sib(index)
        return params

    def abort(self, request_id: str) -> None:
        """Cancel one request (client went away); idempotent. Its blocks are freed by the
        engine (transfer pins respected); no final delta is sent."""
        with self._lock:
            r = self._streams.pop(request_id, None)
            if r is None:
                return
            r.done = True
        self._inbox.put(("abort", request_id))
        if self.metrics is not None:
            self.metrics.observe_finish(self.name, "abort", r, time.monotonic())

    # ------------------------------------------------------------------ commands
    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps; await its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        try:
            return await asyncio.wrap_future(fut)
        except APIError:
            raise
        except Exception as exc:  # the engine's typed errors as HTTP answers
            raise _as_api_error(exc) from exc

    async def stats(self) -> dict:
        """``engine.stats()`` plus ``pool``: the pool's statistics (``engine.pool.stats()``)."""
        def read(e):
            out = dict(e.stats())
            pool = getattr(e, "pool", None)
            if pool is not None and "pool" not in out:
                out["pool"] = pool.stats()
            return out

        return await self.call(read)

    async def vmm_status(self) -> dict:
        """The statistics of :meth:`stats` plus the KV cache's groups (per group: slots,
        blocks per slot, slot bytes, active slots, mapped bytes, live/cached/free blocks) and
        the tenants' regions of the pool."""
        def read(e):
            out = dict(e.stats())
            pool = getattr(e, "pool", None)
            if pool is not None and "pool" not in out:
                out["pool"] = pool.stats()
            cache = getattr(getattr(e, "kv_cache_manager", None), "cache", None)
            if cache is not None and hasattr(cache, "stats"):
                out["cache_groups"] = cache.stats().get("groups", {})
            ps = out.get("pool")
            names = list(getattr(ps, "per_tenant_mapped_bytes", None) or {})
            if pool is not None and names:
                tenants = {}
                for name in names:
                    r = pool.region(name)
                    tenants[name] = {"first_page": r.first_page, "pages": r.pages,
                                     "region_bytes": r.nbytes,
                                     "mapped_bytes": ps.per_tenant_mapped_bytes[name]}
                out["tenants"] = tenants
            return out

        return await self.call(read)

    async def sleep(self, level: int = 1, drain: bool = False,
                    timeout: Optional[float] = None) -> dict:
        """Put the engine to sleep. Without ``drain`` it is refused (409) while requests are in
        flight; with ``drain`` new requests get 503 and running ones finish first (at most
        ``timeout`` seconds, then 409 and the engine stays awake)."""
        if level not in (1, 2):
            raise APIError(400, f"level must be 1 (light: weights kept in host memory) or 2 "
                                f"(deep: weights dropped), not {level!r}", param="level")
        if self._sleeping:
            now = self._sleep_level
            if now is not None and level > now:  # deepening would need the weights awake
                raise APIError(409, f"the engine already sleeps at level {now} (light: weights "
                                    f"kept in host memory); level {level} needs it awake: "
                                    "POST /wake_up first, then sleep at level 2")
            return {"sleeping": True, "level": now if now is not None else level,
                    "already": True}
        if not drain and self.num_in_flight:
            raise APIError(409, f"{self.num_in_flight} request(s) in flight: sleep would pull "
                                "memory from under them; retry when idle or pass drain=true")
        # From here on new requests are refused (503), so none can slip in between this check
        # and the engine falling asleep (admission runs on this loop, without an await).
        self._draining = True
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                while self.num_in_flight:
                    if deadline is not None and time.monotonic() > deadline:
                        raise APIError(409, f"drain timed out after {timeout} s with "
                                            f"{self.num_in_flight} request(s) still running; "
                                            "the engine stays awake")
                    await asyncio.sleep(0.01)
            except BaseException:
                self._draining = False
                raise

        def _sleep(e):
            if e.has_unfinished_requests():
                raise APIError(409, "requests are still running in the engine; retry")
            return e.sleep(level=level)

        try:
            report = await self.call(_sleep)
            self._sleeping = True
            self._sleep_level = level
        finally:
            self._draining = False
        return {"sleeping": True, "level": level, **_plain(report)}

    async def wake_up(self) -> dict:
        """Wake the engine; idempotent (waking an awake engine reports ``already``)."""
        if not self._sleeping:
            return {"sleeping": False, "already": True}
        report = await self.call(lambda e: e.wake_up())
        self._sleeping = bool(await self.call(lambda e: e.is_sleeping()))
        if not self._sleeping:
            self._sleep_level = None
        return {"sleeping": self._sleeping, **_plain(report)}

    async def reset_prefix_cache(self) -> int:
        return int(await self.call(lambda e: e.reset_prefix_cache()))

    # ------------------------------------------------------------------ shutdown
    async def drain(self, timeout: float) -> int:
        """Refuse new requests, let running ones finish for up to ``timeout`` seconds, then
        abort the rest (their consumers get a 503 final delta). Returns how many were
        cancelled."""
        self._closing = True
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(0.02)
        with self._lock:
            left = list(self._streams.values())
        for r in left:
            self._fail(r, APIError(503, "the server is shutting down; the request was "
                                        "cancelled"))
            self._inbox.put(("abort", r.rid))
        return len(left)

    def hurry(self) -> None:
        """Make a running or later :meth:`drain` cancel what is left at once."""
        self._hurry = True

    def close(self, timeout: float = 10.0) -> None:
        """Stop both threads and shut the engine down (its pool released). Idempotent."""
        self._closing = True
        t = self._engine_thread
        if t is not None and t.is_alive():
            self._inbox.put(("stop",))
            t.join(timeout)
        self._outbox.put((_STOP,))
        if self._output_thread is not None and self._output_thread.is_alive():
            self._output_thread.join(timeout)
        if t is None or not t.is_alive():
            shutdown = getattr(self.engine, "shutdown", None)
            if shutdown is not None and not self._shut:
                self._shut = True
                shutdown()

    # ------------------------------------------------------------------ engine thread
    def _engine_loop(self) -> None:
        clock = SchedClock()  # this thread's schedstat
        try:
            self._engine_steps(clock)
        finally:
            clock.close()

    def _engine_steps(self, clock: SchedClock) -> None:
        eng = self.engine
        inbox = self._inbox
        if clock.read() is not None:
            self.step_runqueue_s = 0.0
        while True:
            if self._engine_error is None and eng.has_unfinished_requests():
                try:  # work to do: take what arrived, never wait
                    item = inbox.get_nowait()
                except queue.Empty:
                    item = None
            else:  # idle (or failed: nothing to compute): block until something arrives
                self.idle_waits += 1
                item = inbox.get()
            while item is not None:
                if item[0] == "stop":
                    self._abort_all_in_engine()
                    return
                self._handle(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if self._engine_error is not None:  # marked failed: nothing more to compute
                continue
            if not eng.has_unfinished_requests():
                self._num_waiting = 0
                self._num_running = 0
                continue
            # the CPU and schedstat windows lie inside the step's wall window [t0, t1]: a
            # preemption between two of these reads is then counted in the wall time too, so
            # the engine thread's CPU and run-queue shares of the steps stay within 1
            t0 = time.perf_counter()
            c0 = time.process_time()
            s0 = clock.read()
            e0 = time.thread_time()
            try:
                outs = eng.step()
            except Exception as exc:  # the engine failed: fail every request, keep serving
                if type(exc).__name__ == "WorkerLost":  # says it all: which rank, what next
                    log.error("engine step failed: %s", exc)
                else:
                    log.exception("engine step failed")
                self._fail_all(APIError(500, f"the engine failed: {type(exc).__name__}: {exc}"))
                continue
            self.step_thread_cpu_s += time.thread_time() - e0
            s1 = clock.read()
            if s0 is not None and s1 is not None and self.step_runqueue_s is not None:
                self.step_runqueue_s += s1[1] - s0[1]
            self.step_cpu_s += time.process_time() - c0
            t1 = time.perf_counter()
            if outs:  # to the output thread first: the bookkeeping below is nobody's wait
                end = time.monotonic()
                self._outbox.put(("outs", end, outs, end - (t1 - t0)))
            self.steps += 1
            if self.metrics is not None:
                self.metrics.observe_step(self.name, t1 - t0)
            self._track_kv_peak()
            self._num_waiting = int(eng.num_waiting)
            self._num_running = int(eng.num_running)

    def _track_kv_peak(self) -> None:
        """High-water mark of the KV bytes mapped, read after every step (the cache's
        ``active_bytes``: a sum over its groups). ``kv_mapped_peak_bytes`` is None when the
        engine has no virtual KV cache to read."""
        cache = self._kv_cache
        if cache is None:
            return
        try:
            now = int(cache.active_bytes())
        except Exception:  # not a virtual KV cache: stop reading it
            self._kv_cache = None
            self.kv_mapped_peak_bytes = None
            return
        if now > (self.kv_mapped_peak_bytes or 0):
            self.kv_mapped_peak_bytes = now

    def _handle(self, item) -> None:
        kind = item[0]
        eng = self.engine
        if kind == "add":
            r: _Req = item[1]
            r.t_picked = time.monotonic()
            with self._lock:
                self._pending_adds -= 1
                live = not r.done
            if not live:  # aborted before it reached the engine
                if not r.accepted.done():
                    r.accepted.set_result(False)
                return
            try:
                if r.cache_salt is None:  # engines without the keyword serve unsalted ones
                    eng.add_request(r.rid, r.prompt_ids, r.params, arrival_time=r.arrival)
                else:
                    eng.add_request(r.rid, r.prompt_ids, r.params, arrival_time=r.arrival,
                                    cache_salt=r.cache_salt)
            except Exception as exc:
                err = exc if isinstance(exc, APIError) else _as_api_error(exc)
                with self._lock:
                    self._streams.pop(r.rid, None)
                    r.done = True
                r.accepted.set_exception(err)
                return
            # Registered with the output processor on the output thread, before any step
            # output of this request (the outbox is FIFO).
            self._outbox.put(("add", r))
            r.t_added = time.monotonic()
            r.accepted.set_result(True)
            if self.metrics is not None:
                self.metrics.observe_server(self.name, "pickup", r.t_picked - r.t_queued)
                self.metrics.observe_server(self.name, "add", r.t_added - r.t_picked)
        elif kind == "abort":
            try:
                eng.abort_request(item[1])
            except Exception:  # already finished: nothing to free
                pass
            self._outbox.put(("drop", item[1]))
        elif kind == "call":
            fn, fut = item[1], item[2]
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(eng))
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                    fut.set_exception(exc)

    def _abort_all_in_engine(self) -> None:
        with self._lock:
            left = list(self._streams.values())
            self._streams.clear()
        for r in left:
            try:
                self.engine.abort_request(r.rid)
            except Exception:
                pass
            self._deliver(r, Delta(r.index, finished=True, finish_reason="abort",
                                   error=APIError(503, "the server is shutting down")))

    def _fail_all(self, err: APIError) -> None:
        with self._lock:
            left = list(self._streams.values())
        for r in left:
            self._fail(r, err)
            try:
                self.engine.abort_request(r.rid)
            except Exception:
                pass

    def _fail(self, r: _Req, err: APIError) -> None:
        with self._lock:
            if self._streams.pop(r.rid, None) is None:
                return
            r.done = True
        self._deliver(r, Delta(r.index, finished=True, finish_reason="abort", error=err))

    # ------------------------------------------------------------------ output thread
    # The output processor is touched by the output thread only (it is not thread-safe).
    def _output_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item[0] is _STOP:
                return
            if item[0] == "drop":
                self.processor.pop(item[1])
                continue
            if item[0] == "add":
                r = item[1]
                try:
                    self.processor.add_request(r.rid, r.params, r.prompt_ids)
                except Exception as exc:
                    log.exception("output processor refused a request")
                    self._fail(r, APIError(500, f"output processing failed: {exc}"))
                    self._inbox.put(("abort", r.rid))
                continue
            _, when, outs, began = item
            t0 = time.thread_time()
            batch: dict = {}  # loop -> [(queue, delta)]: one wake-up per loop per step
            for out in outs:
                try:
                    self._on_output(out, when, batch, began)
                except Exception as exc:  # never kill the output thread
                    log.exception("output processing failed")
                    with self._lock:
                        r = self._streams.get(out.request_id)
                    if r is not None:
                        self._fail(r, APIError(500, f"output processing failed: {exc}"))
                        self._inbox.put(("abort", r.rid))
            for loop, items in batch.items():
                try:
                    loop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    pass
            self.output_tokens += sum(len(o.new_token_ids) for o in outs)
            self.output_busy_s += time.thread_time() - t0

    def _on_output(self, out, when: float, batch: dict, began: float = 0.0) -> None:
        """One request's output of the step that ran from ``began`` to ``when`` (monotonic
        seconds) into a delta for its loop (``batch``)."""
        with self._lock:
            r = self._streams.get(out.request_id)
        if r is None or r.done:  # aborted meanwhile: drop what it produced
            self.processor.pop(out.request_id)
            return
        error = getattr(out, "error", None)
        if error is not None:  # this request alone failed in the step: a 500 saying what
            self.processor.pop(out.request_id)
            self._fail(r, APIError(500, f"the request failed: {error}"))
            if self.metrics is not None:
                self.metrics.observe_finish(self.name, "abort", r, when)
            return
        res = self.processor.process([out])
        if not res.updates:
            return
        upd = res.updates[0]
        new_ids = list(out.new_token_ids)
        if new_ids:
            if r.first_token is None:
                r.first_token = when
                if self.metrics is not None:
                    self.metrics.observe_first_token(self.name, r, when)
                    if r.t_added and began:
                        self.metrics.observe_server(self.name, "queue", began - r.t_added)
                        self.metrics.observe_server(self.name, "first_step", when - began)
            elif self.metrics is not None:
                self.metrics.observe_inter_token(self.name, r, when, len(new_ids))
            r.last_token = when
        r.n_out += len(new_ids)
        finished = bool(upd.finished)
        delta = Delta(r.index, text=upd.delta_text, token_ids=new_ids,
                      logprobs=_logprobs(new_ids, upd.delta_logprobs), finished=finished,
                      finish_reason=upd.finish_reason if finished else None,
                      stop_reason=upd.stop_reason if finished else None,
                      num_prompt_tokens=int(upd.num_prompt_tokens or len(r.prompt_ids)),
                      num_cached_tokens=max(0, int(upd.num_cached_tokens or 0)),
                      num_output_tokens=r.n_out,
                      prompt_logprobs=getattr(upd, "prompt_logprobs", None), step_time=when)
        if finished:
            with self._lock:
                self._streams.pop(r.rid, None)
                r.done = True
            self.processor.pop(r.rid)
            if out.request_id in res.to_abort:  # a stop string: free it in the engine now
                self._inbox.put(("abort", r.rid))
            if self.metrics is not None:
                self.metrics.observe_finish(self.name, delta.finish_reason, r, when)
        batch.setdefault(r.loop, []).append((r.queue, delta))

    @staticmethod
    def _deliver(r: _Req, delta: Delta) -> None:
        try:
            r.loop.call_soon_threadsafe(r.queue.put_nowait, delta)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _put_all(items: list) -> None:
    """On the event loop: hand one step's deltas to their requests' queues (stamped with
    the time the loop got them)."""
    now = time.monotonic()
    for q, delta in items:
        delta.loop_time = now
        q.put_nowait(delta)


class Generation:
    """The deltas of one client request (all its choices), in arrival order."""

    def __init__(self, front: AsyncEngine, reqs: list[_Req], q: asyncio.Queue,
                 prompt_lens: list[int]):
        self.front = front
        self.reqs = reqs
        self.queue = q
        #: usage's prompt_tokens: each prompt once, whatever n is
        self.num_prompt_tokens = sum(prompt_lens)
        self._left = len(reqs)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            while self._left:
                delta: Delta = await self.queue.get()
                if delta.finished:
                    self._left -= 1
                if delta.error is not None:
                    self.abort()
                    raise delta.error
                yield delta
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        for r in self.reqs:
            self.front.abort(r.rid)

    def emitted(self, delta: Delta) -> None:
        """``delta``'s SSE event is being written now (called by the stream right before it
        yields the event): records its ``handoff`` and ``emit`` latency and, for a choice's
        first token, the request's ``overhead`` (module docstring)."""
        m = self.front.metrics
        if m is None or not delta.step_time:
            return
        now = time.monotonic()
        name = self.front.name
        emit = now - delta.step_time
        m.observe_server(name, "emit", emit)
        if delta.loop_time:
            m.observe_server(name, "handoff", delta.loop_time - delta.step_time)
        r = self.reqs[delta.index] if delta.index < len(self.reqs) else None
        if r is not None and not r.emitted and delta.token_ids and r.t_added:
            r.emitted = True
            m.observe_server(name, "overhead",
                             (r.t_queued - r.arrival) + (r.t_added - r.t_picked) + emit)
            m.observe_server(name, "ttft", now - r.arrival)


def _logprobs(token_ids: list[int], entries) -> Optional[list]:
    """The engine's new logprobs (``[{token_id: Logprob}]``, one dict per new token) as
    ``[(token_id, logprob, [(id, logprob), ...] most likely first), ...]``."""
    if not entries:
        return None
    norm = []
    for tok, entry in zip(token_ids, entries):
        items = [(int(k), float(getattr(v, "logprob", v))) for k, v in dict(entry).items()]
        chosen = next((v for k, v in items if k == tok), float("nan"))
        top = sorted(items, key=lambda kv: -kv[1])
        norm.append((int(tok), chosen, top))
    return norm


# The engine's and the weights package's typed errors, by class name (the server sits on the
# engine; it does not import the packages below it to recognise their errors).
_STATUS_BY_ERROR = {
    "WeightsNotLoaded": 503, "EngineSleeping": 503, "WakeupOutOfMemory": 503,
    "SleepRefused": 409, "WeightVmmRequired": 400, "ResidentPoolRequired": 400,
    "WakeupFailed": 500, "CheckpointChanged": 409, "ConfigError": 400,
    "ForkDoesNotFit": 503,
}


def _as_api_error(exc: Exception) -> APIError:
    """An engine ``RequestError(param, message)`` as a 400 naming the parameter; the engine's
    and the weights package's typed errors with their status (``_STATUS_BY_ERROR``, by class,
    most specific first); anything else a 500 that says what was raised."""
    if isinstance(exc, APIError):
        return exc
    for cls in type(exc).__mro__:
        status = _STATUS_BY_ERROR.get(cls.__name__)
        if status is not None:
            return APIError(status, str(exc))
    param = getattr(exc, "param", None)
    if param is not None or type(exc).__name__ == "RequestError":
        return APIError(400, getattr(exc, "message", None) or str(exc), param=param)
    return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}")


def _plain(report) -> dict:
    if report is None:
        return {}
    if isinstance(report, dict):
        return {k: v for k, v in report.items() if isinstance(v, (int, float, str, bool, type(None)))}
    if hasattr(report, "__dataclass_fields__"):
        from dataclasses import asdict

        return _plain(asdict(report))
    return {"report": str(report)}
