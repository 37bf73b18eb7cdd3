"""``GET /vmm/memory``: the live memory view of a running server as JSON (admin route, served
with ``--enable-admin``; behind the API key when one is set). ``xllm-vmm top`` reads it, and so
can a dashboard.

Every figure is read from the ledger that owns it, in one call on each model's engine thread
(between two steps, so one model's figures are one consistent snapshot): the pool's
``PoolStats`` (reserved, mapped, held bytes, pages, map/unmap counters, live budget), its
``BudgetConfig`` (the ``max_cache_size`` quota), the KV cache manager (live blocks, the
prefix cache's cached and evictable blocks and bytes, hit tokens), the host tier's pool, the
weights' own statistics and the front's request counts. Nothing is counted twice: where
``/metrics`` exports the same quantity, it is the same number (``tests/server/
test_memory_view.py``). Counters are cumulative (``map_calls``, ``unmap_calls``, pages mapped
and unmapped, prefix query and hit tokens): a client computes rates from two readings and
their ``time`` (seconds since the epoch, taken on the server).

The answer (bytes unless named otherwise; a figure the engine does not have is ``null``)::

    {"version": 1, "time": <s>, "default_model": NAME,
     "models": [{
        "name", "default": bool, "state": "awake"|"draining"|"sleeping",
        "sleep_level": 1|2|null,
        "reclaim": {"max_cached_bytes", "ttl_seconds", "idle_seconds", "bound_blocks",
                    "bound_released_bytes", "ttl_blocks", "ttl_released_bytes",
                    "trim_blocks", "trim_released_bytes"}  (``kv_reclaim``),
        "requests": {"running", "waiting", "in_flight"},
        "prefix_cache": {"enabled", "query_tokens", "hit_tokens", "hit_rate",
                         "cached_blocks", "cached_bytes", "evictable_blocks",
                         "evictable_bytes", "evictions"},
        "devices": [{
            "device": "cpu:0", "rank": 0, "memory_total_bytes", "memory_free_bytes",
            "pool": {"mode", "page_bytes", "reserved_bytes", "reserved_pages",
                     "mapped_bytes", "mapped_pages", "held_bytes", "ready_bytes",
                     "pages_in_use", "budget_left_bytes", "map_calls", "unmap_calls",
                     "pages_mapped_total", "pages_unmapped_total", "failed_maps",
                     "tenants": {TENANT: mapped bytes}},
            "quota": {"max_cache_size_bytes" (0: none), "used_bytes" (held),
                      "used_fraction" (null without a quota)},
            "weights": {"bytes", "mapped_bytes", "in_pool", "host_copy_bytes", "state",
                        "instances"},
            "kv": {"mapped_bytes", "active_bytes", "cached_bytes", "evictable_bytes",
                   "packed_floor_bytes", "live_blocks", "cached_blocks", "free_blocks",
                   "block_size"},
            "host_tier": {"enabled", "used_bytes", "capacity_bytes", "offload_bytes",
                          "restore_bytes"}}]}]}

``models`` is a list (the served model and its forks today, each with its own pool on the
same device); ``devices`` one entry per device the model runs on: rank 0 is this process's
pool; the other ranks of a worker set carry the figures their last status reported
(``mapped_bytes``, ``held_bytes``, ``budget_left_bytes``, the KV tenant's mapped bytes), the
rest ``null``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from fastapi import FastAPI, Request

VERSION = 1
"""The answer's schema version (``"version"``): bumped when a field changes meaning."""

READ_TIMEOUT_S = 5.0
"""Longest the route waits for one model's engine thread; past it that model's entry carries
``"error"`` and the front's own figures only."""


def _int(v: Any) -> Optional[int]:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _get(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, key, None)


def _block_bytes(kvm: Any) -> dict[str, int]:
    """Bytes of one block per cache group (every tensor of the group), from the cache's
    geometry: the figure the prefix cache's ``cached_bytes`` is counted with."""
    geo = getattr(getattr(kvm, "cache", None), "geometry", None) or {}
    return {g: int(x.group.block_bytes) for g, x in geo.items()}


def _kv(kvm: Any, kv: dict) -> tuple[dict, dict]:
    """The KV figures of one model (``kv``: the manager's ``stats()``) and its prefix cache's."""
    sizes = _block_bytes(kvm) if kvm is not None else {}
    live = cap = None
    if kvm is not None and sizes:
        cap = kvm.capacity()
        live = sum(cap.used_blocks[g] * b for g, b in sizes.items())
    prefix = getattr(kvm, "prefix", None)
    evictable_blocks = evictable_bytes = None
    ps = None
    if prefix is not None:
        ps = prefix.stats
        n = {g: prefix.num_evictable(g) for g in prefix.group_names}
        evictable_blocks = sum(n.values())
        evictable_bytes = sum(n[g] * sizes.get(g, 0) for g in n) if sizes else None
    cached_bytes = _int(kv.get("prefix_cached_bytes")) if kv else None
    out_kv = {
        "mapped_bytes": _int(kv.get("mapped_bytes")),
        "active_bytes": live,
        "cached_bytes": cached_bytes,
        "evictable_bytes": evictable_bytes,
        "packed_floor_bytes": _int(kv.get("packed_floor_bytes")),
        "live_blocks": _int(kv.get("live_blocks")),
        "cached_blocks": _int(kv.get("cached_blocks")),
        "free_blocks": _int(kv.get("free_blocks")),
        "block_size": _int(kv.get("block_size")),
    }
    out_prefix = {
        "enabled": bool(kv.get("prefix_enabled", prefix is not None)),
        "query_tokens": _int(kv.get("prefix_query_tokens")),
        "hit_tokens": _int(kv.get("prefix_hit_tokens")),
        "hit_rate": ps.hit_rate if ps is not None else None,
        "cached_blocks": _int(kv.get("cached_blocks")),
        "cached_bytes": cached_bytes,
        "evictable_blocks": evictable_blocks,
        "evictable_bytes": evictable_bytes,
        "evictions": _int(kv.get("prefix_evictions")),
    }
    return out_kv, out_prefix


def _host_tier(kvm: Any, kv: dict) -> dict:
    host = getattr(kvm, "host", None)
    pool = getattr(host, "pool", None)
    bb = _int(getattr(pool, "block_bytes", None))
    return {
        "enabled": host is not None,
        "used_bytes": pool.used * bb if pool is not None and bb is not None else 0,
        "capacity_bytes": pool.capacity * bb if pool is not None and bb is not None else 0,
        "offload_bytes": _int(kv.get("host_offload_bytes")),
        "restore_bytes": _int(kv.get("host_restore_bytes")),
    }


def _pool(ps: Any) -> dict:
    page = _int(_get(ps, "page_bytes"))
    reserved, mapped = _int(_get(ps, "reserved_bytes")), _int(_get(ps, "mapped_bytes"))
    return {
        "mode": _get(ps, "mode"),
        "page_bytes": page,
        "reserved_bytes": reserved,
        "reserved_pages": reserved // page if page and reserved is not None else None,
        "mapped_bytes": mapped,
        "mapped_pages": mapped // page if page and mapped is not None else None,
        **{k: _int(_get(ps, k)) for k in (
            "held_bytes", "ready_bytes", "pages_in_use", "budget_left_bytes", "map_calls",
            "unmap_calls", "pages_mapped_total", "pages_unmapped_total", "failed_maps")},
        "tenants": {str(t): int(v)
                    for t, v in (_get(ps, "per_tenant_mapped_bytes") or {}).items()},
    }


def _quota(budget: Any, held: Optional[int]) -> dict:
    cap = _int(getattr(budget, "max_cache_size", None))
    return {"max_cache_size_bytes": cap, "used_bytes": held,
            "used_fraction": held / cap if cap and held is not None else None}


def _weights(w: Any) -> dict:
    st = w.stats() if w is not None and hasattr(w, "stats") else {}
    return {"bytes": _int(st.get("weight_bytes")), "mapped_bytes": _int(st.get("mapped_bytes")),
            "in_pool": bool(getattr(w, "vmm", False)),
            "host_copy_bytes": _int(st.get("host_copy_bytes")), "state": st.get("state"),
            "instances": _int(st.get("instances"))}


def _device_name(driver: Any, rank: int) -> str:
    kind = getattr(driver, "device_kind", None) or "device"
    index = getattr(driver, "device_index", None)
    return f"{kind}:{index if index is not None else rank}"


def read_engine(e: Any) -> dict:
    """One model's figures, read on its engine thread (``AsyncEngine.call``): the engine's
    ``stats()`` and the ledgers behind it. Returns ``{"stats": engine stats, "devices": [..],
    "prefix_cache": {..}}``."""
    stats = dict(e.stats())
    pool = getattr(e, "pool", None)
    ps = stats.get("pool")
    if ps is None and pool is not None:
        ps = pool.stats()
    kvm = getattr(e, "kv_cache_manager", None)
    kv = stats.get("kvcache") or {}
    out_kv, prefix = _kv(kvm, kv)
    driver = getattr(pool, "driver", None) or getattr(e, "driver", None)
    info = driver.mem_info() if driver is not None and hasattr(driver, "mem_info") else None
    p = _pool(ps)
    dev0 = {"device": _device_name(driver, 0), "rank": 0,
            "memory_total_bytes": _int(getattr(info, "total", None)),
            "memory_free_bytes": _int(getattr(info, "free", None)),
            "pool": p, "quota": _quota(getattr(pool, "budget", None), p["held_bytes"]),
            "weights": _weights(getattr(e, "weights", None)), "kv": out_kv,
            "host_tier": _host_tier(kvm, kv)}
    devices = [dev0]
    dist = stats.get("distributed") or {}
    for w in (dist.get("workers") or [])[1:]:  # rank 0 is this process's pool, read above
        rank = int(w.get("rank", len(devices)))
        rp = {k: None for k in p}
        rp.update(mapped_bytes=_int(w.get("mapped_bytes")), held_bytes=_int(w.get("held_bytes")),
                  budget_left_bytes=_int(w.get("budget_left_bytes")),
                  tenants={"kv": _int(w.get("kv_mapped_bytes"))})
        devices.append({"device": f"rank:{rank}", "rank": rank, "memory_total_bytes": None,
                        "memory_free_bytes": None, "pool": rp,
                        "quota": _quota(getattr(pool, "budget", None), rp["held_bytes"]),
                        "weights": None, "kv": {"mapped_bytes": _int(w.get("kv_mapped_bytes"))},
                        "host_tier": None})
    return {"stats": stats, "devices": devices, "prefix_cache": prefix}


def _state(front: Any) -> str:
    if front.sleeping:
        return "sleeping"
    return "draining" if getattr(front, "_draining", False) else "awake"


def _requests(front: Any, stats: dict) -> dict:
    """Running and waiting as ``/metrics`` exports them: the engine's figure, else the
    front's (``vllm:num_requests_running`` / ``_waiting``)."""
    def pick(key: str, fallback: int) -> int:
        v = _int(stats.get(key))
        return v if v is not None else int(fallback)

    return {"running": pick("num_requests_running", getattr(front, "_num_running", 0)),
            "waiting": pick("num_requests_waiting", getattr(front, "_num_waiting", 0)
                            + getattr(front, "_pending_adds", 0)),
            "in_flight": int(front.num_in_flight)}


async def model_view(name: str, front: Any, default: bool, reclaim: Any = None) -> dict:
    entry: dict[str, Any] = {"name": name, "default": default, "state": _state(front),
                             "sleep_level": getattr(front, "_sleep_level", None),
                             "reclaim": reclaim.view(name) if reclaim is not None else None}
    try:
        got = await asyncio.wait_for(front.call(read_engine), READ_TIMEOUT_S)
    except (Exception, asyncio.TimeoutError) as exc:  # a stuck or failing engine
        entry.update(requests=_requests(front, {}), prefix_cache=None, devices=[],
                     error=f"the engine did not answer: {type(exc).__name__}: {exc}")
        return entry
    entry.update(requests=_requests(front, got["stats"]), prefix_cache=got["prefix_cache"],
                 devices=got["devices"])
    return entry


async def memory_view(server: Any, model: Optional[str] = None, reclaim: Any = None) -> dict:
    """The whole answer of ``GET /vmm/memory`` (module docstring); ``model``: that model only
    (an unknown name is the usual 400)."""
    fronts = list(server.fronts.items())
    if model:
        server.front_for(model)
        fronts = [(n, f) for n, f in fronts if n == model]
    models = list(await asyncio.gather(*(model_view(name, f, name == server.default, reclaim)
                                         for name, f in fronts)))
    return {"version": VERSION, "time": time.time(), "default_model": server.default,
            "models": models}


def register(app: FastAPI, server: Any) -> None:
    """Add ``GET /vmm/memory`` (called by :func:`xllm_vmm.server.admin.register`)."""

    @app.get("/vmm/memory")
    async def vmm_memory(request: Request):
        server.check_key(request)
        return await memory_view(server, request.query_params.get("model"),
                                 getattr(app.state, "kv_reclaim", None))
