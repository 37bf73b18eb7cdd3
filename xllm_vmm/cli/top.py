"""``xllm-vmm top``: a live terminal view of a running server's memory, per model and device.

It reads the admin route ``GET /vmm/memory`` (:mod:`xllm_vmm.server.memory_view`; the server
runs with ``--enable-admin``) once a second and shows one row per model and device: state,
requests running and waiting, weights, active KV, cached KV (and how much of it is evictable),
the host tier, mapped against reserved bytes, pages in use, map/unmap calls per second (from
the counters' change between two readings and the server's clock), the prefix hit rate and the
``max_cache_size`` quota's use. ``q`` or Ctrl-C ends it (exit 0) and restores the terminal.

``--once`` prints one reading and exits: a table, or with ``--format json`` the route's JSON
unchanged (for scripts). Exit codes: 0 done, 1 the server is unreachable or refused (one line
saying why and which flag helps), 2 usage errors.

Start-up imports only Typer and the standard library; httpx and rich load when it runs.
"""

from __future__ import annotations

import os
import sys
from enum import Enum
from typing import Any, Optional

import typer

from xllm_vmm.cli.root import app


class OutputFormat(str, Enum):
    """``--format`` of ``--once``."""

    table = "table"
    json = "json"

ROUTE = "/vmm/memory"
"""The admin route ``top`` reads (:mod:`xllm_vmm.server.memory_view`)."""

REFRESH_S = 1.0
"""Seconds between two readings of the live view."""


class TopError(Exception):
    """The server cannot be read; the message is the one line ``top`` prints."""


def default_url() -> str:
    """The address ``xllm-vmm serve`` binds with its defaults (``--host``, ``--port``)."""
    from xllm_vmm.cli.serve import LOCAL_HOST
    from xllm_vmm.config.catalogue import FLAGS

    return f"http://{LOCAL_HOST}:{FLAGS['port'].default}"


def fetch(client: Any, url: str) -> dict:
    """One reading of ``url``'s memory view; :class:`TopError` with one line saying why not."""
    import httpx

    try:
        r = client.get(url.rstrip("/") + ROUTE)
    except httpx.HTTPError as exc:
        why = str(exc) or type(exc).__name__
        raise TopError(f"cannot reach the server at {url} ({why}): start one with "
                       "`xllm-vmm serve --enable-admin`, or pass --url") from None
    if r.status_code == 404:
        raise TopError(f"{url} does not serve {ROUTE}: its admin routes are off; restart the "
                       "server with --enable-admin")
    if r.status_code == 401:
        raise TopError(f"{url} refused the API key: pass the server's --api-key with "
                       "--api-key KEY (or set XLLM_VMM_API_KEY)")
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code != 200 or not isinstance(body, dict) or "models" not in body:
        msg = body.get("error", {}).get("message") if isinstance(body, dict) and isinstance(
            body.get("error"), dict) else (r.text[:200] or "no body")
        raise TopError(f"{url}{ROUTE} answered {r.status_code}: {msg}")
    return body


# ---------------------------------------------------------------------------------- the table
_COUNTERS = ("map_calls", "unmap_calls", "pages_mapped_total", "pages_unmapped_total")


def rates(prev: Optional[dict], now: dict) -> dict[tuple[str, int], dict[str, float]]:
    """Per (model, rank): each pool counter's change per second between two readings (the
    server's ``time``); empty without a previous reading or when the clock did not move."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    if not prev:
        return out
    dt = float(now.get("time", 0)) - float(prev.get("time", 0))
    if dt <= 0:
        return out
    before = {(m["name"], d["rank"]): d.get("pool") or {}
              for m in prev.get("models", []) for d in m.get("devices") or []}
    for m in now.get("models", []):
        for d in m.get("devices") or []:
            key = (m["name"], d["rank"])
            old, new = before.get(key), d.get("pool") or {}
            if old is None:
                continue
            out[key] = {c: (new[c] - old[c]) / dt for c in _COUNTERS
                        if isinstance(new.get(c), int) and isinstance(old.get(c), int)}
    return out


def _bytes(n: Any) -> str:
    from xllm_vmm.planner.report import human

    return human(n) if isinstance(n, int) else "-"


def _pct(x: Any) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-"


def _rate(r: Optional[dict], key: str) -> str:
    return f"{r[key]:,.1f}" if r and key in r else "-"


COLUMNS = ("model", "device", "state", "run/wait", "weights", "active KV", "cached KV",
           "evictable", "host tier", "mapped / reserved", "pages", "map/s", "unmap/s",
           "prefix hit", "quota")


def rows(view: dict, per_s: dict) -> list[tuple[str, ...]]:
    """One row of :data:`COLUMNS` per model and device."""
    out = []
    for m in view.get("models", []):
        req = m.get("requests") or {}
        state = m.get("state", "?")
        if m.get("sleep_level"):
            state += f" (L{m['sleep_level']})"
        if m.get("error"):
            state = "no answer"
        hit = (m.get("prefix_cache") or {}).get("hit_rate")
        devices = m.get("devices") or [{}]
        for d in devices:
            pool, kv = d.get("pool") or {}, d.get("kv") or {}
            w, host, quota = d.get("weights") or {}, d.get("host_tier") or {}, d.get("quota") or {}
            r = per_s.get((m["name"], d.get("rank")))
            cap = quota.get("max_cache_size_bytes")
            q = (f"{_pct(quota.get('used_fraction'))} of {_bytes(cap)}" if cap else "none")
            out.append((
                m["name"] + (" *" if m.get("default") else ""), str(d.get("device", "-")),
                state, f"{req.get('running', '-')}/{req.get('waiting', '-')}",
                _bytes(w.get("mapped_bytes") if w.get("in_pool") else w.get("bytes")),
                _bytes(kv.get("active_bytes")), _bytes(kv.get("cached_bytes")),
                _bytes(kv.get("evictable_bytes")),
                _bytes(host.get("used_bytes")) if host.get("enabled") else "off",
                f"{_bytes(pool.get('mapped_bytes'))} / {_bytes(pool.get('reserved_bytes'))}",
                f"{pool.get('pages_in_use', '-')}/{pool.get('reserved_pages', '-')}",
                _rate(r, "map_calls"), _rate(r, "unmap_calls"), _pct(hit), q))
    return out


def table(view: dict, per_s: dict, url: str, note: str = "", console: Any = None) -> Any:
    """The reading as a table: one row per model and device, or, when that is wider than
    ``console``, one column per model and device (a narrow terminal)."""
    from rich.table import Table

    title = f"xllm-vmm top  {url}"
    caption = note or "q or Ctrl-C: quit   * default model"
    data = rows(view, per_s)
    t = Table(title=title, caption=caption)
    for c in COLUMNS:
        t.add_column(c, justify="left" if c in ("model", "device", "state") else "right",
                     no_wrap=True)
    for row in data:
        t.add_row(*row)
    if console is None:
        return t
    from rich.measure import Measurement

    wide = console.options.update_width(1 << 16)  # the table's own width, not the terminal's
    if Measurement.get(console, wide, t).maximum <= console.width:
        return t
    narrow = Table(title=title, caption=caption)
    narrow.add_column("", no_wrap=True)
    for row in data:
        narrow.add_column(f"{row[0]} {row[1]}", justify="right", no_wrap=True)
    for i, c in enumerate(COLUMNS[2:], start=2):
        narrow.add_row(c, *(row[i] for row in data))
    return narrow


# ---------------------------------------------------------------------------------- live view
class _Keys:
    """The terminal in cbreak mode while the view runs (a key press is read at once, Ctrl-C
    still interrupts); restored on exit. Not a terminal: no keys are read."""

    def __init__(self) -> None:
        self.fd: Optional[int] = None
        self.saved: Any = None

    def __enter__(self) -> "_Keys":
        try:
            import termios
            import tty

            fd = sys.stdin.fileno()
            if os.isatty(fd):
                self.saved = termios.tcgetattr(fd)
                tty.setcbreak(fd)
                self.fd = fd
        except (ImportError, OSError, ValueError):
            self.fd = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def wait(self, seconds: float) -> str:
        """Wait up to ``seconds`` for a key; the key read, or "" (no key, or no terminal)."""
        import select
        import time

        if self.fd is None:
            time.sleep(seconds)
            return ""
        ready, _, _ = select.select([self.fd], [], [], seconds)
        if not ready:
            return ""
        return os.read(self.fd, 32).decode(errors="replace")


def live(client: Any, url: str, first: dict) -> None:
    """Refresh every :data:`REFRESH_S` until ``q`` or Ctrl-C; a reading that fails keeps the
    last table and says why under it (the server may come back)."""
    import time

    from rich.console import Console
    from rich.live import Live

    prev, view, note = None, first, ""
    console = Console()
    with _Keys() as keys, Live(table(view, {}, url, console=console), console=console,
                               screen=True, auto_refresh=False) as lv:
        try:
            while True:
                lv.update(table(view, rates(prev, view), url, note, console), refresh=True)
                t_next = time.monotonic() + REFRESH_S
                while (left := t_next - time.monotonic()) > 0:
                    if "q" in keys.wait(left).lower():
                        return
                try:
                    prev, view, note = view, fetch(client, url), ""
                except TopError as exc:
                    note = f"{exc}   (q: quit)"
        except KeyboardInterrupt:
            return


@app.command("top", short_help="A live terminal view of a running server's memory per model "
                                "and device (reads the admin route /vmm/memory).")
def top(
    url: Optional[str] = typer.Option(
        None, "--url", help="The server's address (default: the local one, at the address "
                            "`xllm-vmm serve` binds by default)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", help="The server's --api-key (default $XLLM_VMM_API_KEY)."),
    once: bool = typer.Option(False, "--once", help="Print one reading and exit."),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f",
                                     help="With --once: table, or json (the route's answer)."),
) -> None:
    """A live view of a running server's memory per model and device (weights, active and cached
    KV, host tier, reserved vs mapped, pages, map/unmap calls per second, prefix hit rate,
    requests, sleep state, quota). Reads the admin route /vmm/memory (serve --enable-admin).
    q or Ctrl-C quits."""
    import json

    import httpx

    base = (url or default_url()).rstrip("/")
    if "://" not in base:
        base = "http://" + base
    key = api_key or os.environ.get("XLLM_VMM_API_KEY") or None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if fmt is OutputFormat.json and not once:
        typer.echo("error: --format json needs --once (the live view is a table)", err=True)
        raise typer.Exit(2)
    if not once and not sys.stdout.isatty():
        typer.echo("error: the live view needs a terminal; pass --once (and --format json) "
                   "for scripts", err=True)
        raise typer.Exit(2)
    with httpx.Client(headers=headers, timeout=10.0) as client:
        try:
            view = fetch(client, base)
        except TopError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1)
        if once:
            if fmt is OutputFormat.json:
                typer.echo(json.dumps(view, indent=2))
            else:
                from rich.console import Console

                console = Console()
                console.print(table(view, {}, base, "* default model", console))
            return
        live(client, base, view)
