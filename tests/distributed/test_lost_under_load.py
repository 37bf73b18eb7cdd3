"""A worker killed while twenty requests are in flight: rank 0 answers them 500 naming the lost
rank, then stops with one line and exit 1 — no traceback, nothing left mapped."""

from __future__ import annotations

import threading
import time

import httpx

from tests.distributed.test_serve_launch import finish, free_port, kill_leftovers, ready_url, serve


def test_a_worker_killed_under_load_ends_rank_0_in_one_line(llama_dir):
    master = f"127.0.0.1:{free_port()}"
    r0 = serve(llama_dir, 0, master, "--max-model-len=256")
    r1 = serve(llama_dir, 1, master, "--max-model-len=256")
    codes: list = []
    try:
        url = ready_url(r0)

        def one(i):
            try:
                r = httpx.post(f"{url}/v1/completions", timeout=60,
                               json={"prompt": f"request {i} says", "max_tokens": 200,
                                     "ignore_eos": True})
                codes.append(r.status_code)
            except httpx.HTTPError:
                codes.append("dropped")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # all twenty admitted and decoding
        r1.kill()
        r1.wait(10)
        for t in threads:
            t.join(90)
        code, out, err = finish(r0, timeout=90)
    finally:
        kill_leftovers(r0, r1)
    assert code == 1, err
    assert "Traceback" not in err and "VmmBusy" not in err, err[-3000:]
    assert "worker rank 1" in err and "worker rank 1 lost" in out
    assert 500 in codes or "dropped" in codes
