"""Admin routes (served with ``--enable-admin``; always behind the API key when one is set).

Names are the engine's (xLLM: ``/sleep``, ``/wakeup``, ``/fork_master``) and vLLM's
(``/sleep?level=1|2``, ``/wake_up``, ``/is_sleeping``, ``/reset_prefix_cache``), so that RL
frameworks and autoscalers written for either work unchanged:

| route | does |
|---|---|
| ``POST /sleep`` (query or JSON: ``level`` 1/``light`` or 2/``deep``, ``drain``, ``timeout``, ``model``) | light sleep keeps the weights in host memory, deep sleep drops them; the KV cache's pages are unmapped either way. Refused (409) while requests run unless ``drain`` (new requests then get 503 until it sleeps); asleep already, the same or a lighter level answers ``already`` with the current level and a deeper one is refused (409 naming the current level: wake up first) |
| ``POST /wakeup``, ``POST /wake_up`` | map the weights back (light) or reload them (deep); idempotent |
| ``GET /is_sleeping`` | ``{"is_sleeping": bool}`` |
| ``POST /reset_prefix_cache`` | drop every cached block: ``{"blocks_dropped": n}`` |
| ``POST /fork``, ``POST /fork_master`` (JSON ``name``) | a second engine over the same weight pages, served under its own model name (several workers: forked on every worker, ``workers`` gives the bytes it added on each). At most ``--max-forks`` (default 4) forks per server, past it 409; ``name``: 1..64 letters, digits, ``._:/-`` |
| ``GET /vmm/status`` | pool, tenants, cache groups, prefix and host-tier statistics as JSON |
| ``POST /kvcache/trim`` (``model``, ``target``) | evict cached KV blocks (LRU) until each model (or ``model``) keeps at most ``target`` bytes (default 0: all); ``kv_reclaim`` |
| ``GET /vmm/memory`` (``model``) | the live memory view per model and device (``memory_view``; what ``xllm-vmm top`` shows) |

Sleep does not pull memory from under running work (DESIGN invariant 6): the front refuses or
drains first, then the engine sleeps between two steps on its own thread.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from fastapi import FastAPI, Request

from xllm_vmm.server.errors import APIError
from xllm_vmm.server.front import AsyncEngine
from xllm_vmm.server.params import route_params as _params

_LEVELS = {"1": 1, "light": 1, "2": 2, "deep": 2}


def _level(value: Any) -> int:
    level = _LEVELS.get(str(value).strip().lower()) if value is not None else 1
    if level is None:
        raise APIError(400, f"level must be 1 (light: weights kept in host memory) or 2 (deep: "
                            f"weights dropped, wakeup reloads them), not {value!r}",
                       param="level")
    return level


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise APIError(400, f"{name} must be true or false, not {value!r}", param=name)


def _timeout(value: Any) -> Optional[float]:
    if value is None:
        return None
    try:
        t = float(value)
    except (TypeError, ValueError):
        t = -1.0
    if not t > 0 or t != t:
        raise APIError(400, f"timeout must be a positive number of seconds, not {value!r}",
                       param="timeout")
    return t


FORK_NAME_MAX = 64
"""Longest model name a fork may take (characters)."""
_FORK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


def _check_fork_name(name: Any) -> None:
    """A fork's model name: 1..``FORK_NAME_MAX`` characters of letters, digits and ``._:/-``,
    starting with a letter or digit (it is a model id in requests, metrics labels and logs)."""
    if not isinstance(name, str) or not name:
        raise APIError(400, f"name must be a non-empty string, not {name!r}", param="name")
    if len(name) > FORK_NAME_MAX:
        raise APIError(400, f"name is {len(name)} characters; at most {FORK_NAME_MAX}",
                       param="name")
    if not _FORK_NAME.fullmatch(name):
        raise APIError(400, f"name {name!r} may hold only letters, digits and . _ : / - (and "
                            "start with a letter or digit)", param="name")


def _jsonable(obj: Any) -> Any:
    """Statistics (dicts, dataclasses, tuples) as JSON values."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return _jsonable(asdict(obj))
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return str(obj)


def register(app: FastAPI, server) -> None:
    def front(request: Request, params: dict) -> AsyncEngine:
        server.check_key(request)
        return server.front_for(params.get("model"))

    @app.post("/sleep")
    async def sleep(request: Request):
        p = await _params(request)
        f = front(request, p)
        return await f.sleep(_level(p.get("level")), drain=_bool(p.get("drain", False), "drain"),
                             timeout=_timeout(p.get("timeout")))

    async def wake(request: Request):
        p = await _params(request)
        f = front(request, p)
        return await f.wake_up()

    app.post("/wakeup")(wake)
    app.post("/wake_up")(wake)

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request):
        f = front(request, dict(request.query_params))
        return {"is_sleeping": bool(await f.call(lambda e: e.is_sleeping()))}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        p = await _params(request)
        f = front(request, p)
        return {"blocks_dropped": await f.reset_prefix_cache()}

    async def fork(request: Request):
        p = await _params(request)
        f = front(request, p)
        name = p.get("name") or f"{f.name}-fork{len(server.fronts) + len(server.forking)}"
        _check_fork_name(name)
        if name in server.fronts or name in server.forking:
            raise APIError(400, f"name {name!r} is already served; give another name",
                           param="name")
        limit = server.settings.max_forks
        made = len(server.fronts) - 1 + len(server.forking)
        if made >= limit:
            raise APIError(409, f"{made} fork(s) exist or are being made, the most this server "
                                f"allows (--max-forks {limit}): each fork is a second engine "
                                "with its own KV cache; retry after a restart with a higher "
                                "--max-forks", param="name")
        server.forking.add(name)  # reserved across the await: concurrent forks count it
        try:
            child = await f.call(lambda e: e.fork())
            forked = AsyncEngine(child, name=name, max_waiting=f.max_waiting,
                                 max_concurrent=f.max_concurrent, make_params=f.make_params,
                                 output_processor=type(f.processor)(child.tokenizer),
                                 metrics=f.metrics).start()
            server.fronts[name] = forked
        finally:
            server.forking.discard(name)
        dist = getattr(child, "distributed", None)  # several workers: bytes added per rank
        return {"model": name, "forked_from": f.name,
                **({"workers": dist.fork_workers} if dist is not None else {})}

    app.post("/fork")(fork)
    app.post("/fork_master")(fork)

    @app.get("/vmm/status")
    async def vmm_status(request: Request):
        f = front(request, dict(request.query_params))
        stats = await f.vmm_status()
        return {"model": f.name, "sleeping": f.sleeping, "in_flight": f.num_in_flight,
                "engine_steps": f.steps, "stats": _jsonable(stats),
                "models": list(server.fronts)}

    from xllm_vmm.server import kv_reclaim, memory_view

    memory_view.register(app, server)
    kv_reclaim.register_route(app, server)

