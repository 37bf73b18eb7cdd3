"""Cached KV that is bounded, released when idle, and trimmed on demand.

The prefix cache keeps the blocks of finished requests (their pages stay mapped) until memory
pressure from the same model evicts them. Three ways give them back sooner, all through the
prefix cache's own eviction (:meth:`~xllm_vmm.kvcache.prefix.PrefixCache.evict`, exact LRU:
least recently released first; a block a request references or a transfer pins is never
given up) on the model's engine thread between two steps; an emptied slot's pages are
unmapped at once, so on an elastic pool the memory leaves the process:

- ``--max-cached-kv SIZE`` (``ServerSettings.max_cached_kv_bytes``): each model's cached KV
  bytes (the prefix cache's ``cached_bytes``) are brought back to at most SIZE once a second
  (:data:`TICK_S`), the oldest first;
- ``--cached-kv-ttl SECONDS`` (``ServerSettings.cached_kv_ttl``): a model with nothing in
  flight and no engine step for that long gives up every cached block (once per idle spell);
- ``POST /kvcache/trim`` (admin route; JSON or query ``model``, ``target``: the cached bytes to
  keep, a size such as ``64MiB``, default 0): trims now and answers per model what it did.

After a partial trim of an idle model the cache is compacted
(:meth:`~xllm_vmm.kvcache.manager.KVCacheManager.compact`), so the blocks kept fill as few
slots as they can. Every eviction counts in ``xllm_vmm_prefix_cache_evictions``; what each
way gave back is in ``/vmm/memory`` (``reclaim``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from fastapi import Request

from xllm_vmm.server.errors import APIError

_log = logging.getLogger(__name__)

TICK_S = 1.0
"""Seconds between two checks of the bound and the idle TTL."""


@dataclass
class ReclaimStats:
    """What one model's cached KV gave back, per way (blocks of the group evicted from, and
    the pool's held bytes given back); ``idle_seconds`` as last seen by the reclaimer."""

    bound_blocks: int = 0
    bound_released_bytes: int = 0
    ttl_blocks: int = 0
    ttl_released_bytes: int = 0
    trim_blocks: int = 0
    trim_released_bytes: int = 0
    idle_seconds: float = 0.0


def trim_engine(e: Any, target: int = 0) -> dict:
    """Evict cached blocks of engine ``e`` (on its thread) until its prefix cache holds at most
    ``target`` bytes or nothing more is evictable; with no request left the pool's ready
    handles go too (:meth:`~xllm_vmm.pool.pool.VmmPool.drain_ready`, as the manager does when
    it goes idle). Returns ``blocks_evicted``, ``cached_bytes_before/after``,
    ``kv_mapped_bytes_before/after`` and ``released_bytes`` (the pool's held bytes given back
    to the driver: 0 on a fixed or physical pool, whose pages stay backed)."""
    kvm = getattr(e, "kv_cache_manager", None)
    prefix = getattr(kvm, "prefix", None)
    if prefix is None:
        return {"blocks_evicted": 0, "cached_bytes_before": 0, "cached_bytes_after": 0,
                "kv_mapped_bytes_before": None, "kv_mapped_bytes_after": None,
                "released_bytes": 0, "prefix_cache": False}
    cache = kvm.cache
    pool = cache.pool
    geo = cache.geometry
    per_hash = sum(int(g.group.block_bytes) for g in geo.values()) or 1
    c0, m0, h0 = prefix.stats.cached_bytes, cache.active_bytes(), pool.held_bytes
    evicted = 0
    while True:
        cached = prefix.stats.cached_bytes
        if cached <= target:
            break
        g = max(prefix.group_names, key=prefix.num_evictable)
        if not prefix.num_evictable(g):
            break
        n = -(-(cached - target) // per_hash)  # a usable hash has a block in every group
        got = prefix.evict(g, n, prefer_slot_emptying=False)
        if not got:
            break
        evicted += len(got)
    if evicted and not kvm.num_requests:
        if target > 0:
            kvm.compact()  # the blocks kept into as few slots as they fill
        pool.drain_ready()  # idle: no growth headroom held (as the manager does when idle)
    c1, m1, h1 = prefix.stats.cached_bytes, cache.active_bytes(), pool.held_bytes
    return {"blocks_evicted": evicted, "cached_bytes_before": c0, "cached_bytes_after": c1,
            "kv_mapped_bytes_before": m0, "kv_mapped_bytes_after": m1,
            "released_bytes": max(0, h0 - h1), "prefix_cache": True}


def _cached_bytes(e: Any) -> int:
    prefix = getattr(getattr(e, "kv_cache_manager", None), "prefix", None)
    return prefix.stats.cached_bytes if prefix is not None else 0


class Reclaimer:
    """The bound and the idle TTL of every served model (forks included), checked every
    :data:`TICK_S` by a task on the server's event loop, started by the first HTTP request
    (no request, nothing cached); and the counters of ``/kvcache/trim``."""

    def __init__(self, max_cached_bytes: Optional[int], ttl: Optional[float]) -> None:
        self.max_cached_bytes = max_cached_bytes
        self.ttl = ttl
        self.stats: dict[str, ReclaimStats] = {}
        self._seen: dict[str, tuple[int, float]] = {}  # model -> (engine steps, last active)
        self._idle_done: dict[str, int] = {}  # model -> steps when its idle trim ran
        self._task: Optional[asyncio.Task] = None

    @property
    def active(self) -> bool:
        return self.max_cached_bytes is not None or self.ttl is not None

    def for_model(self, name: str) -> ReclaimStats:
        st = self.stats.get(name)
        if st is None:
            st = self.stats[name] = ReclaimStats()
        return st

    def view(self, name: str) -> dict:
        """The ``reclaim`` entry of ``/vmm/memory`` for one model."""
        return {"max_cached_bytes": self.max_cached_bytes, "ttl_seconds": self.ttl,
                **asdict(self.for_model(name))}

    def start(self, server: Any) -> None:
        if self._task is None and self.active:
            self._task = asyncio.get_running_loop().create_task(self._run(server))

    async def _run(self, server: Any) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            for name, front in list(server.fronts.items()):
                try:
                    await self.tick(name, front)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a failing engine answers its own requests
                    _log.debug("cached KV reclaim of %s: %s", name, exc)

    async def tick(self, name: str, front: Any, now: Optional[float] = None) -> None:
        """One check of model ``name``: the idle TTL first (everything goes), else the bound."""
        if front.availability_error() is not None:  # asleep, draining, closing or failed
            return
        now = time.monotonic() if now is None else now
        steps = front.steps
        last_steps, last_active = self._seen.get(name, (steps, now))
        if front.num_in_flight or steps != last_steps:
            last_active = now
        self._seen[name] = (steps, last_active)
        st = self.for_model(name)
        st.idle_seconds = now - last_active
        if self.ttl is not None and st.idle_seconds >= self.ttl:
            if self._idle_done.get(name) != steps:
                self._idle_done[name] = steps
                r = await front.call(lambda e: trim_engine(e, 0))
                st.ttl_blocks += r["blocks_evicted"]
                st.ttl_released_bytes += r["released_bytes"]
            return
        bound = self.max_cached_bytes
        if bound is not None:
            def bounded(e):
                return trim_engine(e, bound) if _cached_bytes(e) > bound else None

            r = await front.call(bounded)
            if r is not None:
                st.bound_blocks += r["blocks_evicted"]
                st.bound_released_bytes += r["released_bytes"]


class _StartOnFirstRequest:
    """ASGI middleware: the first HTTP request starts the reclaimer's task on the server's
    loop (the servers run without a lifespan)."""

    def __init__(self, app, reclaimer: Reclaimer, server: Any) -> None:
        self.app = app
        self.reclaimer = reclaimer
        self.server = server

    async def __call__(self, scope, receive, send):
        if self.reclaimer._task is None:
            self.reclaimer.start(self.server)
        return await self.app(scope, receive, send)


def install(app: Any, server: Any) -> Reclaimer:
    """The server's :class:`Reclaimer` (``server.settings``' bound and TTL), as
    ``app.state.kv_reclaim``; its task starts with the first request when either is set."""
    s = server.settings
    r = Reclaimer(getattr(s, "max_cached_kv_bytes", None), getattr(s, "cached_kv_ttl", None))
    app.state.kv_reclaim = r
    if r.active:
        app.add_middleware(_StartOnFirstRequest, reclaimer=r, server=server)
    return r


def _target(value: Any) -> int:
    if value is None or value == "":
        return 0
    if isinstance(value, bool):
        value = "bad"
    if isinstance(value, int):
        n = value
    else:
        from xllm_vmm.config.values import parse_size

        try:
            n = parse_size(str(value).strip())
        except ValueError:
            n = -1
    if n < 0:
        raise APIError(400, f"target must be the cached KV bytes to keep, a size such as 64MiB "
                            f"or a byte count >= 0, not {value!r}", param="target")
    return n


def register_route(app: Any, server: Any) -> None:
    """``POST /kvcache/trim`` (called by :func:`xllm_vmm.server.admin.register`)."""
    from xllm_vmm.server.params import route_params as _params

    @app.post("/kvcache/trim")
    async def kvcache_trim(request: Request):
        server.check_key(request)
        p = await _params(request)
        target = _target(p.get("target"))
        model = p.get("model")
        names = [server.front_for(model).name] if model else list(server.fronts)
        reclaimer = getattr(app.state, "kv_reclaim", None)
        out = []
        for name in names:
            front = server.fronts[name]
            r = await front.call(lambda e: trim_engine(e, target))
            if reclaimer is not None:
                st = reclaimer.for_model(name)
                st.trim_blocks += r["blocks_evicted"]
                st.trim_released_bytes += r["released_bytes"]
            out.append({"model": name, "target": target, **r})
        return {"models": out}
