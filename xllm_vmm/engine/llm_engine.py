"""``LLMEngine``: the driver side of one engine instance — configuration, sizing, memory,
scheduler, sampler — over one :class:`~xllm_vmm.engine.worker.Worker`.

Construction (:meth:`LLMEngine.from_flags`), in this order, each step the one way in of its
package:

1. Flags → :func:`xllm_vmm.config.load` (the engine's flag names, gflags values) → every rule
   of ``check-config`` plus the sizing rules (:func:`xllm_vmm.planner.checks.check_sizing`):
   an error finding raises :class:`~xllm_vmm.config.ConfigError` with check-config's finding
   text; HK-07 (a warning in check-config, an error when serving) raises too.
2. The plan (:func:`xllm_vmm.planner.make_plan` through ``check_sizing``) for this device's
   memory: a plan that does not fit raises ``ConfigError`` with the plan's reason (id =
   the plan's code, e.g. ``MEMORY``, ``CONTEXT``).
3. Driver (``devices``: empty/auto/cpu → the host driver emulating ``device_memory`` bytes;
   ``cuda[:i]``, ``npu[:i]``) → :class:`~xllm_vmm.pool.VmmPool` (mode from
   ``enable_vmm_kvcache``/``vmm_elastic``; arena = the plan's) → weights
   (:func:`xllm_vmm.weights.load_weights`, into the pool when ``enable_vmm_weights``) →
   :func:`xllm_vmm.kvcache.build_kv_cache_manager` (fixed/physical: exactly the plan's KV
   capacity in tokens; elastic: the plan's arena) → ``Worker.create``.

So that the plan and the running cache agree on the host driver, where weights that are not in
the pool are ordinary process memory, the emulated device is ``device_memory`` minus those
weights (a real device holds them), and the plan's runtime overhead is 0 (the host driver's
device holds nothing else).

Engine-only options (not catalogue flags): ``max_model_len`` (tokens; default the model's
``max_position_embeddings``, lowered to what one request's KV can hold when not given),
``dtype`` (auto/float32/bfloat16/float16), ``device_memory`` (bytes or a size such as "1GiB";
default 1 GiB on the host driver, the device's total otherwise), ``attention_backend``,
``seed`` (default: the ``random_seed`` flag; -1 = random). Flags the CPU engine honours:
``block_size``, ``enable_vmm_kvcache``, ``vmm_elastic``, ``enable_vmm_weights``,
``enable_prefix_cache``, ``host_blocks_factor``, ``max_seqs_per_batch``,
``max_tokens_per_batch``, ``enable_chunked_prefill``, ``max_memory_utilization``,
``max_cache_size``, ``vmm_memory_reserve_bytes``, ``xxh3_128bits_seed``, ``random_seed``,
``devices``, ``model_id``, and MTP speculative decoding's ``draft_model``,
``speculative_algorithm`` (MTP only), ``num_speculative_tokens``
(:mod:`xllm_vmm.engine.spec_decode.speculator`); every other flag is validated (as
check-config does) and has no effect here (:data:`HONOURED_FLAGS`).

Parallel samples (``SamplingParams.n > 1``) are sibling requests ``{request_id}#{i}``
(:func:`child_request_id`); their :class:`EngineOutput` carries ``parent_request_id`` and
``index``; ``abort_request`` of the parent id aborts all of them.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

from xllm_vmm.engine.distributed.topology import DIST_OPTIONS
from xllm_vmm.engine.output import EngineOutput
from xllm_vmm.engine.prompt_logprobs import PromptLogprobs
from xllm_vmm.engine.request import Request, RequestError, child_request_id
from xllm_vmm.engine.sampling_params import SamplingParams

GiB = 1 << 30
DEFAULT_HOST_DEVICE_MEMORY = 1 * GiB
"""Emulated device memory of the host (CPU) driver when ``device_memory`` is not given (at
least: a model whose weights need more gets :func:`host_device_memory`)."""


def host_device_memory(spec: Any) -> int:
    """The host driver's emulated device memory for ``spec`` without ``device_memory``:
    :data:`DEFAULT_HOST_DEVICE_MEMORY`, or, for larger weights, twice their bytes plus 1 GiB
    rounded up to whole GiB (room for the execution peak and a KV cache beside them)."""
    w = getattr(spec, "weight_bytes", None) or getattr(spec, "estimated_weight_bytes", None) or 0
    need = -(-(2 * int(w) + GiB) // GiB) * GiB
    return max(DEFAULT_HOST_DEVICE_MEMORY, need) if w > 256 * 1024 * 1024 else DEFAULT_HOST_DEVICE_MEMORY

HONOURED_FLAGS = frozenset({
    "block_size", "enable_vmm_kvcache", "vmm_elastic", "enable_vmm_weights",
    "enable_prefix_cache", "host_blocks_factor", "max_seqs_per_batch", "max_tokens_per_batch",
    "enable_chunked_prefill", "max_memory_utilization", "max_cache_size",
    "vmm_memory_reserve_bytes", "xxh3_128bits_seed", "random_seed", "devices", "model_id",
    # several workers (engine.distributed)
    "nnodes", "node_rank", "master_node_addr", "tp_size",
    # MTP speculative decoding (spec_decode.speculator)
    "draft_model", "speculative_algorithm", "num_speculative_tokens"})
"""The engine flags this engine acts on (``serve`` lists every other explicitly set flag once
as accepted without effect); the module docstring says what each does."""

ENGINE_OPTIONS = ("max_model_len", "dtype", "device_memory", "attention_backend", "seed",
                  "progress", *DIST_OPTIONS)
"""Engine-only options (not engine flags). ``progress(done_bytes, total_bytes)`` is called while
this process loads its weights (the CLI's progress bar); it never travels to spawned workers."""


_frozen_engines = 0
"""Engines alive whose construction froze the garbage collector's heap (:func:`_freeze_heap`)."""


def _freeze_heap() -> None:
    """Move every object alive now (the interpreter, torch, the model, the pool, the engine)
    into the collector's permanent generation (``gc.freeze``, as vLLM does after start-up).

    Why: a full (generation-2) collection walks every tracked object; with torch and
    transformers imported that is ~80-90 ms, and it fell inside a decode step every run (the
    ~9th-12th step of ``bench engine``'s decode-heavy trace). Frozen objects are never walked,
    so the collections a running engine still triggers scan only what was made since.
    Undone (``gc.unfreeze``) when the last such engine shuts down, so that nothing frozen can
    outlive the engines as uncollectable cycles."""
    global _frozen_engines
    _frozen_engines += 1
    gc.freeze()


def _thaw_heap() -> None:
    """The counterpart of :func:`_freeze_heap`, called once per engine by ``shutdown``."""
    global _frozen_engines
    _frozen_engines = max(0, _frozen_engines - 1)
    if _frozen_engines == 0:
        gc.unfreeze()


def _flag_token(name: str, value: Any) -> str:
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"--{name}={value}"


class ForkDoesNotFit(RuntimeError):
    """A fork's own KV cache has no room on the device: a fixed (``vmm_elastic=false``) or
    physical KV cache takes the plan's whole KV budget, so a fork needs ``max_cache_size`` to
    leave room for it (or an elastic pool). The server answers 503."""


class LLMEngine:
    """See the module docstring. Build with :meth:`from_flags`."""

    def __init__(self, *, model_dir: str, model_name: str, config: Any, plan: Any, driver: Any,
                 pool: Any, weights: Any, mgr: Any, worker: Any, tokenizer: Any,
                 max_model_len: int, seed: int | None, warnings: list | None = None,
                 is_demo: bool = False, owns_driver: bool = True, draft: Any = None) -> None:
        from xllm_vmm.engine.linear_state import attach_linear_state
        from xllm_vmm.engine.sampler import Sampler
        from xllm_vmm.engine.scheduler import Scheduler

        # hybrid models: resident state slots (as many as plan reserved) + prefix checkpoints
        # (else unchanged)
        slots = getattr(plan.workers[0], "resident_slots", 0) if plan is not None else 0
        mgr, worker = attach_linear_state(
            mgr, worker, max_seqs=int(slots or config["max_seqs_per_batch"]))
        self.draft = draft
        self.speculator = None
        if draft is not None:  # MTP speculative decoding
            from xllm_vmm.engine.spec_decode.speculator import MtpSlotsKVManager, MtpSpeculator
            from xllm_vmm.kvcache.resident import SequenceSlots

            from xllm_vmm.planner.sizing import mtp_embedding_bytes_per_seq

            # the planner's formula (AD-03), over the draft's real dtype
            hidden = mtp_embedding_bytes_per_seq(draft.config.hidden_size,
                                                 str(draft.body.dtype).removeprefix("torch."))
            self.spec_slots = SequenceSlots("mtp_embedding", int(config["max_seqs_per_batch"]),
                                            hidden)
            mgr = MtpSlotsKVManager(mgr, self.spec_slots)
            self.speculator = MtpSpeculator(
                mgr, draft, num_speculative_tokens=int(config["num_speculative_tokens"]),
                max_model_len=max_model_len, seed=None if seed is None else seed + 1)
        self.model_dir = model_dir
        self.model_name = model_name
        self.config = config
        self.plan = plan
        self.driver = driver
        self.pool = pool
        self.weights = weights
        self.kv_cache_manager = mgr
        self.worker = worker
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.is_demo = is_demo
        self.warnings = list(warnings or [])
        self._owns_driver = owns_driver
        self.scheduler = Scheduler(
            mgr, max_tokens_per_batch=int(config["max_tokens_per_batch"]),
            max_seqs_per_batch=int(config["max_seqs_per_batch"]), max_model_len=max_model_len,
            enable_chunked_prefill=bool(config["enable_chunked_prefill"]), pool=pool)
        self.sampler = Sampler(seed)
        self._prompt_lps = PromptLogprobs()
        self._eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._children: dict[str, list[str]] = {}
        self._parent: dict[str, tuple[str, int]] = {}
        import logging

        from xllm_vmm.engine.paths import paths_line

        logging.getLogger("xllm_vmm.engine").info(paths_line(self.compute_paths()))
        self._sleeper = None
        self._closed = False
        self._forks: list[LLMEngine] = []
        self.num_steps = 0
        self.finished_reasons: dict[str, int] = {}

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_flags(cls, model: str | os.PathLike[str] | None = None, **flags: Any) -> LLMEngine:
        """An engine for ``model`` (a local Hugging Face directory, a ``.gguf`` file or a
        directory holding one, ``"demo"`` for the embedded demo model; None: the default model,
        fetched on first use, or the demo model when it cannot be) with the engine's flags (see
        the module docstring)."""
        from xllm_vmm.config import ConfigError, Finding

        opts = {k: flags.pop(k) for k in ENGINE_OPTIONS if k in flags}
        if "model" in flags:
            raise ConfigError([Finding("CFG-CONFLICT", "error", "give the model once: as "
                                       "LLMEngine.from_flags(model=...) / LLM(model=...), not "
                                       "also as a 'model' flag", flags={"model": flags["model"]})])
        return cls.from_args(model, [_flag_token(k, v) for k, v in flags.items()], **opts)

    @classmethod
    def from_args(cls, model: str | os.PathLike[str] | None, args: list[str],
                  **options: Any) -> LLMEngine:
        """:meth:`from_flags` with the flags as command-line tokens in the engine's gflags
        syntax (``["--block_size=16", "--enable_vmm_kvcache=true"]``), as ``check-config``
        reads them; ``options`` are the engine-only options."""
        from xllm_vmm.config import load

        unknown = sorted(set(options) - set(ENGINE_OPTIONS))
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; known: "
                            f"{', '.join(ENGINE_OPTIONS)}")
        from xllm_vmm.models.default_model import resolve_model

        if model is None:  # flags that do not parse fail before anything is fetched
            load(list(args), env=None, label="engine flags")
        model, is_demo = resolve_model(model, dtype=options.get("dtype"))
        model_dir = str(Path(model).expanduser())
        cfg = load([_flag_token("model", model_dir), *args], env=None, label="engine flags")
        sized = _size(cfg, model_dir, options)
        return _build(cls, sized, model_dir, options, is_demo)

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Queue a request (``params.n`` siblings when n > 1). Raises :class:`RequestError`
        naming the parameter: empty prompt, a token id outside the vocabulary, a prompt of
        ``max_model_len`` tokens or more, or one whose KV cannot fit the whole cache.
        ``cache_salt`` (vLLM's field, a non-empty string): requests with different salts never
        share prefix-cache blocks; the same salt (or none on both) shares as usual."""
        if not isinstance(params, SamplingParams):
            raise RequestError(param="sampling_params",
                               message=f"expected SamplingParams, got {type(params).__name__}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestError(param="cache_salt", message=(
                f"cache_salt must be a non-empty string when given, got {cache_salt!r}"))
        ids = list(prompt_token_ids)
        if not ids:
            raise RequestError(param="prompt", message="the prompt is empty: give at least one token")
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(param="prompt_token_ids",
                               message=f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise RequestError(param="prompt", message=(
                f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one output token: shorten the prompt"))
        cap = self.kv_cache_manager.capacity().total_tokens
        if len(ids) + 1 > cap:
            raise RequestError(param="prompt", message=(
                f"the prompt has {len(ids)} tokens; the KV cache holds {cap} tokens in all: "
                "shorten the prompt or give the cache more memory"))
        budget = self.scheduler.max_tokens_per_batch
        if not self.scheduler.enable_chunked_prefill and len(ids) > budget:
            raise RequestError(param="prompt", message=(
                f"the prompt has {len(ids)} tokens; with enable_chunked_prefill=false a prompt "
                f"runs in one step of at most max_tokens_per_batch={budget} tokens: shorten "
                "the prompt, raise max_tokens_per_batch or enable chunked prefill"))
        PromptLogprobs.check(params, self.worker, bool(self.config["enable_prefix_cache"]))
        if getattr(params, "prompt_logprobs", None) is not None:
            self._prompt_lps_asked = True
        n = params.n
        kids = [child_request_id(request_id, i, n) for i in range(n)]
        taken = [k for k in (request_id, *kids) if k in self._children or k in self.scheduler.requests]
        if taken:
            raise RequestError(param="request_id", message=(
                f"request id {taken[0]!r} is in use (parallel samples of {request_id!r} are "
                f"{kids[0]!r}..{kids[-1]!r})" if n > 1 else f"request id {request_id!r} is in use"))
        t = time.monotonic() if arrival_time is None else arrival_time
        self._children[request_id] = kids
        for i, kid in enumerate(kids):
            p = params if n == 1 else params.for_sibling(i)
            self._parent[kid] = (request_id, i)
            self.scheduler.add_request(Request(kid, list(ids), p, arrival_time=t,
                                               eos_token_ids=self._eos,
                                               parent_id=request_id if n > 1 else None,
                                               sample_index=i, cache_salt=cache_salt))

    def abort_request(self, request_id: str | list[str], *, finish_reason: str = "abort") -> None:
        """Abort requests (a parent id aborts its parallel samples); frees everything they hold
        (blocks under a copy stay pinned until it ends). Unknown ids are ignored.
        ``finish_reason``: what ``stats()["request_success"]`` counts them as ("stop" when a
        stop string ended them in the OutputProcessor)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            for kid in self._children.pop(rid, [rid]):
                if self.scheduler.abort(kid) is not None:
                    self._count_finish(finish_reason)
                parent = self._parent.pop(kid, None)
                if parent is not None and parent[0] != rid:
                    left = self._children.get(parent[0])
                    if left is not None and kid in left:
                        left.remove(kid)
                        if not left:
                            del self._children[parent[0]]

    def step(self) -> list[EngineOutput]:
        """One engine iteration: schedule, execute, sample, update. Returns one output per
        request that produced a token or finished. Does nothing while asleep."""
        if self.is_sleeping():
            return []
        sched = self.scheduler
        out = sched.schedule()
        spec = self.speculator
        if out.step is None:
            results = sched.update(out) if out.finished else []
        elif spec is not None:  # MTP speculative decoding (spec_decode.speculator)
            self._prompt_lps.prepare(out, self.worker)
            so = spec.target_step(self.worker, out.step)
            self._prompt_lps.collect(out, so)
            toks, lps = spec.sample(out, so, self.sampler)
            results = sched.update(out, toks, lps, int(so.execution_peak_bytes or 0))
            self._prompt_lps.attach(out, results, sched.requests)
            spec.propose(out, so)
            self.num_steps += 1
        else:
            if self._prompt_lps_asked:  # else no chunk can want them: skip the pass over chunks
                self._prompt_lps.prepare(out, self.worker)
            so = self.worker.execute(out.step)
            self._prompt_lps.collect(out, so)
            rows = out.sampled
            failed: dict[str, str] = {}
            if rows:
                s = self.sampler.sample(so.logits, rows)
                toks, lps = s.token_ids, s.logprobs
                failed = {rows[i].request_id: msg for i, msg in s.errors.items()}
            else:
                toks, lps = [], None
            results = sched.update(out, toks, lps, int(so.execution_peak_bytes or 0))
            self._prompt_lps.attach(out, results, sched.requests)
            self.num_steps += 1
            if failed:
                results = self._fail_requests(results, failed)
        # update() filled each output's parent id, sample index and the request's first token
        # time; what is left here is the bookkeeping of finished requests
        for r in results:
            if r.finished:
                self._count_finish(r.finish_reason or "stop")
                self._parent.pop(r.request_id, None)
                parent = r.parent_request_id
                kids = self._children.get(parent)
                if kids is not None and r.request_id in kids:
                    kids.remove(r.request_id)
                    if not kids:
                        del self._children[parent]
        return results

    def _fail_requests(self, results: list[EngineOutput], failed: dict[str, str]) -> list[EngineOutput]:
        """End the requests in ``failed`` (request id -> what failed) alone: each is freed and
        its output of this step replaced by a finished one with finish_reason "error" and the
        message; every other request's output stays as it is."""
        kept = [r for r in results if r.request_id not in failed]
        for rid, msg in failed.items():
            parent, index = self._parent.get(rid, (rid, 0))
            prev = next((r for r in results if r.request_id == rid), None)
            self.scheduler.abort(rid)  # step()'s loop over finished outputs does the rest
            kept.append(EngineOutput(rid, [], finished=True, finish_reason="error",
                                     stop_reason=msg, error=msg,
                                     num_prompt_tokens=prev.num_prompt_tokens if prev else 0,
                                     parent_request_id=parent, index=index))
        return kept

    def _count_finish(self, reason: str) -> None:
        self.finished_reasons[reason] = self.finished_reasons.get(reason, 0) + 1

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def vocab_size(self) -> int:
        return int(self.plan.spec.vocab_size)

    @property
    def block_size(self) -> int:
        return int(self.kv_cache_manager.block_size)

    # -- introspection -------------------------------------------------------------------
    def compute_paths(self) -> dict[str, str]:
        """Which compute path each part of this engine takes on this CPU (packed linear,
        bfloat16 compute, row buckets, native attention and layer ops:
        :func:`xllm_vmm.engine.paths.compute_paths`); logged once at start-up, in bench
        JSON."""
        from xllm_vmm.engine.paths import compute_paths

        model = getattr(self.worker, "model", None)
        runner = getattr(self.worker, "runner", None)
        return compute_paths(model, getattr(runner, "backend", None))

    @property
    def sizing(self) -> dict[str, Any]:
        """The plan this engine was sized by (``plan``'s JSON) plus the running cache's
        figures (``running``: the same quantities as built)."""
        from xllm_vmm.planner.report import plan_to_dict

        d = plan_to_dict(self.plan)
        cap = self.kv_cache_manager.capacity()
        d["running"] = {
            "mode": self.pool.mode.value,
            "kv_capacity_tokens": cap.total_tokens,
            "kv_capacity_blocks": dict(cap.total_blocks),
            "block_size": cap.block_size,
            "arena_bytes": self.pool.stats().reserved_bytes,
            "max_model_len": self.max_model_len,
            "weights_in_pool": bool(getattr(self.weights, "vmm", False)),
        }
        return d

    def stats(self) -> dict[str, Any]:
        """Counters and gauges for ``/metrics`` (vLLM's names where they exist)."""
        s = self.scheduler
        kv = self.kv_cache_manager.stats()
        ps = self.pool.stats()
        return {
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "num_preemptions": s.num_preemptions,
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "request_success": dict(self.finished_reasons),
            "prefix_cache_queries": kv["prefix_query_tokens"],
            "prefix_cache_hits": kv["prefix_hit_tokens"],
            "kv_cache_usage_perc": kv["usage"],
            "kv_mapped_bytes": kv["mapped_bytes"],
            "kv_live_blocks": kv["live_blocks"],
            "kv_cached_blocks": kv["cached_blocks"],
            "pool_mapped_bytes": ps.mapped_bytes,
            "pool_held_bytes": ps.held_bytes,
            "pool_tenant_mapped_bytes": dict(ps.per_tenant_mapped_bytes),
            "execution_peak_bytes": ps.execution_peak_bytes,
            "observed_execution_peak_bytes": s.execution_peak_bytes,
            "live_budget_bytes": ps.budget_left_bytes,
            "capacity_finished": s.capacity_finished,
            "steps": self.num_steps,
            "sleeping": self.is_sleeping(),
            "kvcache": kv,
            **({"distributed": self.distributed.stats()}  # several workers
               if getattr(self, "distributed", None) is not None else {}),
            **({"spec_decode": self.speculator.metrics()}  # MTP speculation
               if self.speculator is not None else {}),
        }

    def warm_up(self, budget_s: float | None = None) -> Any:
        """Compile the model's CPU products for every row bucket up to ``max_tokens_per_batch``
        within ``budget_s`` seconds (default: ``XLLM_VMM_WARMUP_SECONDS`` or 10), so the first
        requests do not pay for it (:mod:`xllm_vmm.engine.warmup`); returns the
        :class:`~xllm_vmm.engine.warmup.WarmupReport`. Call before serving; no request may
        be running (it runs on the calling thread and touches no KV or request state). A draft
        model's products are not warmed."""
        from xllm_vmm.engine.warmup import WarmupReport, budget_from_env, warm_products

        budget = budget_from_env() if budget_s is None else float(budget_s)
        model = getattr(self.worker, "model", None)
        if model is None:
            return WarmupReport(0, 0, 0, 0.0, False, "the model runs in worker processes")
        return warm_products(model, self.scheduler.max_tokens_per_batch, budget)

    # -- sleep / wake / fork -------------------------------------------------------------
    def _controller(self) -> Any:
        if self._sleeper is None:
            from xllm_vmm.weights import SleepController

            self._sleeper = SleepController(self.weights if getattr(self.weights, "vmm", False)
                                            else None, [self.kv_cache_manager])
        return self._sleeper

    def sleep(self, level: int = 1, drain: bool = False, timeout: float | None = None) -> dict:
        """Release device memory: the KV cache (cached prefixes go to the host tier when there
        is one) and the weights (level 1: host copy kept; 2: dropped). Refused
        (:class:`~xllm_vmm.weights.SleepRefused`) while requests run, unless ``drain``: then
        the engine steps until they finish (at most ``timeout`` seconds). Needs weights in the
        pool (W-02: :class:`~xllm_vmm.weights.WeightVmmRequired`)."""
        from xllm_vmm.weights import SleepRefused

        ctl = self._controller()
        if self.has_unfinished_requests():
            if not drain:
                raise SleepRefused(self.num_running + self.num_waiting)
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.has_unfinished_requests():
                if deadline is not None and time.monotonic() >= deadline:
                    raise SleepRefused(self.num_running + self.num_waiting)
                self.step()
        dist = getattr(self, "distributed", None)  # several workers: a barrier
        before = dist.refresh() if dist is not None else None
        rep = ctl.sleep(level, busy=0)
        out = {"level": rep.level, "state": rep.state, "bytes_freed": rep.bytes_freed,
               "kv_bytes_freed": rep.tenants_bytes_freed, "host_bytes_freed": rep.host_bytes_freed,
               "seconds": rep.seconds}
        return out if dist is None else dist.sleep_all(level, out, before, undo=ctl.wake_up)

    def wake_up(self) -> dict:
        """Map the weights back (host copy or checkpoint) and allow KV pages again. Idempotent."""
        rep = self._controller().wake_up()
        out = {"state": rep.state, "source": rep.source, "bytes_mapped": rep.bytes_mapped,
               "seconds": rep.seconds}
        dist = getattr(self, "distributed", None)  # several workers: a barrier
        return out if dist is None else dist.wake_all(out)

    def is_sleeping(self) -> bool:
        return self._sleeper is not None and self._sleeper.is_sleeping()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the device blocks dropped."""
        return self.kv_cache_manager.reset_prefix_cache()

    def fork(self) -> LLMEngine:
        """Another engine over the same weight pages (no byte copied or mapped: weights VMM,
        W-02) with its own pool for its KV cache on the same driver, the same flags and plan.
        Several workers: forked on every worker before it returns, over the worker set's one
        command channel (``engine.distributed.runtime``; ``fork.distributed.fork_workers``:
        the bytes it added on each rank)."""
        from xllm_vmm.weights import require_weight_vmm

        parent = require_weight_vmm(self.weights, "fork")
        dist = getattr(self, "distributed", None)  # several workers: every worker forks
        view = dist.fork_view() if dist is not None else None  # a worker set's view
        w = parent.fork()
        sized = _Sized(self.config, self.plan, self.max_model_len, self.warnings)
        try:
            child = _build(type(self), sized, self.model_dir, self._opts, self.is_demo,
                           weights=w, driver=self.driver, dist=view)
        except BaseException:
            w.close()  # the build does not own the forked instance: give it back
            raise
        self._forks.append(child)
        return child

    _opts: dict[str, Any] = {}
    _heap_frozen = False
    _prompt_lps_asked = False
    """Some request ever asked for prompt log-probabilities (then every step runs
    ``PromptLogprobs.prepare``)."""

    def shutdown(self) -> None:
        """Abort everything and release the worker, the cache, the weights, the pool and the
        driver; forks of this engine are shut down first (they use its driver; a fork's own
        shutdown leaves the driver to its parent). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._heap_frozen:  # before the closes below: their garbage must be collectable
            self._heap_frozen = False
            _thaw_heap()
        for child in self._forks:  # they live on this engine's driver
            child.shutdown()
        self._forks.clear()
        for rid in list(self.scheduler.requests):
            self.scheduler.abort(rid)
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()
        if self.draft is not None:  # its views over the draft group go before the cache
            self.draft.close()
            self.draft = self.speculator = None
        self.kv_cache_manager.close()
        wclose = getattr(self.weights, "close", None)
        if wclose is not None:
            wclose()
        failure = getattr(getattr(self, "distributed", None), "failure", None)
        if failure is not None:
            # A lost worker's error was raised out of a step: its traceback's frames hold that
            # step's tensors (views over the pool), which would keep the pool from releasing.
            failure.__traceback__ = None
            failure.__context__ = failure.__cause__ = None
            gc.collect()
        self.pool.close()
        if self._owns_driver:
            self.driver.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# -- construction helpers ------------------------------------------------------------------
class _Sized:
    def __init__(self, cfg: Any, plan: Any, max_model_len: int, warnings: list) -> None:
        self.cfg, self.plan, self.max_model_len, self.warnings = cfg, plan, max_model_len, warnings


def _device_kind(cfg: Any) -> tuple[str, int]:
    """(driver kind, device index) from the ``devices`` flag (one device: tp_size 1)."""
    from xllm_vmm.config import ConfigError, Finding

    text = str(cfg["devices"] or "").strip().lower()
    if text in ("", "auto", "cpu"):
        return "host", 0
    parts = [p.strip() for p in text.split(",") if p.strip()]
    from xllm_vmm.engine.distributed.topology import spawns_per_device

    several = len(parts) > 1 and spawns_per_device(cfg)  # rank 0 here, one worker each
    if (len(parts) != 1 and not several) or int(cfg["tp_size"]) != 1:
        raise ConfigError([Finding(
            "CFG-CONFLICT", "error", f"devices={cfg['devices']}: this engine runs one worker "
            "(tp_size=1, one device); several workers come with tensor parallelism",
            flags={"devices": cfg["devices"], "tp_size": cfg["tp_size"]},
            hint="list one device, e.g. devices=cpu or devices=cuda:0")])
    kind, _, idx = parts[0].partition(":")
    return {"cuda": "cuda", "npu": "acl"}.get(kind, kind), int(idx or 0)


def _parse_memory(value: Any) -> int:
    from xllm_vmm.config import ConfigError, Finding
    from xllm_vmm.config.values import parse_size

    try:
        n = value if isinstance(value, int) and not isinstance(value, bool) else parse_size(str(value))
    except ValueError:
        n = -1
    if n <= 0:
        raise ConfigError([Finding("CFG-TYPE", "error", f"device_memory={value!r} is not a "
                                   "positive size", flags={"device_memory": value},
                                   hint="give bytes or a size such as 2GiB")])
    return int(n)


def _size(cfg: Any, model_dir: str, opts: dict[str, Any]) -> _Sized:
    """Rules + plan (module docstring, steps 1 and 2)."""
    from xllm_vmm.config import ConfigError, Finding
    from xllm_vmm.models import ModelConfigError, load_model_spec
    from xllm_vmm.planner.checks import Memory, check_sizing, host_memory

    try:
        spec = load_model_spec(model_dir)
    except ModelConfigError as e:
        raise ConfigError([Finding("CFG-MODEL", "error",
                                   f"model {model_dir!r}: {getattr(e, 'message', None) or e}",
                                   flags={"model": model_dir}, hint=getattr(e, "hint", ""))]) from None
    kind, index = _device_kind(cfg)
    if opts.get("device_memory") is not None:
        total = _parse_memory(opts["device_memory"])
    elif kind == "host":
        total = host_device_memory(spec)
    else:  # a real device: its total memory
        from xllm_vmm.vmm import open_driver

        d = open_driver(kind, device_index=index)
        try:
            total = d.mem_info().total
        finally:
            d.close()
    user_len = opts.get("max_model_len")
    if user_len is not None and (not isinstance(user_len, int) or user_len < 2):
        raise ConfigError([Finding("CFG-TYPE", "error", f"max_model_len={user_len!r} must be an "
                                   "integer of at least 2 tokens", flags={"max_model_len": user_len})])
    ctx = user_len or spec.max_position_embeddings or 2048
    dev = Memory(total, "device_memory") if total is not None else None
    host = host_memory()

    def plan_for(length: int):
        try:
            return check_sizing(cfg, device=dev, host=host, spec=spec, always_plan=True,
                                context_len=length, runtime_overhead_bytes=0 if kind == "host" else None,
                                device_name="cpu" if kind == "host" else kind)
        except ModelConfigError as e:
            raise ConfigError([Finding("CFG-CONFLICT", "error", str(e), hint=getattr(e, "hint", ""))]) from None

    checked = plan_for(ctx)
    report = checked.report
    from xllm_vmm.planner.sizing import SERVE_ERROR_RULES

    errors = [f for f in report.findings if f.severity == "error" or f.id in SERVE_ERROR_RULES]
    if errors:
        raise ConfigError(errors)
    plan = checked.plan
    if (user_len is None and plan is not None and not plan.fits and plan.max_context_len
            and any(r.code == "CONTEXT" for r in plan.reasons)):
        ctx = min(ctx, plan.max_context_len)
        checked = plan_for(ctx)
        plan = checked.plan
    if plan is None or plan.layout is None or not plan.fits:
        reasons = [r for r in (plan.reasons if plan is not None else []) if r.severity == "error"]
        raise ConfigError([Finding(r.code, "error", r.message, hint=r.hint) for r in reasons]
                          or [Finding("MEMORY", "error", "the configuration cannot be sized")])
    warnings = [f for f in report.findings if f.severity == "warning"]
    warnings += _host_memory_warnings(kind, total, cfg)
    return _Sized(report.resolved, plan, ctx, warnings)


def _host_memory_warnings(kind: str, device_total: int | None, cfg: Any) -> list:
    """``HOST-MEM`` warnings: an emulated device (the host driver) or a pool quota
    (``max_cache_size``) larger than this host's memory is accepted (the pool maps lazily and
    may never need it all) but cannot be filled: said once at start-up with both figures."""
    from xllm_vmm.config.findings import Finding
    from xllm_vmm.vmm import sysmem

    def format_size(n: int) -> str:
        return f"{n / 2 ** 30:.1f} GiB"

    read_host_memory = sysmem.host_memory

    try:
        host = read_host_memory()
    except OSError:
        return []
    if host.total <= 0:
        return []
    out = []
    where = (f"this host has {format_size(host.total)} of memory ({format_size(host.free)} "
             "available; /proc/meminfo and the cgroup limit)")
    if kind == "host" and device_total is not None and device_total > host.total:
        out.append(Finding(
            "HOST-MEM", "warning",
            f"device_memory={format_size(device_total)} emulates a device in host memory, but "
            f"{where}: the pool may be sized past what it can ever map",
            flags={"device_memory": device_total},
            hint=f"give --device-memory at most {format_size(host.total)}"))
    quota = cfg["max_cache_size"]
    if kind == "host" and quota and quota > host.total:
        out.append(Finding(
            "HOST-MEM", "warning",
            f"max_cache_size={int(quota)} bytes ({format_size(int(quota))}) is more than "
            f"{where}: the quota can never be reached",
            flags={"max_cache_size": quota},
            hint=f"give --max_cache_size at most {host.total}"))
    return out


def _build(cls: type, sized: _Sized, model_dir: str, opts: dict[str, Any], is_demo: bool,
           *, weights: Any = None, driver: Any = None, dist: Any = None) -> LLMEngine:
    """Driver → pool → weights → KV cache manager → worker (module docstring, step 3).
    ``dist``: a fork's runtime across several workers (its parent's ``fork_view``)."""
    from xllm_vmm.engine.tokenizer import Tokenizer
    from xllm_vmm.engine.worker import Worker, resolve_dtype
    from xllm_vmm.kvcache import build_kv_cache_manager
    from xllm_vmm.pool import BudgetConfig, VmmPool
    from xllm_vmm.pool.budget import BudgetMode
    from xllm_vmm.vmm import open_driver
    from xllm_vmm.weights import load_weights

    cfg, plan = sized.cfg, sized.plan
    wp = plan.workers[0]
    vmm_kv = bool(cfg["enable_vmm_kvcache"])
    vmm_w = bool(cfg["enable_vmm_weights"])
    elastic = vmm_kv and bool(cfg["vmm_elastic"])
    kind, index = _device_kind(cfg)
    from xllm_vmm.engine.distributed import runtime_for  # several workers; else None

    if dist is None:
        dist = runtime_for(cfg, opts, model_dir=model_dir, kind=kind, index=index,
                           fork=weights is not None or driver is not None)
    owns = driver is None
    if driver is None:
        total = plan.inputs.device_memory_bytes
        if dist is not None:
            total = dist.device_memory(total)
        outside = wp.weights_bytes if (kind == "host" and not vmm_w) else 0
        driver = open_driver(kind, device_index=index,
                             device_memory=total - outside if kind == "host" else None)
    mode = BudgetMode.ELASTIC if elastic else (BudgetMode.FIXED if vmm_kv else BudgetMode.PHYSICAL)
    page = driver.granularity
    arena = wp.arena_bytes if vmm_kv else wp.kv_pool_bytes
    if vmm_w and weights is None and not plan.inputs.shared_pool:
        arena += -(-wp.weights_bytes // page) * page
    arena = max(arena, page)
    budget = BudgetConfig(mode=mode, max_memory_utilization=float(cfg["max_memory_utilization"]),
                          max_cache_size=int(cfg["max_cache_size"]),
                          reserve_bytes=int(cfg["vmm_memory_reserve_bytes"]),
                          execution_peak_bytes=wp.execution_peak_bytes,
                          outside_bytes=wp.mtp_embedding_bytes)  # plan's MTP slots (AD-03)
    pool = mgr = worker = draft = None
    own_weights = weights is None
    try:
        pool = VmmPool(driver, budget, arena)
        from xllm_vmm.engine.models.config import ModelConfig

        dtype = resolve_dtype(opts.get("dtype", "auto"), ModelConfig.from_dir(model_dir).dtype)
        if weights is None:
            weights = load_weights(model_dir, pool=pool if vmm_w else None, dtype=dtype,
                                   shard=dist.tp.shard_hook if dist is not None else None,
                                   progress=opts.get("progress"))
        from xllm_vmm.kvcache import fit_tokens

        if elastic:  # the virtual size: the plan's arena for the KV cache
            kv_arena = wp.arena_bytes - (wp.weights_bytes if plan.inputs.shared_pool else 0)
            max_tokens = fit_tokens(plan.layout, page, kv_arena)
        else:
            # fixed: the plan's capacity; physical: the plan counts blocks, the cache maps whole
            # pages per tensor. Both are capped by what the pool holds now: the plan counts
            # weights in the pool by their bytes, the pool by whole pages (< 1 page per tenant).
            planned = wp.kv_capacity_tokens if vmm_kv else \
                min(wp.kv_capacity_tokens, fit_tokens(plan.layout, page, wp.kv_pool_bytes))
            max_tokens = min(planned, fit_tokens(plan.layout, page, pool.static_capacity_bytes()))
            if max_tokens < 1 and weights is not None:  # a fork (its parent took the budget)
                raise ForkDoesNotFit(
                    "fork: no room left on the device for the fork's own KV cache: the "
                    "parent's " + ("fixed KV cache (vmm_elastic=false)" if vmm_kv else
                                   "physical KV cache (enable_vmm_kvcache=false)") +
                    " holds the whole KV budget; set max_cache_size to leave room for a fork, or use "
                    "enable_vmm_kvcache=true with vmm_elastic=true (the pool then shares the "
                    "device between the parent's and the fork's KV)")
        mgr = build_kv_cache_manager(
            pool, plan.layout, enable_prefix_cache=bool(cfg["enable_prefix_cache"]),
            host_blocks_factor=float(cfg["host_blocks_factor"]) if vmm_kv else 0.0,
            max_tokens=max_tokens, hash_seed=int(cfg["xxh3_128bits_seed"]))
        worker = Worker.create(model_dir, pool=pool, kv_cache=mgr.cache, dtype=dtype,
                               weights=weights,
                               attention_backend=opts.get("attention_backend", "auto"),
                               **({"tp": dist.tp} if dist is not None else {}))
        if dist is not None:
            worker = dist.attach(mgr, worker, pool)
        draft = _load_draft(cfg, plan, mgr, worker, dtype, dist)
        tok = Tokenizer.from_dir(model_dir)
    except BaseException:
        # undo in reverse; a failure while undoing must not hide the error that matters
        import contextlib
        import gc

        steps = [getattr(dist, "abort", None), getattr(draft, "close", None),
                 getattr(worker, "close", None),
                 getattr(mgr, "close", None),
                 getattr(weights, "close", None) if own_weights else None]
        for close in steps:
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
        worker = mgr = weights = draft = None
        gc.collect()  # tensor views over the arena must be gone before it is released
        for close in (getattr(pool, "close", None), driver.close if owns else None):
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
        raise
    seed = opts.get("seed")
    if seed is None:
        seed = int(cfg["random_seed"])
    from xllm_vmm.models.gguf import served_name

    name = str(cfg["model_id"] or "") or ("xllm-vmm-demo" if is_demo else
                                          served_name(model_dir) or Path(model_dir).name)
    eng = cls(model_dir=model_dir, model_name=name, config=cfg, plan=plan, driver=driver,
              pool=pool, weights=weights, mgr=mgr, worker=worker, tokenizer=tok,
              max_model_len=sized.max_model_len, seed=None if seed < 0 else seed,
              warnings=sized.warnings, is_demo=is_demo, owns_driver=owns, draft=draft)
    eng._opts = dict(opts)
    eng.distributed = dist
    _freeze_heap()
    eng._heap_frozen = True
    return eng


def _load_draft(cfg: Any, plan: Any, mgr: Any, worker: Any, dtype: Any, dist: Any) -> Any:
    """The MTP draft module for ``num_speculative_tokens > 0`` (None otherwise), over the
    ``"draft"`` group of ``mgr``'s cache (the plan's layout has it: SD-01).

    Refused with a :class:`ConfigError` naming the flags: an algorithm other than MTP (Eagle3
    with virtual KV and speculation with PD disaggregation are refused before, by SD-02/SD-03
    among the rules; Suffix, DFlash and Eagle3 drafts have no implementation here), several
    workers, a hybrid (linear-state) target, a draft directory that is not an MTP export or
    does not match the target (hidden size, vocabulary). The draft's weights are ordinary
    tensors (not in the pool): sleep and fork leave them as they are."""
    from xllm_vmm.config import ConfigError, Finding

    k = int(cfg["num_speculative_tokens"])
    if k <= 0:
        return None
    names = ("num_speculative_tokens", "speculative_algorithm", "draft_model")
    flags = {n: cfg[n] for n in names}

    def refuse(message: str, hint: str) -> ConfigError:
        return ConfigError([Finding("CFG-CONFLICT", "error", message, flags=flags, hint=hint)])

    alg = str(cfg["speculative_algorithm"]).strip()
    if alg.upper() != "MTP":
        raise refuse(f"speculative_algorithm={alg}: this engine runs MTP speculative decoding "
                     "only (a co-located draft_model exported by export_mtp.py)",
                     "use --speculative_algorithm=MTP with --draft_model, or "
                     "--num_speculative_tokens=0")
    if dist is not None:
        raise refuse("MTP speculative decoding runs with one worker (tp_size=1) in this "
                     "engine", "set --num_speculative_tokens=0, or one device")
    from xllm_vmm.engine.linear_state import needs_linear_state

    if needs_linear_state(worker):
        raise refuse("MTP speculative decoding with a hybrid linear-attention target is not "
                     "supported (its linear state cannot roll back rejected drafts)",
                     "set --num_speculative_tokens=0")
    if "draft" not in mgr.group_names:
        raise refuse(f"the plan's cache layout has no draft group (groups: {mgr.group_names}); "
                     "the draft_model directory was not read as a model",
                     "pass --draft_model=<the MTP export directory with its config.json>")
    from xllm_vmm.engine.spec_decode.mtp import MtpDraft
    from xllm_vmm.models import ModelConfigError

    draft_dir = str(Path(str(cfg["draft_model"])).expanduser())
    try:
        draft = MtpDraft.load(draft_dir, mgr.cache, dtype=dtype)
    except (ModelConfigError, ValueError, OSError) as e:
        raise refuse(f"draft_model {draft_dir!r}: {getattr(e, 'message', None) or e}",
                     getattr(e, "hint", "") or "pass an MTP draft directory (export_mtp.py "
                     "format)") from None
    tcfg = getattr(getattr(worker, "model", None), "config", None)
    if tcfg is not None:
        bad = [(f, getattr(draft.config, f), getattr(tcfg, f)) for f in ("hidden_size", "vocab_size")
               if getattr(draft.config, f, None) != getattr(tcfg, f, None)]
        if bad:
            draft.close()
            f, dv, tv = bad[0]
            raise refuse(f"draft_model {draft_dir!r}: its {f} is {dv}, the target's is {tv}",
                         "pass the MTP draft exported from this target")
    return draft


__all__ = ["DEFAULT_HOST_DEVICE_MEMORY", "ENGINE_OPTIONS", "HONOURED_FLAGS", "LLMEngine",
           "child_request_id"]
