"""``/metrics``: Prometheus text with vLLM's metric names (what dashboards and autoscalers read)
and ``xllm_vmm_*`` for what only this server has (the VMM pool).

Two kinds of series:

- observed by the front as requests progress (output thread; prometheus_client is thread-safe):
  histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (and the
  older name ``vllm:time_per_output_token_seconds``), ``vllm:e2e_request_latency_seconds``, the
  counter ``vllm:request_success{finished_reason}``, ``xllm_vmm_engine_step_seconds`` (one
  ``LLMEngine.step()`` on the engine thread: the model's share of the serving time), and
  ``xllm_vmm_server_latency_seconds{stage}`` (the server's own hand-offs: ``admit``,
  ``pickup``, ``add``, ``queue``, ``first_step``, ``handoff``, ``emit``, ``overhead``,
  ``ttft``; see ``front``'s docstring), with
  buckets fine enough (five per decade, 10 µs to 10 s) for a median and p99 by
  interpolation (``bench serve``);
- read from the engine at scrape time (``engine.stats()`` on the engine thread): gauges
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (0..1), counters ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens),
  ``vllm:num_preemptions``, ``vllm:prompt_tokens``, ``vllm:generation_tokens``, and the
  ``xllm_vmm_*`` figures of the pool (``stats()["pool"]``: the pool's ``PoolStats``), its
  tenants and the KV cache manager (``stats()["kvcache"]``); bytes unless the name says
  otherwise; and, only while the engine speculates (``stats()["spec_decode"]``), vLLM's
  ``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens`` and
  ``_num_accepted_tokens_per_pos{position}`` counters. The tables below are the one home of
  these names.

Counters are exported as prometheus_client does (``_total`` suffix in the text, as vLLM's).
Every series carries ``model_name``. Units: seconds, bytes, tokens.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: 10 µs .. 10 s, five per decade: the server's own latencies (tens of µs to a step or more)
SERVER_LATENCY_BUCKETS = tuple(float(f"{1e-5 * 10 ** (k / 5):.3g}") for k in range(31))
#: the stages of xllm_vmm_server_latency_seconds (front's module docstring)
SERVER_STAGES = ("admit", "pickup", "add", "queue", "first_step", "handoff", "emit", "overhead",
                 "ttft")
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# engine.stats() key -> (metric name, help, kind). Keys the engine does not report are left out
# of the text rather than exported as a made-up zero.
ENGINE_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("num_requests_running", "vllm:num_requests_running",
     "Requests in model execution batches.", "gauge"),
    ("num_requests_waiting", "vllm:num_requests_waiting",
     "Requests waiting to be processed (engine queue + the server's inbox).", "gauge"),
    ("kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100 percent).",
     "gauge"),
    ("prefix_cache_queries", "vllm:prefix_cache_queries",
     "Prefix cache queries, in tokens.", "counter"),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", "counter"),
    ("num_preemptions", "vllm:num_preemptions", "Cumulative preemptions.", "counter"),
    ("prompt_tokens", "vllm:prompt_tokens", "Prefill tokens processed.", "counter"),
    ("generation_tokens", "vllm:generation_tokens", "Generation tokens processed.", "counter"),
    ("kv_mapped_bytes", "xllm_vmm_kv_mapped_bytes", "Bytes of KV pages mapped now.", "gauge"),
    ("execution_peak_bytes", "xllm_vmm_execution_peak_bytes",
     "Observed execution peak (bytes kept free beside the pool).", "gauge"),
    ("live_budget_bytes", "xllm_vmm_live_budget_left_bytes",
     "Bytes the pool may still map under the live budget.", "gauge"),
)

# pool statistics (engine.stats()["pool"], the pool's PoolStats fields) -> xllm_vmm_* series
POOL_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("reserved_bytes", "xllm_vmm_reserved_virtual_bytes", "Virtual bytes reserved by the arena.",
     "gauge"),
    ("mapped_bytes", "xllm_vmm_mapped_bytes", "Physical bytes mapped in the pool.", "gauge"),
    ("held_bytes", "xllm_vmm_held_bytes", "Physical bytes held (mapped + ready handles).",
     "gauge"),
    ("ready_bytes", "xllm_vmm_ready_bytes", "Bytes of created handles kept ready.", "gauge"),
    ("pages_in_use", "xllm_vmm_pages_in_use", "Pages in use by tenants.", "gauge"),
    ("map_calls", "xllm_vmm_map_calls", "Map calls (batches).", "counter"),
    ("unmap_calls", "xllm_vmm_unmap_calls", "Unmap calls (batches).", "counter"),
    ("pages_mapped_total", "xllm_vmm_pages_mapped", "Pages mapped since start.", "counter"),
    ("pages_unmapped_total", "xllm_vmm_pages_unmapped", "Pages unmapped since start.", "counter"),
    ("failed_maps", "xllm_vmm_failed_maps", "Maps refused (budget, quota or device).", "counter"),
)

# KV cache manager statistics (engine.stats()["kvcache"]) -> xllm_vmm_* series
KV_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("live_blocks", "xllm_vmm_kv_live_blocks", "KV blocks held by requests.", "gauge"),
    ("cached_blocks", "xllm_vmm_kv_cached_blocks", "KV blocks kept by the prefix cache.",
     "gauge"),
    ("packed_floor_bytes", "xllm_vmm_kv_packed_floor_bytes",
     "Least KV bytes the live and cached blocks need when packed.", "gauge"),
    ("host_offload_bytes", "xllm_vmm_host_offload_bytes", "Bytes offloaded to the host KV tier.",
     "counter"),
    ("host_restore_bytes", "xllm_vmm_host_restore_bytes", "Bytes restored from the host KV tier.",
     "counter"),
    ("prefix_evictions", "xllm_vmm_prefix_cache_evictions", "Cached blocks evicted.", "counter"),
)

# speculative decoding (engine.stats()["spec_decode"], present only while the engine
# speculates) -> vLLM's counters; ``num_accepted_tokens_per_pos`` (a list, one cumulative count
# per draft position) is the counter vllm:spec_decode_num_accepted_tokens_per_pos{position}.
SPEC_DECODE_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("num_drafts", "vllm:spec_decode_num_drafts", "Speculative drafts proposed.", "counter"),
    ("num_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
     "counter"),
    ("num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
     "Draft tokens accepted by the target model.", "counter"),
)
SPEC_DECODE_PER_POS = ("num_accepted_tokens_per_pos",
                       "vllm:spec_decode_num_accepted_tokens_per_pos",
                       "Draft tokens accepted at each draft position (0-based).")


# the server's own work beside the engine step (the front's counters, AsyncEngine attributes)
FRONT_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("output_busy_seconds", "xllm_vmm_output_thread_cpu_seconds",
     "CPU seconds the output thread spent on step outputs (detokenize, stop strings, "
     "hand-off)."),
    ("output_tokens", "xllm_vmm_output_tokens", "Output tokens the output thread handled."),
    ("stream_busy_seconds", "xllm_vmm_stream_encode_seconds",
     "Seconds the event loop spent building and JSON-encoding streamed chunks (wall time of "
     "a section without awaits)."),
    ("step_cpu_seconds", "xllm_vmm_engine_step_cpu_seconds",
     "CPU seconds of the whole process (every thread) during engine steps; beside "
     "xllm_vmm_engine_step_seconds_sum: below it, the step waited for the cores."),
    ("step_thread_cpu_seconds", "xllm_vmm_engine_thread_step_cpu_seconds",
     "CPU seconds of the engine thread alone during engine steps; beside "
     "xllm_vmm_engine_step_seconds_sum: the rest of the step's wall time the engine thread "
     "waited (for its compute threads, the interpreter lock or a core)."),
    ("step_runqueue_seconds", "xllm_vmm_engine_thread_runqueue_seconds",
     "Seconds the engine thread was runnable but waited for a core during engine steps "
     "(Linux schedstat: CPU contention); the steps' wall time less this and the engine "
     "thread's CPU it waited while not runnable (the interpreter lock, its compute threads)."),
)


def _get(obj: Any, key: str):
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def _number(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


class _HotChild:
    """One label set of a :class:`HotHistogram`: counts per bucket (the last is ``+Inf``) and
    the sum, under one lock."""

    __slots__ = ("bounds", "counts", "sum", "lock")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe(self, value: float, n: int = 1) -> None:
        """``n`` samples of ``value`` (a sample equal to a bound counts in that bucket, as
        Prometheus' ``le``)."""
        i = bisect_left(self.bounds, value)
        with self.lock:
            self.counts[i] += n
            self.sum += value * n


class HotHistogram:
    """A labelled histogram for the hot path (observed per streamed chunk and per output
    token): a bisect into the bounds and one lock per observation, where prometheus_client's
    ``Histogram.observe`` scans the bounds and takes a lock per bucket and one for the sum
    (~3-5 µs with 19-31 buckets, two per chunk on the event loop). Exported by the registry as
    the same text (``NAME_bucket{...,le}`` cumulative, ``NAME_count``, ``NAME_sum``; no
    ``_created``)."""

    def __init__(self, name: str, doc: str, labelnames: list[str], buckets: Iterable[float],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = list(labelnames)
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self._children: dict[tuple[str, ...], _HotChild] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def labels(self, *values: str) -> _HotChild:
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected "
                             f"({', '.join(self.labelnames)}), got {len(key)}")
        with self._lock:
            ch = self._children.get(key)
            if ch is None:
                ch = self._children[key] = _HotChild(self.bounds)
        return ch

    def collect(self) -> Iterable:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        with self._lock:
            children = list(self._children.items())
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for key, ch in children:
            with ch.lock:
                counts, total = list(ch.counts), ch.sum
            cum, buckets = 0, []
            for le, c in zip(les, counts):
                cum += c
                buckets.append((le, float(cum)))
            fam.add_metric(list(key), buckets, total)
        yield fam


class Metrics:
    """The server's registry: front-side histograms and counters, plus engine snapshots
    rendered at each scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time to first token, seconds.", ["model_name"],
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        # observed per output token / per streamed chunk: the hot-path histogram
        self.itl = HotHistogram("vllm:inter_token_latency_seconds",
                                "Time between output tokens, seconds.", ["model_name"],
                                buckets=_ITL_BUCKETS, registry=self.registry)
        self.tpot = HotHistogram("vllm:time_per_output_token_seconds",
                                 "Time per output token, seconds (older name of the inter-token "
                                 "latency).", ["model_name"], buckets=_ITL_BUCKETS,
                                 registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "End-to-end request latency, seconds.", ["model_name"],
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.step = Histogram("xllm_vmm_engine_step_seconds",
                              "Wall time of one engine step on the engine thread, seconds.",
                              ["model_name"], buckets=_STEP_BUCKETS, registry=self.registry)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.server = HotHistogram("xllm_vmm_server_latency_seconds",
                                   "The server's own latency by stage, seconds: admit (HTTP "
                                   "arrival to the engine's inbox), pickup (inbox to the engine "
                                   "thread), add (add_request), queue (added to the start of "
                                   "the step making the first token), first_step (that step), "
                                   "handoff (step end to the event loop), emit (step end to "
                                   "the SSE write), overhead (per request: admit + add + the "
                                   "first token's emit), ttft (arrival to the first token's "
                                   "SSE event).",
                                   ["model_name", "stage"], buckets=SERVER_LATENCY_BUCKETS,
                                   registry=self.registry)
        self._server_children: dict[tuple[str, str], Any] = {}
        self._snapshots: dict[str, tuple[dict, dict]] = {}
        self._by_model: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self.registry.register(_Snapshot(self))

    # -- observations (output thread) ---------------------------------------------------
    def _children(self, model: str) -> tuple:
        """The model's labelled (ttft, itl, tpot, step) histograms, looked up once: ``labels``
        takes a lock and builds a key on every call, and the inter-token ones are observed
        for every output token."""
        ch = self._by_model.get(model)
        if ch is None:
            ch = self._by_model[model] = (self.ttft.labels(model), self.itl.labels(model),
                                          self.tpot.labels(model), self.step.labels(model))
        return ch

    def observe_first_token(self, model: str, req, when: float) -> None:
        self._children(model)[0].observe(max(0.0, when - req.arrival))

    def observe_inter_token(self, model: str, req, when: float, n_tokens: int) -> None:
        if req.last_token is None or n_tokens <= 0:
            return
        gap = max(0.0, when - req.last_token) / n_tokens
        _, itl, tpot, _ = self._children(model)
        itl.observe(gap, n_tokens)
        tpot.observe(gap, n_tokens)

    def observe_step(self, model: str, seconds: float) -> None:
        self._children(model)[3].observe(seconds)

    def observe_server(self, model: str, stage: str, seconds: float) -> None:
        """One sample of the server's own latency at ``stage`` (``SERVER_STAGES``)."""
        ch = self._server_children.get((model, stage))
        if ch is None:
            ch = self._server_children[(model, stage)] = self.server.labels(model, stage)
        ch.observe(max(0.0, seconds))

    def observe_finish(self, model: str, reason: str | None, req, when: float) -> None:
        self.success.labels(model, reason or "abort").inc()
        self.e2e.labels(model).observe(max(0.0, when - req.arrival))

    # -- scrape ---------------------------------------------------------------------------
    def render(self, snapshots: Mapping[str, tuple[dict, dict]]) -> bytes:
        """The text exposition with ``snapshots`` = ``{model_name: (engine_stats, front)}``."""
        with self._lock:
            self._snapshots = dict(snapshots)
            try:
                return generate_latest(self.registry)
            finally:
                self._snapshots = {}


class _Snapshot:
    """Collector of the series read from engine statistics at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterable:
        snaps = self.metrics._snapshots
        families: dict[str, Any] = {}

        def add(name: str, help_: str, kind: str, labels: dict, value: float) -> None:
            fam = families.get(name)
            if fam is None:
                cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                fam = families[name] = cls(name, help_, labels=list(labels))
            fam.add_metric(list(labels.values()), value)

        for model, (stats, front) in snaps.items():
            base = {"model_name": model}
            for key, name, help_, kind in ENGINE_SERIES:
                v = _number(_get(stats, key))
                if v is None:
                    v = _number(front.get(key))
                if v is not None:
                    add(name, help_, kind, base, v)
            pool = _get(stats, "pool")
            for key, name, help_, kind in POOL_SERIES:
                v = _number(_get(pool, key))
                if v is not None:
                    add(name, help_, kind, base, v)
            for tenant, v in (_get(pool, "per_tenant_mapped_bytes") or {}).items():
                add("xllm_vmm_tenant_mapped_bytes", "Mapped bytes by pool tenant.", "gauge",
                    {**base, "tenant": str(tenant)}, float(v))
            kv = _get(stats, "kvcache")
            for key, name, help_, kind in KV_SERIES:
                v = _number(_get(kv, key))
                if v is not None:
                    add(name, help_, kind, base, v)
            spec = _get(stats, "spec_decode")  # only while the engine speculates
            if spec:
                for key, name, help_, kind in SPEC_DECODE_SERIES:
                    v = _number(_get(spec, key))
                    if v is not None:
                        add(name, help_, kind, base, v)
                key, name, help_ = SPEC_DECODE_PER_POS
                for pos, v in enumerate(_get(spec, key) or ()):
                    if _number(v) is not None:
                        add(name, help_, "counter", {**base, "position": str(pos)}, float(v))
            dist = _get(stats, "distributed")  # a worker set: per-rank figures
            if dist:
                add("xllm_vmm_all_reduce_seconds_per_step", "Mean all-reduce time per step "
                    "on rank 0 (seconds).", "gauge", base,
                    float(dist.get("all_reduce_seconds_per_step", 0.0)))
                for w in dist.get("workers", []):
                    lab = {**base, "rank": str(w.get("rank"))}
                    for key in ("mapped_bytes", "kv_mapped_bytes", "budget_left_bytes"):
                        if key in w:
                            add(f"xllm_vmm_worker_{key}", f"{key} of one worker of the set.",
                                "gauge", lab, float(w[key]))
            add("xllm_vmm_sleeping", "1 while the engine sleeps.", "gauge", base,
                float(bool(front.get("sleeping"))))
            add("xllm_vmm_requests_in_flight", "Requests the front holds (queued or running).",
                "gauge", base, float(front.get("in_flight", 0)))
            for key, name, help_ in FRONT_COUNTERS:
                v = _number(front.get(key))
                if v is not None:
                    add(name, help_, "counter", base, v)
            peak = front.get("kv_mapped_peak_bytes")
            if peak is not None:
                add("xllm_vmm_kv_mapped_peak_bytes", "Most KV bytes mapped after any engine step "
                    "since the server started.", "gauge", base, float(peak))
        return list(families.values())

