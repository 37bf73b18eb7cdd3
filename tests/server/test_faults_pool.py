"""Faults around a real server on the demo model end with the pool idle: a client that dies
mid-stream, a pool asked for more than it can ever hold at once, a signal under load, a full
disk. After each, ``/metrics``, the pool's statistics and the host driver's own native table
agree on the bytes mapped, no KV block is held by a request, and once the prefix cache is
dropped nothing of the KV cache is mapped."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.test_serve_cli import _start
from xllm_vmm.bench.serve import parse_metric
from xllm_vmm.server import AsyncEngine, RunningServer, ServerSettings, build_app

MAX_LEN = 8192
"""The demo model's context here: one KV slot (2 MiB pages x 8 tensors) holds 8192 tokens,
and 64 MiB of device memory leaves the pool room for that one slot only."""


@pytest.fixture(scope="module")
def demo():
    from xllm_vmm.engine import LLMEngine

    eng = LLMEngine.from_flags(None, block_size=16, device_memory="64MiB", max_model_len=MAX_LEN,
                               enable_vmm_kvcache=True, vmm_elastic=True)
    front = AsyncEngine(eng, max_waiting=8)
    srv = RunningServer(build_app(front, ServerSettings(enable_admin=True)),
                        drain_timeout=5).start()
    yield eng, front, srv
    srv.stop()


def _metrics(url: str) -> dict[str, float]:
    """The unlabelled-by-reason series the checks read (summed over their labels)."""
    text = httpx.get(f"{url}/metrics").text
    names = ("xllm_vmm_mapped_bytes", "xllm_vmm_kv_mapped_bytes", "xllm_vmm_kv_live_blocks",
             "vllm:num_requests_running", "vllm:num_requests_waiting")
    return {n: parse_metric(text, n) for n in names}


def assert_pool_idle(eng, front, url: str) -> None:
    """Nothing in flight; ``/metrics``, the pool and the native table agree; no block is
    held by a request; the mapped KV is the prefix cache's packed floor, and nothing once the
    cache is dropped."""
    end = time.monotonic() + 30
    while (front.num_in_flight or eng.has_unfinished_requests()) and time.monotonic() < end:
        time.sleep(0.05)
    assert front.num_in_flight == 0 and not eng.has_unfinished_requests()
    for drop in (False, True):
        if drop:
            assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
        m = _metrics(url)
        native = eng.driver.stats()
        pool = eng.pool.stats()
        kv = eng.kv_cache_manager.stats()
        assert m["xllm_vmm_mapped_bytes"] == pool.mapped_bytes == native["mapped_bytes"]
        assert m["xllm_vmm_kv_mapped_bytes"] == kv["mapped_bytes"] == \
            pool.per_tenant_mapped_bytes.get("kv", 0)
        assert m["xllm_vmm_kv_live_blocks"] == kv["live_blocks"] == 0
        assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        assert kv["mapped_bytes"] == kv["packed_floor_bytes"]
        if drop:
            assert kv["mapped_bytes"] == 0 and kv["cached_blocks"] == 0
            assert native["mapped_bytes"] == pool.mapped_bytes == 0  # weights are not pooled here


def _prompt(seed: int, n: int) -> list[int]:
    return [4 + (seed * 131 + k * 7) % 400 for k in range(n)]


def _aborted(url: str) -> float:
    return parse_metric(httpx.get(f"{url}/metrics").text, "vllm:request_success_total",
                        {"finished_reason": "abort"}) or 0.0


def _dead_client(url: str, body: dict) -> None:
    """Send a streaming request on a raw socket, read its first event, then reset the
    connection (SO_LINGER 0: an RST, as a killed client's kernel sends)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()


def test_a_client_dead_mid_stream_is_aborted_and_frees_its_blocks(demo):
    eng, front, srv = demo
    before = _aborted(srv.url)
    results: dict = {}

    def stream(i):
        body = {"prompt": _prompt(i, 64), "max_tokens": 120, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        results[i] = events

    live = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in live:
        t.start()
    for i in range(3):  # three clients die while the three others stream
        _dead_client(srv.url, {"prompt": _prompt(10 + i, 64), "max_tokens": 4000,
                               "ignore_eos": True, "stream": True})
    for t in live:
        t.join(120)
    for i in range(3):
        events = results[i]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        assert len(events) - 1 == 120  # every token, one chunk each
    assert_pool_idle(eng, front, srv.url)
    assert _aborted(srv.url) - before == 3


def test_more_than_the_pool_holds_at_once_queues_or_is_refused_never_hangs(demo):
    eng, front, srv = demo
    client = httpx.Client(base_url=srv.url, timeout=120)
    # a prompt past the context: 400 naming it, at once
    r = client.post("/v1/completions", json={"prompt": _prompt(1, MAX_LEN + 100), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert f"maximum context length is {MAX_LEN}" in r.json()["error"]["message"]
    # one request whose choices together need more KV than the pool can ever map (7000 shared
    # prompt tokens + 2 x 800 generated > 8192): its choices are preempted in turn, it ends
    r = client.post("/v1/completions", json={"prompt": _prompt(2, 7000), "max_tokens": 800,
                                             "n": 2, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    assert r.json()["usage"]["completion_tokens"] == 1600
    assert_pool_idle(eng, front, srv.url)

    # thirty at once, each half the pool: some wait, past --max-waiting-requests 429, none hang
    async def one(c, i):
        r = await c.post("/v1/completions", json={"prompt": _prompt(100 + i, 3500),
                                                  "max_tokens": 4, "ignore_eos": True})
        return r.status_code, r.json()

    async def burst():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(30)))

    got = asyncio.run(asyncio.wait_for(burst(), 180))
    codes = sorted(c for c, _ in got)
    assert set(codes) <= {200, 429} and 200 in codes, codes
    for code, body in got:
        if code == 429:
            assert body["error"]["type"] == "rate_limit_error"
            assert "--max-waiting-requests 8" in body["error"]["message"]
        else:
            assert body["usage"]["completion_tokens"] == 4
    assert_pool_idle(eng, front, srv.url)


# -- a signal under load -------------------------------------------------------------------
def _leftovers() -> set[str]:
    """Entries the server could leave in the machine's shared places: ``/dev/shm/xllm*``
    (the host driver's memory is a memfd, which has no entry there), ``/tmp/xllm-vmm*`` (the
    hugepage settings lock, kept on purpose, is there before)."""
    out = set()
    for d, prefix in (("/dev/shm", "xllm"), ("/tmp", "xllm-vmm")):
        try:
            out |= {f"{d}/{n}" for n in os.listdir(d) if n.startswith(prefix)}
        except OSError:
            pass
    return out


def _maps_of(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as fh:
        return sum("xllm-vmm-host" in line for line in fh)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_under_load_is_one_line_exit_0_and_no_residue(sig):
    before = _leftovers()
    proc, _, url = _start(["--model", "demo", "--port", "0", "--device-memory=128MiB",
                              "--max-model-len=4096", "--drain-timeout=1",
                              "--enable_vmm_kvcache=true", "--vmm_elastic=true"])
    ends: list = []

    def stream(i):
        body = {"prompt": _prompt(i, 32), "max_tokens": 3000 if i % 2 else 6,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
            ends.append((r.status_code, events[-2:] if events else []))
        except httpx.HTTPError as exc:
            ends.append((None, [repr(exc)]))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while _metric(url, "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _maps_of(proc.pid) > 0  # the pool is mapped while it serves
        proc.send_signal(sig)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    for t in threads:
        t.join(60)
    out, err = proc.stdout.read(), proc.stderr.read()
    assert code == 0, err
    assert [ln for ln in out.splitlines() if ln.strip()] == \
        [ln for ln in out.splitlines() if ln.startswith("xllm-vmm serve: stopped after")]
    assert len(out.splitlines()) == 1, out
    assert "Traceback" not in err and "threads still running" not in err, err
    for status, tail in ends:  # every stream ended: finished, or told why it was cancelled
        assert status in (200, 503) or status is None, (status, tail)
        if status == 200:
            assert tail[-1] == "[DONE]", tail
    assert _leftovers() <= before


def _metric(url: str, name: str) -> float:
    return parse_metric(httpx.get(f"{url}/metrics").text, name) or 0.0


# -- a full disk ---------------------------------------------------------------------------
def _full_dir(tmp_path) -> list[str] | None:
    """A command prefix that runs its command with ``tmp_path/full`` mounted as a 64 KiB
    tmpfs (a private mount namespace); None where this host does not allow it."""
    target = tmp_path / "full"
    target.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs {target} && echo ok"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != "ok":
        return None
    return ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs {target} && '
                                          'exec "$0" "$@"']


def test_a_full_model_cache_is_one_line_naming_the_path(tmp_path):
    prefix = _full_dir(tmp_path)
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare -rm)")
    full = tmp_path / "full"
    proc = subprocess.run([*prefix, sys.executable, "-m", "xllm_vmm.cli", "serve", "--model",
                           "demo", "--port", "0", "--device-memory=128MiB"], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, XDG_CACHE_HOME=str(full)))
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert str(full / "xllm-vmm") in lines[0] and "No space left on device" in lines[0]
    assert "XDG_CACHE_HOME" in lines[0] and "ready" not in proc.stdout


def test_a_full_disk_while_building_the_demo_model_names_the_directory(tmp_path, monkeypatch):
    import errno

    from xllm_vmm.engine import demo
    from xllm_vmm.models.errors import ModelConfigError

    def full(out_dir):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(demo, "build_demo_model", full)
    with pytest.raises(ModelConfigError) as e:
        demo.demo_model_dir(tmp_path / "cache")
    assert str(tmp_path / "cache") in str(e.value) and "No space left on device" in str(e.value)
    assert not [p for p in (tmp_path / "cache").iterdir()]  # the partial directory is removed


def test_a_full_disk_while_converting_a_gguf_names_the_directory(tmp_path, monkeypatch):
    import errno

    from xllm_vmm.models import gguf
    from xllm_vmm.models.errors import ModelConfigError

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")

    def full(path, out_dir, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gguf, "convert", full)
    monkeypatch.setattr(gguf, "_resolve_dtype", lambda f, d: "float32")
    with pytest.raises(ModelConfigError) as e:
        gguf.converted_dir(src, dtype="float32", cache_dir=tmp_path / "cache", sha256="0" * 64)
    assert str(tmp_path / "cache") in str(e.value) and "No space left on device" in str(e.value)
    assert not [p for p in (tmp_path / "cache").iterdir()]


def test_a_full_output_stream_is_one_line_and_exit_2():
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "serve", "--model", "demo",
                               "--port", "0", "--device-memory=128MiB"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert lines == ["error: cannot write the output: No space left on device"], proc.stderr
    assert "Traceback" not in proc.stderr
