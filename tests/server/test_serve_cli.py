"""``xllm-vmm serve``: the configuration is checked as check-config checks it (same findings,
exit 1) before anything loads; usage errors exit 2; a real start-up prints the sizing summary,
the flags without effect and the ready line, serves, and stops cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from xllm_vmm.cli.check_config import run as check_config
from xllm_vmm.cli.serve import parse_argv, run


def _serve(argv):
    out, err = io.StringIO(), io.StringIO()
    code = run(argv, out=out, err=err, env={})
    return code, out.getvalue(), err.getvalue()


def _finding_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith(("✗", "→"))]


@pytest.mark.parametrize("flags", [
    ["--bogus_flag=1"],
    ["--enable_vmm_kvcache=true", "--enable_task_pipeline=true"],
    ["--port=99999"],
    ["--block_size", "abc"],
])
def test_config_errors_are_check_configs_findings(flags):
    code, out, err = _serve(flags)
    assert code == 1 and "ready" not in out
    cc_out = io.StringIO()
    assert check_config(flags, out=cc_out, err=io.StringIO(), env={}) == 1
    assert _finding_lines(err) == _finding_lines(cc_out.getvalue())
    assert _finding_lines(err)


def test_malformed_warmup_budget_is_an_error_before_loading():
    out, err = io.StringIO(), io.StringIO()
    code = run([], out=out, err=err, env={"XLLM_VMM_WARMUP_SECONDS": "soon"})
    assert code == 1 and "XLLM_VMM_WARMUP_SECONDS='soon'" in err.getvalue()
    assert "(environment)" in err.getvalue() and "loading" not in err.getvalue()


def test_malformed_native_threads_setting_is_an_error_before_loading():
    out, err = io.StringIO(), io.StringIO()
    code = run([], out=out, err=err, env={"XLLM_VMM_NATIVE_THREADS": "many"})
    assert code == 1 and "XLLM_VMM_NATIVE_THREADS='many' (environment)" in err.getvalue()
    assert "omp, pool" in err.getvalue() and "loading" not in err.getvalue()


def test_missing_model_is_an_error_before_loading(tmp_path):
    code, out, err = _serve([f"--model={tmp_path / 'nope'}"])
    assert code == 1 and "CFG-MODEL" in err and "loading" not in err


@pytest.mark.parametrize("argv,needle", [
    (["stray.toml"], "unexpected argument"),
    (["--max-waiting-requests", "-3"], "--max-waiting-requests"),
    (["--drain-timeout=soon"], "--drain-timeout"),
    (["--dtype=int3"], "--dtype"),
    (["--device-memory=lots"], "--device-memory"),
    (["--api-key"], "needs a value"),
])
def test_usage_errors_exit_2(argv, needle):
    code, out, err = _serve(argv)
    assert code == 2 and needle in err and "usage:" in err


def test_parse_argv_keeps_engine_flags_in_gflags_syntax():
    o = parse_argv(["--model", "/m", "--port", "9000", "--enable-admin", "--api-key=k",
                    "--enable_prefix_cache=false", "--config", "a.toml", "--max-model-len=64"])
    assert o["flags"] == ["--model", "/m", "--port", "9000", "--enable_prefix_cache=false"]
    assert o["enable_admin"] and o["api_key"] == "k" and o["config"] == ["a.toml"]
    assert o["max_model_len"] == 64


def test_help():
    code, out, err = _serve(["--help"])
    assert code == 0 and "--api-key" in out and "--enable-admin" in out


def _start(args, env=None):
    proc = subprocess.Popen([sys.executable, "-m", "xllm_vmm.cli", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "ready at " in line:
            return proc, lines, line.split("ready at ", 1)[1].split()[0]
    proc.kill()
    raise AssertionError("no ready line:\n" + "".join(lines) + proc.stderr.read())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_starts_serves_and_stops_cleanly(tiny_llama_dir, sig):
    # An existing launch command with the binary replaced: engine flags as the engine takes
    # them (a flag this engine does not act on is accepted and listed once).
    args = ["--model", str(tiny_llama_dir), "--port", "0", "--enable_vmm_kvcache=true",
            "--vmm_elastic=true", "--enable_vmm_weights=true", "--block_size=16",
            "--num_threads=4", "--max-model-len=128", "--device-memory=256MiB",
            "--enable-admin", "--api-key=k"]
    proc, lines, url = _start(args)
    try:
        text = "".join(lines)
        assert "sizing" in text and "bytes/token" in text and "arena" in text
        assert "accepted without effect in this engine (1): --num_threads" in text
        assert "warm-up: skipped (float32: no per-shape compilation)" in text
        assert url.startswith("http://127.0.0.1:")
        h = {"Authorization": "Bearer k"}
        assert httpx.get(f"{url}/health").status_code == 200
        r = httpx.post(f"{url}/v1/completions", headers=h,
                       json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/is_sleeping", headers=h).json() == {"is_sleeping": False}
    finally:
        proc.send_signal(sig)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    rest = proc.stdout.read()
    err = proc.stderr.read()
    assert code == 0, err
    assert "stopped after" in rest
    assert "Traceback" not in err and "threads still running" not in err


def test_port_in_use_is_one_line(tiny_llama_dir):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "serve", "--model",
                               str(tiny_llama_dir), f"--port={port}", "--max-model-len=64",
                               "--device-memory=128MiB"], capture_output=True, text=True,
                              timeout=120)
    finally:
        s.close()
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_toml_and_json_inputs_are_checked_like_check_config(tmp_path):
    toml = tmp_path / "serve.toml"
    toml.write_text("[vmm]\nenable_vmm_kvcache = true\nenable_task_pipeline = true\n")
    code, out, err = _serve(["--config", str(toml)])
    cc = io.StringIO()
    assert check_config(["--config", str(toml)], out=cc, err=io.StringIO(), env={}) == 1
    assert code == 1 and _finding_lines(err) == _finding_lines(cc.getvalue())
    js = tmp_path / "engine.json"
    js.write_text('{"block_size": "lots"}')
    code, out, err = _serve([f"--config_json_file={js}"])
    cc = io.StringIO()
    check_config([f"--config_json_file={js}"], out=cc, err=io.StringIO(), env={})
    assert code == 1 and _finding_lines(err) == _finding_lines(cc.getvalue())
    assert _finding_lines(err)


def test_sigterm_drains_then_cancels_a_long_stream(tiny_llama_dir):
    proc, lines, url = _start(["--model", str(tiny_llama_dir), "--port", "0",
                               "--max-model-len=2048", "--device-memory=256MiB",
                               "--drain-timeout=0.5"])
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": "hello", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}) as r:
            lines_iter = r.iter_lines()
            next(lines_iter)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for line in lines_iter:
                if line.startswith("data: "):
                    events.append(line[6:])
        waited = time.monotonic() - t0
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    rest = proc.stdout.read()
    assert code == 0, proc.stderr.read()
    assert events[-1] == "[DONE]" and "shutting down" in events[-2]  # cancelled, told why
    assert len(events) < 2000 and waited < 30
    assert "1 request(s) cancelled" in rest


def test_a_second_signal_cancels_at_once(tiny_llama_dir):
    proc, lines, url = _start(["--model", str(tiny_llama_dir), "--port", "0",
                               "--max-model-len=2048", "--device-memory=256MiB",
                               "--drain-timeout=600"])
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": "hello", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}) as r:
            it = r.iter_lines()
            next(it)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            events = [line[6:] for line in it if line.startswith("data: ")]
        code = proc.wait(60)
        assert time.monotonic() - t0 < 30  # not the 600 s drain
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, proc.stderr.read()
    assert events[-1] == "[DONE]" and "shutting down" in events[-2]


def test_ignored_flags_lists_only_flags_without_effect():
    from xllm_vmm.cli.serve import ignored_flags
    from xllm_vmm.config import load

    cfg = load(["--port=9000", "--block_size=16", "--num_threads=4", "--enable_graph=true",
                "--nnodes=1", "--max_concurrent_requests=10"], env=None)
    assert ignored_flags(cfg) == ["enable_graph", "num_threads"]


def test_bad_event_loop_choice_stops_before_loading(monkeypatch):
    monkeypatch.setenv("XLLM_VMM_EVENT_LOOP", "twisted")
    code, out, err = _serve([])
    assert code == 1 and "XLLM_VMM_EVENT_LOOP" in err and "twisted" in err
    assert "ready" not in out and "loading" not in err.lower()


def _busy_port(host: str):
    import socket

    s = socket.socket()
    s.bind((host, 0))
    s.listen()
    return s, s.getsockname()[1]


def test_port_in_use_is_found_before_the_model_loads(tiny_llama_dir):
    s, port = _busy_port("127.0.0.1")
    try:
        t0 = time.monotonic()
        code, out, err = _serve(["--model", str(tiny_llama_dir), f"--port={port}",
                                 "--max-model-len=64", "--device-memory=128MiB"])
    finally:
        s.close()
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in err
    assert "nothing was loaded" in err and "loading" not in err and "sizing" not in out
    assert time.monotonic() - t0 < 60


def test_admin_open_to_the_network_without_a_key_is_warned(tiny_llama_dir):
    s, port = _busy_port("0.0.0.0")  # the serve stops at the bind: only the warning matters
    try:
        code, _, err = _serve(["--model", str(tiny_llama_dir), "--host", "0.0.0.0",
                               f"--port={port}", "--enable-admin"])
        _, _, keyed = _serve(["--model", str(tiny_llama_dir), "--host", "0.0.0.0",
                              f"--port={port}", "--enable-admin", "--api-key=k"])
        _, _, local = _serve(["--model", str(tiny_llama_dir), "--host", "127.0.0.1",
                              f"--port={port}", "--enable-admin"])
    finally:
        s.close()
    assert code == 1
    assert "warning: --enable-admin with --host 0.0.0.0 and no --api-key" in err
    assert "open to the network" in err
    assert "--enable-admin" not in keyed and "--enable-admin" not in local
