"""The FastAPI application: OpenAI routes, service routes, admin routes, one error shape.

``build_app(front, settings)`` wires one :class:`~xllm_vmm.server.front.AsyncEngine` (more are
added by the admin route ``/fork``: each served under its own model name). Routes:

- ``/v1/completions``, ``/v1/chat/completions`` (streaming and not), ``/v1/models``,
  ``/tokenize``, ``/detokenize`` — guarded by the API key when one is set;
- ``/health`` (200, empty body; 503 while the engine failed or shuts down), ``/version``,
  ``/metrics`` — never guarded (probes and scrapers carry no key, as with vLLM);
- admin routes (``xllm_vmm.server.admin``) only with ``settings.enable_admin``, always guarded.

Every error is ``{"error": {"message", "type", "param", "code"}}`` (``errors.APIError``);
a request body that does not parse or validate is a 400 whose ``param`` names the field.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from xllm_vmm import __version__
from xllm_vmm.server.errors import APIError, from_validation
from xllm_vmm.server.front import AsyncEngine
from xllm_vmm.server.metrics import CONTENT_TYPE, Metrics


STATS_TIMEOUT_S = 5.0
"""Longest a ``/metrics`` scrape waits for the engine thread (it reads the statistics between
two steps); past it the scrape answers with the front's own series."""


DEFAULT_MAX_FORKS = 4
"""``--max-forks``'s default."""

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
"""``--max-request-bytes``'s default (vLLM's Rust frontend's body limit; its uvicorn frontend
has none)."""


TRIM_AFTER_BYTES = 256 * 1024
"""A refused request whose body was at least this large hands the heap's free pages back to
the system afterwards (:class:`BodyLimit`)."""
TRIM_INTERVAL_S = 2.0
"""At most one such trim per this many seconds (a trim walks the whole heap)."""


class _Trimmer:
    """glibc's ``malloc_trim(0)`` on a worker thread, at most once per ``TRIM_INTERVAL_S``.

    Parsing and tokenizing a megabytes-long prompt allocates its copies on whichever thread
    did the work; glibc keeps the freed pages in that thread's arena, so fifty refused 1 MB
    prompts left the process ~30 MB larger (2.9 GB when each was tokenized in full) for good.
    A trim after a large refused request gives them back. Not glibc: nothing to do."""

    def __init__(self) -> None:
        self._fn = None
        try:
            import ctypes

            self._fn = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            pass
        self._last = -TRIM_INTERVAL_S
        self._pending = False
        self.trims = 0

    def maybe(self) -> None:
        """Trim now, or once the interval is over when a trim ran less than it ago (the last
        of a burst of refusals is trimmed after too)."""
        import time

        if self._fn is None or self._pending:
            return
        loop = asyncio.get_running_loop()
        wait = self._last + TRIM_INTERVAL_S - time.monotonic()
        if wait > 0:
            self._pending = True
            loop.call_later(wait, self._run, loop)
        else:
            self._run(loop)

    def _run(self, loop) -> None:
        import time

        self._pending = False
        self._last = time.monotonic()
        self.trims += 1
        loop.run_in_executor(None, self._fn, 0)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is a 413 before the route parses it
    (``limit`` None: no limit); a refused request with a large body trims the heap after.

    A declared ``Content-Length`` over the limit is answered at once (nothing of the body is
    read: the connection is closed after the answer); a body without one is counted as it
    arrives and refused when it passes the limit, so no route ever holds more than ``limit``
    bytes of one request."""

    def __init__(self, app, limit: Optional[int]):
        self.app = app
        self.limit = int(limit) if limit else None
        self.trimmer = _Trimmer()

    def _error(self, size: Optional[int]) -> APIError:
        what = f"{size} bytes" if size is not None else f"more than {self.limit} bytes"
        return APIError(413, f"the request body is {what}; this server accepts at most "
                             f"{self.limit} bytes (--max-request-bytes): send a shorter prompt",
                        type="invalid_request_error")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = None
        for k, v in scope.get("headers") or ():
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = None
                break
        if self.limit is not None and declared is not None and declared > self.limit:
            resp = error_response(self._error(declared))
            resp.headers["connection"] = "close"
            return await resp(scope, receive, send)
        seen = 0
        status = [0]

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if self.limit is not None and seen > self.limit:
                    raise self._error(None)
            return msg

        async def sent(msg):
            if msg["type"] == "http.response.start":
                status[0] = int(msg.get("status", 0))
            await send(msg)

        try:
            await self.app(scope, limited, sent)
        finally:
            if seen >= TRIM_AFTER_BYTES and status[0] >= 400:
                self.trimmer.maybe()


@dataclass
class ServerSettings:
    """What the HTTP layer needs besides the engine. ``api_key``: the Bearer key (None: no
    key). ``enable_admin``: serve the admin routes. ``drain_timeout``: seconds running requests
    get to finish at shutdown before they are cancelled."""

    api_key: Optional[str] = None
    enable_admin: bool = False
    drain_timeout: float = 30.0
    #: largest request body accepted, in bytes (None or 0: no limit); a larger one is a 413
    #: answered from its Content-Length before any of it is read (or as soon as a chunked
    #: body passes the limit). 32 MiB by default, the body limit of vLLM's Rust frontend.
    max_request_bytes: Optional[int] = DEFAULT_MAX_REQUEST_BYTES
    #: most forks (``POST /fork``) one server makes: each is a second engine with its own KV
    #: cache and virtual memory, so an unbounded count is unbounded memory
    max_forks: int = DEFAULT_MAX_FORKS
    #: each model's cached (prefix) KV bytes are kept at most this (None: no bound), and a
    #: model idle this many seconds gives up all of them (None: never); ``kv_reclaim``
    max_cached_kv_bytes: Optional[int] = None
    cached_kv_ttl: Optional[float] = None


class Server:
    """The application state: the fronts by model name (the first is the default model)."""

    def __init__(self, front: AsyncEngine, settings: ServerSettings, metrics: Metrics):
        self.fronts: dict[str, AsyncEngine] = {front.name: front}
        self.default = front.name
        self.settings = settings
        self.metrics = metrics
        #: fork names reserved while their engine is being made (admin ``/fork``)
        self.forking: set[str] = set()

    def front_for(self, model: Optional[str]) -> AsyncEngine:
        """The front serving ``model`` (None or "" = the default); unknown names are a 400."""
        if model is None or model == "":
            return self.fronts[self.default]
        if not isinstance(model, str):  # an admin route's JSON body: any value may come
            raise APIError(400, f"model must be a string (a served model's name), not "
                                f"{model!r}"[:300], param="model")
        front = self.fronts.get(model)
        if front is None:
            raise APIError(400, f"model {model!r} is not served here; served: "
                                f"{', '.join(self.fronts)} (GET /v1/models)", param="model",
                           code="model_not_found")
        return front

    def check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), key):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                "with the key the server was started with (--api-key)",
                           code="invalid_api_key")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def build_app(front: AsyncEngine, settings: Optional[ServerSettings] = None,
              metrics: Optional[Metrics] = None) -> FastAPI:
    """The application over ``front`` (started here if it is not yet). The caller owns the
    fronts' shutdown (``server.close_all``, called by ``xllm_vmm.server.launch``)."""
    settings = settings or ServerSettings()
    if metrics is None:
        metrics = front.metrics or Metrics()
    front.metrics = front.metrics or metrics
    front.start()
    app = FastAPI(title="xllm-vmm", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    server = Server(front, settings, metrics)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(from_validation(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(APIError(exc.status_code, message))

    @app.get("/health")
    async def health():
        # Unhealthy = cannot serve again without an operator: the engine failed, or the
        # server shuts down. Sleeping or draining to sleep is a healthy, chosen state.
        front = server.fronts[server.default]
        err = front.availability_error()
        if err is not None and (front._closing or front._engine_error is not None):
            return error_response(err)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_route():
        snaps = {}
        for name, f in list(server.fronts.items()):
            try:  # a stuck or failing engine still gets its front-side series
                stats = await asyncio.wait_for(f.stats(), STATS_TIMEOUT_S)
            except (Exception, asyncio.TimeoutError):
                stats = {}
            snaps[name] = (stats or {}, {"sleeping": f.sleeping, "in_flight": f.num_in_flight,
                                         "kv_mapped_peak_bytes": f.kv_mapped_peak_bytes,
                                         "output_busy_seconds": f.output_busy_s,
                                         "output_tokens": f.output_tokens,
                                         "stream_busy_seconds": f.stream_busy_s,
                                         "step_cpu_seconds": f.step_cpu_s,
                                         "step_thread_cpu_seconds": f.step_thread_cpu_s,
                                         "step_runqueue_seconds": f.step_runqueue_s,
                                         "num_requests_running": f._num_running,
                                         "num_requests_waiting":
                                             f._num_waiting + f._pending_adds})
        return Response(server.metrics.render(snaps), media_type=CONTENT_TYPE)

    from xllm_vmm.server import admin, kv_reclaim, openai_routes

    openai_routes.register(app, server)
    kv_reclaim.install(app, server)
    if settings.enable_admin:
        admin.register(app, server)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


# The routes read their bodies themselves (one 400 shape for every parse or validation error),
# so FastAPI cannot see their models: the schema names them here.
_BODIES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
           "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's OpenAPI document (served at ``/openapi.json``, as vLLM serves it) with the
    request bodies of the OpenAI routes (the pydantic models of ``protocol``) and their error
    answers, so that clients and API fuzzers see what each route takes."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    from xllm_vmm.server import protocol

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["integer", "string", "null"]}}}}}
    schemas["Error"] = error
    for path, name in _BODIES.items():
        op = doc.get("paths", {}).get(path, {}).get("post")
        if op is None:
            continue
        model = getattr(protocol, name)
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[name] = body
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{name}"}}}}
        op.setdefault("responses", {})
        for status in ("400", "413", "503"):
            op["responses"][status] = {"description": "OpenAI-shaped error", "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, fields in _ADMIN_FIELDS.items():  # served with --enable-admin only
        for method, op in doc.get("paths", {}).get(path, {}).items():
            op["parameters"] = [{"name": n, "in": "query", "required": False,
                                 "schema": _ADMIN_TYPES[n]} for n in fields]
            if method == "post":
                op["requestBody"] = {"required": False, "content": {"application/json": {
                    "schema": {"type": "object", "properties": {
                        n: _ADMIN_TYPES[n] for n in fields}}}}}
            op.setdefault("responses", {})
            for status in ("400", "409", "503"):
                op["responses"][status] = {"description": "OpenAI-shaped error", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    app.openapi_schema = doc
    return doc


# What the admin routes read (query parameters, or a JSON object body: the body wins).
_ADMIN_TYPES = {"level": {"anyOf": [{"type": "integer", "enum": [1, 2]},
                                    {"type": "string", "enum": ["1", "2", "light", "deep"]}]},
                "drain": {"type": "boolean"}, "timeout": {"type": "number", "exclusiveMinimum": 0},
                "model": {"type": "string"}, "name": {"type": "string", "maxLength": 64}}
_ADMIN_FIELDS = {"/sleep": ("level", "drain", "timeout", "model"), "/wakeup": ("model",),
                 "/wake_up": ("model",), "/is_sleeping": ("model",),
                 "/reset_prefix_cache": ("model",), "/fork": ("name", "model"),
                 "/fork_master": ("name", "model"), "/vmm/status": ("model",)}
