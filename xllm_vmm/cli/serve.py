"""``xllm-vmm serve``: the OpenAI-compatible server over the virtual-memory engine.

``xllm-vmm serve [--model DIR] [--FLAG=VALUE ...] [--config FILE.toml] [--config_json_file F]``
takes every engine flag in gflags syntax (so ``/path/to/xllm --model M --port P ...`` works with
the binary replaced), beside a few options of its own (:data:`OPTIONS`). Its command line is
parsed here, as ``check-config`` parses its own, and resolved by the same code
(:func:`xllm_vmm.config.inputs.resolve_inputs` with the environment): a rule violation is the
same finding as ``check-config`` prints, and exit 1, before anything loads.

Start-up, in order: configuration checked → the engine built (sized by the plan, weights loaded
into the pool under a progress display, KV cache, worker) → the sizing summary (the plan's
figures) and, once, the flags accepted without effect in this engine → the HTTP server bound
(``--host``, default 127.0.0.1 here where the engine's own default is every interface;
``--port``, default 8010) → ``xllm-vmm serve: ready at http://HOST:PORT`` on stdout.
SIGINT/SIGTERM stop it gracefully (:mod:`xllm_vmm.server.launch`).

Exit codes: 0 stopped by a signal after a clean shutdown, 1 configuration findings or a start-up
failure (a port in use, a model that cannot load), 2 usage errors. torch is imported only when
the engine is built.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Optional, TextIO

LOCAL_HOST = "127.0.0.1"
"""``--host``'s default here (the engine's own default is every interface)."""

USAGE = "xllm-vmm serve [--model DIR|FILE.gguf|demo] [--FLAG=VALUE]... [--config FILE.toml]... [OPTIONS]"

OPTIONS = [
    ("--model DIR|FILE.gguf|demo", "Hugging Face model directory or GGUF file to serve; demo: the "
                "embedded demo model; none: SmolLM2-135M-Instruct (fetched once, then cached)."),
    ("--host ADDR / --port N", "Engine flags: address (default 127.0.0.1 here) and port "
                               "(default 8010; 0 picks a free one)."),
    ("--config FILE", "TOML file of flags (repeatable; later files win)."),
    ("--config_json_file FILE", "The engine's JSON config file; its values override the "
                                "command line."),
    ("--api-key KEY", "Require 'Authorization: Bearer KEY' on the API and admin routes "
                      "(default $XLLM_VMM_API_KEY)."),
    ("--enable-admin", "Serve the admin routes: sleep, wakeup, fork, is_sleeping, "
                       "reset_prefix_cache, vmm/status."),
    ("--max-waiting-requests N", "Requests that may wait for the engine; more get 429 "
                                 "(default: no limit). --max_concurrent_requests bounds "
                                 "requests in flight (503)."),
    ("--drain-timeout S", "Seconds running requests get to finish at shutdown (default 30)."),
    ("--max-forks N", "Most forks the admin route /fork makes (default 4; each is a second "
                      "engine with its own KV cache)."),
    ("--max-request-bytes SIZE", "Largest request body, e.g. 4MiB (default 32MiB, vLLM's Rust "
                                 "frontend's limit; 0: none); larger ones get 413 at once."),
    ("--max-cached-kv SIZE", "Most cached (prefix) KV bytes each model keeps, e.g. 256MiB; "
                             "older cached blocks are released once a second (default: no "
                             "bound)."),
    ("--cached-kv-ttl S", "Seconds a model may idle before every cached KV block is released "
                          "(default: never). POST /kvcache/trim (admin) trims now."),
    ("--max-model-len N", "Context length in tokens (default: the model's, lowered to what the "
                          "KV cache can hold)."),
    ("--device-memory SIZE", "Memory of the (emulated, on the host driver) device, e.g. 4GiB."),
    ("--dtype auto|float32|bfloat16|float16", "Compute dtype (default auto: the model's)."),
    ("--no-env", "Ignore XLLM_VMM_* environment variables."),
    ("-h, --help", "Show this help (every engine flag: `xllm-vmm flags`)."),
]

_VALUE_OPTS = {"--config": "config", "--api-key": "api_key", "--api_key": "api_key",
               "--max-waiting-requests": "max_waiting", "--max_waiting_requests": "max_waiting",
               "--drain-timeout": "drain_timeout", "--drain_timeout": "drain_timeout",
               "--max-model-len": "max_model_len", "--max_model_len": "max_model_len",
               "--device-memory": "device_memory", "--device_memory": "device_memory",
               "--max-request-bytes": "max_request_bytes",
               "--max-forks": "max_forks", "--max_forks": "max_forks",
               "--max_request_bytes": "max_request_bytes", "--dtype": "dtype",
               "--max-cached-kv": "max_cached_kv", "--max_cached_kv": "max_cached_kv",
               "--cached-kv-ttl": "cached_kv_ttl", "--cached_kv_ttl": "cached_kv_ttl"}
_BOOL_OPTS = {"--enable-admin": "enable_admin", "--enable_admin": "enable_admin",
              "--no-env": "no_env", "--no_env": "no_env", "-h": "help", "--help": "help"}

# Flags that the server itself honours (the engine honours its own list, see
# xllm_vmm.engine.llm_engine). Every other explicitly set flag is validated and reported once
# as accepted without effect.
SERVE_FLAGS = frozenset({"model", "host", "port", "max_concurrent_requests", "config_json_file"})
# The flags the CPU engine honours (xllm_vmm.engine.llm_engine's docstring, and the worker set
# of xllm_vmm.engine.distributed: nnodes, node_rank, master_node_addr, tp_size); used until
# the engine publishes the list itself (llm_engine.HONOURED_FLAGS).
_ENGINE_FLAGS = frozenset({
    "block_size", "enable_vmm_kvcache", "vmm_elastic", "enable_vmm_weights",
    "enable_prefix_cache", "host_blocks_factor", "max_seqs_per_batch", "max_tokens_per_batch",
    "enable_chunked_prefill", "max_memory_utilization", "max_cache_size",
    "vmm_memory_reserve_bytes", "xxh3_128bits_seed", "random_seed", "devices", "model_id",
    "nnodes", "node_rank", "master_node_addr", "tp_size"})


class UsageError(Exception):
    pass


def parse_argv(argv: list[str]) -> dict:
    """serve's own options, and the catalogue flags in order (a non-bool flag written without
    ``=`` takes the next token as its value). A positional argument is a usage error."""
    from xllm_vmm.config.inputs import split_argv

    opts: dict[str, Any] = {"config": [], "flags": [], "api_key": None, "enable_admin": False,
                            "max_waiting": None, "drain_timeout": "30", "max_model_len": None,
                            "device_memory": None, "dtype": None, "no_env": False,
                            "help": False, "max_request_bytes": None, "max_forks": None,
                            "max_cached_kv": None, "cached_kv_ttl": None}
    try:  # the one argv splitter (xllm_vmm.config.inputs.split_argv)
        split = split_argv(argv, value_options=_VALUE_OPTS, switches=_BOOL_OPTS)
    except ValueError as err:
        raise UsageError(str(err)) from None
    for name, value in split.options:
        if name in _BOOL_OPTS:
            opts[_BOOL_OPTS[name]] = True
        elif _VALUE_OPTS[name] == "config":
            opts["config"].append(value)
        else:
            opts[_VALUE_OPTS[name]] = value
    opts["flags"] = split.flags
    if split.files:
        raise UsageError(f"unexpected argument {split.files[0]!r}: serve takes flags only (a "
                         "model is --model DIR; a TOML file is --config FILE)")
    opts["max_waiting"] = _int_opt("--max-waiting-requests", opts["max_waiting"], 0)
    opts["max_model_len"] = _int_opt("--max-model-len", opts["max_model_len"], 2)
    opts["max_forks"] = _int_opt("--max-forks", opts["max_forks"], 0)
    try:
        opts["drain_timeout"] = float(opts["drain_timeout"])
    except ValueError:
        opts["drain_timeout"] = -1.0
    if not 0 <= opts["drain_timeout"] <= 3600:
        raise UsageError("--drain-timeout must be a number of seconds in [0, 3600]")
    if opts["dtype"] is not None and opts["dtype"] not in ("auto", "float32", "bfloat16",
                                                           "float16"):
        raise UsageError(f"--dtype must be auto, float32, bfloat16 or float16, not "
                         f"{opts['dtype']!r}")
    opts["max_request_bytes"] = _size_opt("--max-request-bytes", opts["max_request_bytes"],
                                          "4MiB (0: no limit)")
    opts["max_cached_kv"] = _size_opt("--max-cached-kv", opts["max_cached_kv"],
                                      "256MiB (0: keep no cached KV)")
    if opts["cached_kv_ttl"] is not None:
        text = str(opts["cached_kv_ttl"]).strip()
        try:
            ttl = float(text)
        except ValueError:
            ttl = -1.0
        if not 0 < ttl < float("inf"):
            raise UsageError(f"--cached-kv-ttl must be a positive number of seconds, not "
                             f"{text!r}")
        opts["cached_kv_ttl"] = ttl
    opts["device_memory"] = _size_opt("--device-memory", opts["device_memory"], "4GiB")
    return opts


def _size_opt(name: str, value: Optional[str], example: str) -> Optional[int]:
    """A byte size option (``512MiB``, a byte count); None when not given."""
    if value is None:
        return None
    from xllm_vmm.config.values import parse_size

    text = str(value).strip()
    try:
        return parse_size(text)
    except ValueError:
        raise UsageError(f"{name} must be a size such as {example}, not {text!r}") from None


def _int_opt(name: str, value: Optional[str], low: int) -> Optional[int]:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"{name} must be an integer, not {value!r}") from None
    if n < low:
        raise UsageError(f"{name} must be at least {low}, not {n}")
    return n


def help_text(out: TextIO) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    console = Console(file=out, highlight=False)
    console.print(f"Usage: {escape(USAGE)}\n")
    console.print("Serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                  "/v1/models, /tokenize, /detokenize, /health, /version, /metrics) over the "
                  "virtual-memory engine. Every engine flag is accepted in gflags syntax and "
                  "checked as check-config checks it. Exit codes: 0 clean shutdown, 1 "
                  "configuration findings or start-up failure, 2 usage.\n")
    t = Table.grid(padding=(0, 2))
    for a, b in OPTIONS:
        t.add_row(f"[bold cyan]{escape(a)}[/]", escape(b))
    console.print(Panel(t, title="Options", title_align="left", border_style="dim"))


def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    from xllm_vmm.planner.report import human

    return human(int(n))


def sizing_lines(sizing: dict) -> list[str]:
    """The sizing summary: the plan's figures (``plan``'s JSON) and the running cache's."""
    w = (sizing.get("per_worker") or [{}])[0]
    run = sizing.get("running") or {}
    model = sizing.get("model") or {}
    lines = [
        f"model      {model.get('name')} ({model.get('architecture')}, {model.get('layers')} "
        f"layers, {model.get('dtype')}), context {run.get('max_model_len', sizing.get('context_len'))} tokens",
        f"weights    {_fmt_bytes(w.get('weights_bytes'))}"
        + (" in the VMM pool" if run.get("weights_in_pool") else " in process memory"),
        f"KV         {w.get('kv_bytes_per_token', '-')} bytes/token, "
        f"{run.get('kv_capacity_tokens', w.get('kv_capacity_tokens'))} tokens in "
        f"{run.get('block_size', '-')}-token blocks",
        f"pool       mode {run.get('mode', sizing.get('mode'))}, arena "
        f"{_fmt_bytes(run.get('arena_bytes', w.get('arena_bytes')))}, physical budget "
        f"{_fmt_bytes(w.get('physical_budget_bytes'))}",
    ]
    lo, hi = w.get("elastic_min_bytes"), w.get("elastic_max_bytes")
    if lo is not None or hi is not None:
        lines.append(f"elastic    {_fmt_bytes(lo)} .. {_fmt_bytes(hi)} mapped as demand moves")
    if w.get("max_concurrency") is not None:
        lines.append(f"concurrency {w.get('max_concurrency')} sequences at the full context")
    return lines


def ignored_flags(cfg) -> list[str]:
    """Explicitly set flags that neither the server nor the engine acts on (validated only)."""
    try:
        from xllm_vmm.engine import llm_engine

        honoured = frozenset(getattr(llm_engine, "HONOURED_FLAGS", _ENGINE_FLAGS))
    except ImportError:  # pragma: no cover - the engine is part of the package
        honoured = _ENGINE_FLAGS
    return sorted(n for n in cfg.explicit_names() if n not in honoured | SERVE_FLAGS)


class _LoadDisplay:
    """Progress on stderr while the engine builds: a bar of weight bytes loaded when the
    engine reports them (an engine option ``progress(done, total)``), otherwise a spinner with
    the elapsed time (no made-up fraction)."""

    def __init__(self, err: TextIO, label: str, total: Optional[int], bar: bool):
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn,
                                   TextColumn, TimeElapsedColumn)

        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if bar:
            columns += [BarColumn(), DownloadColumn()]
        elif total:
            label += f" ({_fmt_bytes(total)} of weights)"
        self.progress = Progress(*columns, TimeElapsedColumn(), console=Console(file=err),
                                 transient=False)
        self.task = self.progress.add_task(label, total=(total or None) if bar else None)

    def update(self, done: int, total: int) -> None:
        self.progress.update(self.task, completed=done, total=total)

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        t = self.progress.tasks[0]
        if exc[0] is None and t.total:
            self.progress.update(self.task, completed=t.total)
        self.progress.stop()


def run(argv: list[str], out: Optional[TextIO] = None, err: Optional[TextIO] = None,
        env: Optional[dict] = None) -> int:
    """Run ``xllm-vmm serve`` with ``argv`` (the tokens after ``serve``); returns the exit
    code once the server stopped."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        opts = parse_argv(list(argv))
    except UsageError as e:
        err.write(f"error: {e}\nusage: {USAGE}  (see --help)\n")
        return 2
    if opts["help"]:
        help_text(out)
        return 0
    environ = {} if opts["no_env"] else (os.environ if env is None else env)

    # 1. The configuration, checked as check-config checks it.
    from xllm_vmm.config.inputs import resolve_inputs
    from xllm_vmm.config.render import Result, exit_code, render_text
    from xllm_vmm.config.rules import check, find_model

    (r,) = resolve_inputs(opts["flags"], config=opts["config"], env=environ)
    r.label = "serve"
    if r.config is None:
        render_text([Result(r.label, None, list(r.findings))], err)
        return max(1, exit_code([Result(r.label, None, list(r.findings))]))
    cfg = r.config
    spec, why = find_model(cfg)
    report = check(cfg, spec, model_reason=why)
    findings = list(r.findings) + report.findings
    for f in findings:  # a model that is not here cannot be served: an error (as --strict)
        if f.id == "CFG-MODEL" and f.severity == "warning":
            f.severity = "error"
    result = Result(r.label, report, findings)
    if result.errors:
        render_text([result], err)
        return 1
    for f in result.warnings:
        err.write(f"warning {f.id}: {f.message}\n")

    port = int(cfg["port"])
    if not 0 <= port <= 65535:
        err.write(f"error: --port {port} is not a TCP port (0..65535; 0 picks a free one)\n")
        return 2
    host = str(cfg["host"] or "") or LOCAL_HOST
    api_key = opts["api_key"] or environ.get("XLLM_VMM_API_KEY") or None
    from xllm_vmm.server.launch import loop_factory

    try:  # XLLM_VMM_EVENT_LOOP names a loop this machine has: said before anything loads
        loop_factory()
    except ValueError as exc:
        err.write(f"error: {exc}\n")
        return 1

    if opts["enable_admin"] and not api_key and not _loopback(host):
        err.write(f"warning: --enable-admin with --host {host} and no --api-key: the admin "
                  "routes (sleep, wakeup, fork, reset_prefix_cache) are open to the network; "
                  "give --api-key (or XLLM_VMM_API_KEY) or serve on 127.0.0.1\n")

    # The port is taken now, before the model loads: a second serve on it fails in a moment,
    # not after the load. A worker rank (node_rank > 0) serves no HTTP and binds nothing.
    sock = None
    if not ("node_rank" in cfg.explicit_names() and int(cfg["node_rank"] or 0) > 0):
        from xllm_vmm.server.launch import bind_socket

        try:
            sock = bind_socket(host, port)
        except OSError as exc:
            err.write(f"error: cannot listen on {host}:{port}: {exc.strerror or exc} (give "
                      "another --port, or stop what uses it); nothing was loaded\n")
            return 1
    try:
        return _load_and_serve(cfg, opts, spec, result, r, environ, host, port, api_key,
                               sock, out, err)
    finally:
        if sock is not None:
            sock.close()


def _loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _load_and_serve(cfg, opts, spec, result, r, environ, host, port, api_key, sock,
                    out: TextIO, err: TextIO) -> int:
    """Steps 2 and 3 of :func:`run`: the engine, then the HTTP server on ``sock`` (bound by
    :func:`run` before the load; None: bound here)."""
    from xllm_vmm.config.render import Result, render_text

    # 2. The engine (rules + plan again inside: the one way in), weights under a progress bar.
    model = str(cfg["model"] or "") or None
    engine_flags: dict[str, Any] = {n: cfg[n] for n in cfg.explicit_names()
                                    if n not in SERVE_FLAGS}
    for key in ("max_model_len", "device_memory", "dtype"):
        if opts[key] is not None:
            engine_flags[key] = opts[key]
    from xllm_vmm.config import ConfigError

    try:
        from xllm_vmm.engine import LLMEngine
        from xllm_vmm.engine import llm_engine as _le
    except ImportError as exc:
        err.write(f"error: the engine cannot be imported ({exc}); install the CPU extras: "
                  "pip install 'xllm-vmm[cpu,server]'\n")
        return 1
    from xllm_vmm.engine import native_threads
    from xllm_vmm.engine.warmup import budget_from_env

    try:
        warm_budget = budget_from_env(environ)
    except ValueError as exc:  # XLLM_VMM_WARMUP_SECONDS malformed: said before anything loads
        err.write(f"error: {exc} (environment)\n")
        return 1
    try:
        native_threads.wanted(environ)
    except ValueError as exc:  # XLLM_VMM_NATIVE_THREADS malformed: the same, before loading
        err.write(f"error: {exc}\n")
        return 1
    # The default model is fetched and a GGUF converted (once; then cached) before the load
    # display, with their own progress lines; a fetch that cannot happen falls back to the demo.
    from xllm_vmm.models.default_model import resolve_model
    from xllm_vmm.models.errors import ModelConfigError

    try:
        resolved, is_demo = resolve_model(model, dtype=opts["dtype"], log=err)
    except ModelConfigError as exc:
        err.write(f"error: {exc}\n")
        return 1
    model = "demo" if is_demo else str(resolved)
    from xllm_vmm.models.gguf import served_name

    label = f"loading {served_name(model) or model}"
    weights = getattr(spec, "served_weight_bytes", None) if spec is not None else None
    reports = "progress" in getattr(_le, "ENGINE_OPTIONS", ())
    engine = None
    try:
        with _LoadDisplay(err, label, weights, reports) as bar:
            if reports:
                engine_flags["progress"] = bar.update
            engine = LLMEngine.from_flags(model, **engine_flags)
    except ConfigError as exc:
        render_text([Result(r.label, None, list(exc.findings))], err)
        return 1
    except (OSError, RuntimeError, ValueError, MemoryError) as exc:  # VmmError, weights, ...
        err.write(f"error: the engine could not start: {type(exc).__name__}: {exc}\n")
        return 1
    except KeyboardInterrupt:  # Ctrl-C while loading: what was built is released by the engine
        err.write("xllm-vmm serve: interrupted while loading; nothing served\n")
        return 130
    dist = getattr(engine, "distributed", None)
    if dist is not None and dist.rank > 0:  # a worker set: no HTTP on this rank
        from xllm_vmm.engine.distributed.serving import run_worker_rank

        global _worker_rank_ended
        code = run_worker_rank(engine, out, err)
        _worker_rank_ended = True
        return code
    for f in getattr(engine, "warnings", []):
        if f.id not in {w.id for w in result.warnings}:
            err.write(f"warning {f.id}: {f.message}\n")
    out.write("sizing (xllm-vmm plan's figures):\n")
    for line in sizing_lines(engine.sizing):
        out.write(f"  {line}\n")
    ignored = ignored_flags(cfg)
    if ignored:
        out.write(f"accepted without effect in this engine ({len(ignored)}): "
                  f"{', '.join('--' + n for n in ignored)}\n")
    out.flush()
    from xllm_vmm.engine.paths import paths_line

    out.write(paths_line(engine.compute_paths()) + "\n")  # chosen from this CPU (cpu_caps)
    out.write(engine.warm_up(warm_budget).line() + "\n")  # the row buckets' CPU products
    out.flush()
    # Done with torch on this thread: end its OpenMP team, so that the engine thread's is the
    # process's only one and libgomp keeps its workers spinning between a step's products
    # (engine.native_threads.release_team).
    native_threads.release_team()

    # 3. The HTTP server.
    import asyncio

    from xllm_vmm.server import AsyncEngine, ServerSettings, build_app
    from xllm_vmm.server.launch import run_loop, serve_async

    max_conc = int(cfg["max_concurrent_requests"])
    front = AsyncEngine(engine, max_waiting=opts["max_waiting"],
                        max_concurrent=max_conc if max_conc > 0 else None)
    limit = opts["max_request_bytes"]
    settings = ServerSettings(api_key=api_key, enable_admin=opts["enable_admin"],
                              drain_timeout=opts["drain_timeout"],
                              **({} if limit is None else {"max_request_bytes": limit or None}),
                              **({} if opts["max_forks"] is None
                                 else {"max_forks": opts["max_forks"]}),
                              max_cached_kv_bytes=opts["max_cached_kv"],
                              cached_kv_ttl=opts["cached_kv_ttl"])
    app = build_app(front, settings)
    t0 = time.monotonic()
    stop = asyncio.Event()
    lost: list = []

    def ready(url: str) -> None:
        extra = " (admin routes on)" if opts["enable_admin"] else ""
        out.write(f"xllm-vmm serve: ready at {url} (model {front.name}){extra}\n")
        out.flush()
        if dist is not None:  # a lost worker: /health 503 and a clean stop
            from xllm_vmm.engine.distributed.serving import watch_workers

            loop = asyncio.get_running_loop()
            lost.extend(watch_workers(engine, front, lambda: loop.call_soon_threadsafe(stop.set)))

    try:
        cancelled = run_loop(serve_async(app, host, port, drain_timeout=opts["drain_timeout"],
                                         on_ready=ready, stop=stop, sock=sock))
    except OSError as exc:
        front.close()
        err.write(f"error: cannot listen on {host}:{port}: {exc.strerror or exc} (give another "
                  "--port, or stop what uses it)\n")
        return 1
    except SystemExit as exc:  # uvicorn exits on a bind failure
        front.close()
        err.write(f"error: cannot listen on {host}:{port} (give another --port, or stop what "
                  "uses it)\n")
        return 1
    if dist is not None and dist.failure is not None:
        err.write(f"error: {dist.failure}\n")
        out.write(f"xllm-vmm serve: stopped after {time.monotonic() - t0:.1f} s: worker rank "
                  f"{dist.failure.rank} lost\n")
        out.flush()
        return 1
    out.write(f"xllm-vmm serve: stopped after {time.monotonic() - t0:.1f} s"
              + (f", {cancelled} request(s) cancelled" if cancelled else "") + "\n")
    out.flush()
    leftover = [t.name for t in threading.enumerate()
                if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if leftover:
        err.write(f"warning: threads still running at exit: {', '.join(leftover)}\n")
    return 0


_worker_rank_ended = False
"""Set once a worker rank (> 0) has served and released its engine (see :func:`_leave`)."""


def _leave(code: int) -> int:
    """The exit of the ``serve`` command. A worker rank whose engine is shut down (pool,
    mappings and process group released) leaves with ``os._exit`` after flushing its output:
    torch.distributed's store client threads can still be inside a call to a rank 0 that is
    already gone, and their C++ destructors at interpreter teardown then abort the process
    ("terminate called without an active exception", exit -6) although nothing is left to
    release. Rank 0 and single-process servers exit normally."""
    if _worker_rank_ended:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    return code


def main(argv: Optional[list[str]] = None) -> None:
    from xllm_vmm.cli.guard import output_guard

    def _run() -> None:
        raise SystemExit(_leave(run(sys.argv[2:] if argv is None else argv)))

    output_guard(_run)


# Registration on the Typer app (serve parses its own command line, like check-config).
import typer  # noqa: E402

from xllm_vmm.cli.root import app  # noqa: E402


@app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                      "help_option_names": []},
    add_help_option=False,
    short_help="Serve the OpenAI-compatible API over the VMM engine (every engine flag "
               "accepted; SmolLM2-135M-Instruct without --model).",
)
def _serve(ctx: typer.Context) -> None:
    """Serve the OpenAI-compatible API over the virtual-memory engine. Run `xllm-vmm serve
    --help` for its options; every engine flag is accepted in gflags syntax."""
    raise typer.Exit(_leave(run(list(ctx.args))))
