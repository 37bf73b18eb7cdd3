"""``xllm-vmm top`` against a real ``xllm-vmm serve`` on the demo model: ``--once --format json``
is the route's answer, ``--once`` a table of it; the live view runs in a real terminal (tmux),
shows the table, and ``q`` or Ctrl-C end it with exit 0 and the terminal restored; an
unreachable server, admin routes off or a missing key are one line naming the flag."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tests.server.conftest import FakeEngine
from tests.server.test_serve_cli import _start
from xllm_vmm.cli.top import rates, rows
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

KEY = "top-key"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _top(*args, env=None):
    return subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "top", *args],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


@pytest.fixture(scope="module")
def served():
    proc, lines, url = _start(["--model", "demo", "--port", "0", "--enable_vmm_kvcache=true",
                               "--vmm_elastic=true", "--enable_vmm_weights=true",
                               "--block_size=16", "--device-memory=256MiB", "--enable-admin",
                               f"--api-key={KEY}"])
    h = {"Authorization": f"Bearer {KEY}"}
    for _ in range(2):
        r = httpx.post(f"{url}/v1/completions", headers=h, timeout=60,
                       json={"prompt": "hello world " * 12, "max_tokens": 3})
        assert r.status_code == 200
    yield url, h
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_once_json_is_the_routes_answer(served):
    url, h = served
    p = _top("--url", url, "--once", "--format", "json", env={"XLLM_VMM_API_KEY": KEY})
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    direct = httpx.get(f"{url}/vmm/memory", headers=h).json()
    assert got["version"] == direct["version"] == 1
    got.pop("time"), direct.pop("time")
    for d in (got, direct):  # the free memory of the host driver's source moves by itself
        for m in d["models"]:
            for dev in m["devices"]:
                dev.pop("memory_free_bytes")
    assert got == direct
    [m] = got["models"]
    assert m["name"] == "xllm-vmm-demo" and m["prefix_cache"]["hit_tokens"] > 0
    assert m["devices"][0]["pool"]["mode"] == "elastic"


def test_once_table(served):
    url, _ = served
    p = _top("--url", url, "--once", "--api-key", KEY)
    assert p.returncode == 0, p.stderr
    for text in ("xllm-vmm-demo *", "cpu:0", "awake", "cached KV", "mapped / reserved",
                 "map/s", "prefix hit"):
        assert text in p.stdout, text


def test_missing_key_is_one_line_naming_the_flag(served):
    url, _ = served
    p = _top("--url", url, "--once", env={"XLLM_VMM_API_KEY": ""})
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "--api-key" in p.stderr


def test_unreachable_server_is_one_line():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    p = _top("--url", f"http://127.0.0.1:{port}", "--once")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "cannot reach" in p.stderr and "--url" in p.stderr
    assert "Traceback" not in p.stderr


def test_admin_routes_off_is_one_line_naming_the_flag(tokenizer):
    front = AsyncEngine(FakeEngine(tokenizer))
    srv = RunningServer(build_app(front, ServerSettings()), drain_timeout=5).start()
    try:
        p = _top("--url", srv.url, "--once", "-f", "json")
    finally:
        srv.stop()
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "--enable-admin" in p.stderr


def test_json_needs_once():
    p = _top("--url", "http://127.0.0.1:1", "--format", "json")
    assert p.returncode == 2 and "--once" in p.stderr


def _reading(t, map_calls, unmap_calls):
    pool = {"map_calls": map_calls, "unmap_calls": unmap_calls, "pages_mapped_total": 0,
            "pages_unmapped_total": 0, "mapped_bytes": 0, "reserved_bytes": 0}
    return {"time": t, "models": [{"name": "m", "default": True, "state": "awake",
                                   "requests": {"running": 1, "waiting": 2},
                                   "devices": [{"device": "cpu:0", "rank": 0, "pool": pool}]}]}


def test_rates_are_counter_deltas_over_the_servers_clock():
    a, b = _reading(100.0, 10, 4), _reading(102.0, 30, 5)
    r = rates(a, b)
    assert r[("m", 0)]["map_calls"] == 10.0 and r[("m", 0)]["unmap_calls"] == 0.5
    assert rates(None, b) == {} and rates(b, b) == {}  # no previous reading, no time passed
    [row] = rows(b, r)
    assert row[11] == "10.0" and row[12] == "0.5" and row[3] == "1/2"
    [row] = rows(b, {})
    assert row[11] == "-"


# ------------------------------------------------------------------------- a real terminal
TMUX = shutil.which("tmux")


class _Tmux:
    def __init__(self, command: str, width: int):
        self.sock = f"xllm-top-{uuid.uuid4().hex[:8]}"
        self.run("new-session", "-d", "-s", "t", "-x", str(width), "-y", "30", command)

    def run(self, *args):
        return subprocess.run([TMUX, "-L", self.sock, *args], capture_output=True, text=True,
                              timeout=30)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "t").stdout

    def wait_for(self, *texts: str, timeout: float = 60.0) -> str:
        """The first capture that shows every one of ``texts`` (a capture may catch a frame
        half drawn: the next one is whole)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.screen()
            if all(t in s for t in texts):
                return s
            time.sleep(0.2)
        raise AssertionError(f"{texts!r} never showed together; the screen:\n{self.screen()}")

    def close(self):
        self.run("kill-server")


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install -y tmux)")
@pytest.mark.parametrize("key,width", [("q", 220), ("C-c", 80)],
                         ids=["q-wide", "ctrl-c-narrow"])
def test_live_view_in_a_real_terminal(served, key, width):
    url, _ = served
    # the shell prints top's exit status and whether the terminal is canonical again; the
    # terminal's own size is the one read (COLUMNS/LINES inherited from elsewhere are not)
    cmd = (f"cd {ROOT} && env -u COLUMNS -u LINES "
           f"PYTHONPATH={os.environ.get('PYTHONPATH', ROOT)} "
           f"XLLM_VMM_API_KEY={KEY} {sys.executable} -m xllm_vmm.cli top --url {url}; "
           "echo EXIT=$?; stty -a | grep -o -- '-\\?icanon' | sed 's/^/MODE=/'; sleep 60")
    t = _Tmux(cmd, width)
    try:
        screen = t.wait_for("xllm-vmm top", "mapped / reserved", "xllm-vmm-demo *", "cpu:0",
                            "q or Ctrl-C")
        assert "…" not in screen  # nothing cut: a narrow terminal gets one column per model
        assert max(len(line.rstrip()) for line in screen.splitlines()) <= width
        t.run("send-keys", "-t", "t", key)
        after = t.wait_for("EXIT=", "MODE=")
    finally:
        t.close()
    assert "EXIT=0" in after and "MODE=icanon" in after, after
    assert "Traceback" not in after


def test_live_view_needs_a_terminal():
    p = _top("--url", "http://127.0.0.1:1")  # stdout is a pipe here
    assert p.returncode == 2 and "--once" in p.stderr and p.stderr.count("\n") == 1
