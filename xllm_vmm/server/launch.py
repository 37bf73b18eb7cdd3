"""Run the application with uvicorn: bind, print the ready line, stop gracefully.

Shutdown (SIGINT/SIGTERM, or ``RunningServer.stop``): uvicorn stops accepting connections; the
fronts refuse new requests (503) and running ones get ``drain_timeout`` seconds to finish; what
is left is cancelled (its blocks freed); then each engine shuts down and releases its pool
(no mappings, memfds or threads left behind). A second signal cancels at once.

The event loop is uvloop's when it is installed (as vLLM's server runs; the ``server`` extra
lists it) and asyncio's otherwise, or with ``XLLM_VMM_EVENT_LOOP=asyncio``; uvicorn parses HTTP
with httptools when installed (else h11). Every streamed chunk crosses the loop, so its cost per
wake-up and write is the server's share of the inter-token latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import threading
from typing import Callable, Optional

import uvicorn
from fastapi import FastAPI

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8010


EVENT_LOOP_ENV = "XLLM_VMM_EVENT_LOOP"


def loop_factory() -> Optional[Callable[[], asyncio.AbstractEventLoop]]:
    """uvloop's ``new_event_loop`` when uvloop is importable and ``$XLLM_VMM_EVENT_LOOP`` is
    not ``asyncio``; None (asyncio's default loop) otherwise. Any other value is an error
    naming the variable."""
    choice = os.environ.get(EVENT_LOOP_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"{EVENT_LOOP_ENV}={choice!r}: give auto, uvloop or asyncio")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError(f"{EVENT_LOOP_ENV}=uvloop but uvloop is not installed "
                             "(pip install uvloop, or unset it)") from None
        return None
    return uvloop.new_event_loop


def run_loop(main) -> object:
    """``asyncio.run(main)`` on the loop of :func:`loop_factory`."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


def _uvicorn(app: FastAPI, host: str, port: int) -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            lifespan="off", timeout_keep_alive=5, ws="none")
    server = uvicorn.Server(config)
    # Signals are ours (serve_async): uvicorn's own handling would wait for every open stream
    # without a bound before our drain could start.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    server.install_signal_handlers = lambda: None  # older uvicorn
    return server


def bind_socket(host: str, port: int):
    """A listening TCP socket on ``host:port`` (0: a free port). Raises ``OSError`` (the port
    is in use, the address is not this host's) before the server starts."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def bound_port(server: uvicorn.Server) -> int:
    for s in server.servers:
        for sock in s.sockets:
            return int(sock.getsockname()[1])
    raise RuntimeError("the server has no bound socket")


async def _shutdown_fronts(app: FastAPI, timeout: float) -> int:
    fronts = list(app.state.server.fronts.values())
    cancelled = 0
    for f in fronts:
        cancelled += await f.drain(timeout)
    for f in reversed(fronts):  # forks first: a fork's pool lives on its parent's driver
        await asyncio.to_thread(f.close)
    return cancelled


async def serve_async(app: FastAPI, host: str, port: int, *, drain_timeout: float,
                      on_ready: Optional[Callable[[str], None]] = None,
                      stop: Optional[asyncio.Event] = None, sock=None) -> int:
    """Serve until ``stop`` is set (or a signal arrives when this is the main thread); returns
    how many requests were cancelled at shutdown. ``sock``: a socket already listening on
    ``host:port`` (:func:`bind_socket`, taken before the model loaded); None binds here."""
    server = _uvicorn(app, host, port)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = []
    if threading.current_thread() is threading.main_thread():
        def _signal():
            if stop.is_set():  # a second signal: no more waiting for running requests
                server.force_exit = True
                for f in app.state.server.fronts.values():
                    f.hurry()
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, _signal)
                signals.append(sig)
    if sock is None:
        sock = bind_socket(host, port)  # an OSError (port in use) before anything runs
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # a bind error: raise it
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.02)
        url_host = host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if ":" in url_host:
            url_host = f"[{url_host}]"
        if signals:
            # The serving process (main thread): what was built up to here (the app, its
            # routes, uvicorn, the modules they imported) lives as long as the process, so it
            # leaves the collector's generations — a full collection would otherwise walk it
            # under load (the engine freezes its own objects the same way). Not in the test
            # servers on a thread: their objects are meant to be collected.
            gc.freeze()
        if on_ready is not None:
            on_ready(f"http://{url_host}:{bound_port(server)}")
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        # Refuse new work and let running requests finish while connections are still open.
        cancelled = await _shutdown_fronts(app, drain_timeout)
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=drain_timeout + 5)
        return cancelled
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if not task.done():
            server.force_exit = True
            server.should_exit = True
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, timeout=5)
        for f in reversed(list(app.state.server.fronts.values())):  # idempotent
            await asyncio.to_thread(f.close)


class RunningServer:
    """The application served on a background thread (tests and ``bench serve``):
    ``with RunningServer(app) as srv: srv.url``."""

    def __init__(self, app: FastAPI, host: str = DEFAULT_HOST, port: int = 0,
                 drain_timeout: float = 5.0):
        self.app = app
        self.host = host
        self.port = port
        self.drain_timeout = drain_timeout
        self.url: Optional[str] = None
        self.cancelled: Optional[int] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)

    def _run(self) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(url):
                self.url = url
                self._ready.set()

            self.cancelled = await serve_async(self.app, self.host, self.port,
                                               drain_timeout=self.drain_timeout, on_ready=ready,
                                               stop=self._stop)

        try:
            run_loop(main())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
        finally:
            self._ready.set()

    def start(self, timeout: float = 30.0) -> "RunningServer":
        self._thread.start()
        self._ready.wait(timeout)
        if self._error is not None:
            raise self._error
        if self.url is None:
            raise RuntimeError("the server did not start in time")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> "RunningServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
