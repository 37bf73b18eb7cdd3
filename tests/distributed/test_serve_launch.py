"""The launch-script path: ``xllm-vmm serve --nnodes=2 --node_rank=0|1
--master_node_addr=127.0.0.1:PORT`` as two processes, as an operator's script starts them.
Rank 0 serves HTTP (the official ``openai`` client gets the same greedy text as one worker);
rank 1 opens no port. A killed worker makes /health 503 and rank 0 exit 1 naming the rank; a
bad master address or a rank that never arrives fails start-up after the timeout with an
error naming the address."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.distributed.conftest import BASE

TIMEOUT = "6"  # XLLM_VMM_DIST_TIMEOUT: collectives while serving; heartbeat staleness too
PROMPT = "The quick brown fox"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model, rank: int, master: str, *extra: str, startup: str = "300",
          **env: str) -> subprocess.Popen:
    args = ["--model", str(model), "--port", "0", "--nnodes=2", f"--node_rank={rank}",
            f"--master_node_addr={master}", f"--block_size={BASE['block_size']}",
            f"--device-memory={BASE['device_memory']}", *extra]
    return subprocess.Popen([sys.executable, "-m", "xllm_vmm.cli", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1",
                                     XLLM_VMM_DIST_TIMEOUT=TIMEOUT,
                                     XLLM_VMM_DIST_STARTUP_TIMEOUT=startup,
                                     TORCH_CPP_LOG_LEVEL="ERROR") | env)


def ready_url(proc: subprocess.Popen, deadline_s: float = 120) -> str:
    lines = []
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "ready at " in line:
            return line.split("ready at ", 1)[1].split()[0]
    proc.kill()
    raise AssertionError("no ready line:\n" + "".join(lines) + proc.communicate()[1])


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"process did not exit in {timeout} s:\n{out}\n{err}")
    return proc.returncode, out, err


def kill_leftovers(*procs: subprocess.Popen) -> None:
    """Kill and reap whichever of ``procs`` still runs (a test's ``finally``: nothing is left
    behind when an assertion stopped it before its processes exited)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def reference_text(model) -> str:
    from xllm_vmm import LLM, SamplingParams

    llm = LLM(model=str(model), **BASE)
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        return out[0].outputs[0].text
    finally:
        llm.llm_engine.shutdown()


def test_two_process_launch_serves_then_a_killed_worker_stops_it(llama_dir):
    import openai

    want = reference_text(llama_dir)
    master = f"127.0.0.1:{free_port()}"
    r0 = serve(llama_dir, 0, master)
    r1 = serve(llama_dir, 1, master)
    try:
        url = ready_url(r0)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        assert httpx.get(f"{url}/health").status_code == 200
        metrics = httpx.get(f"{url}/metrics").text
        assert 'xllm_vmm_worker_mapped_bytes{model_name=' in metrics and 'rank="1"' in metrics
        assert "xllm_vmm_all_reduce_seconds_per_step" in metrics
        r1.kill()  # a worker dies
        r1.wait(10)
        deadline = time.monotonic() + 30
        health = None
        while time.monotonic() < deadline:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 503:
                health = r.json()["error"]["message"]
                break
            time.sleep(0.1)
        code, out, err = finish(r0)
    finally:
        kill_leftovers(r0, r1)
    assert health is not None and "worker rank 1" in health
    assert code == 1, err
    assert "worker rank 1" in err and "Traceback" not in err
    assert "worker rank 1 lost" in out


def test_a_silent_worker_mid_request_stops_the_server_before_the_collective_timeout(llama_dir):
    # rank 1 stops answering (SIGSTOP) while rank 0 steps a long request: rank 0's step waits in
    # a collective on it; the heartbeat (2 s), not the collective timeout (120 s), ends the wait
    slow = {"XLLM_VMM_DIST_TIMEOUT": "120", "XLLM_VMM_DIST_HEARTBEAT_TIMEOUT": "2"}
    master = f"127.0.0.1:{free_port()}"
    r0 = serve(llama_dir, 0, master, **slow)
    r1 = serve(llama_dir, 1, master, **slow)
    health = None
    try:
        url = ready_url(r0)
        body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)  # the request is being stepped
            r1.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            rest = "".join(lines)  # the stream ends (with an error) once the worker is lost
        while time.monotonic() - t0 < 60:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 503:
                health = r.json()["error"]["message"]
                break
            time.sleep(0.1)
        code, out, err = finish(r0)
        took = time.monotonic() - t0
    finally:
        kill_leftovers(r0, r1)
    assert health is not None and "worker rank 1 stopped answering" in health, (health, rest)
    assert code == 1, err
    assert "worker rank 1" in err and "Traceback" not in err
    assert took < 60 < 120  # detected by the heartbeat, not by the collective timeout


def test_worker_rank_exits_with_rank_0(llama_dir):
    master = f"127.0.0.1:{free_port()}"
    r0 = serve(llama_dir, 0, master)
    r1 = serve(llama_dir, 1, master)
    try:
        ready_url(r0)
        r0.terminate()  # operator stops the service at rank 0
        code0, _, err0 = finish(r0)
        code1, out1, err1 = finish(r1)
    finally:
        kill_leftovers(r0, r1)
    assert code0 == 0, err0
    assert code1 == 0, out1 + err1
    assert "no HTTP port on this rank" in out1 and "stopped with rank 0" in out1


@pytest.mark.parametrize("rank", [0, 1])
def test_missing_peer_fails_start_up_after_the_timeout(llama_dir, rank):
    master = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    code, out, err = finish(serve(llama_dir, rank, master, startup=TIMEOUT), timeout=90)
    took = time.monotonic() - t0
    assert code == 1
    assert master in err and "Traceback" not in err
    if rank == 0:
        assert "rank(s) 1 never arrived" in err
    else:
        assert "could not reach the rendezvous" in err
    assert took >= float(TIMEOUT)
