"""Fork across workers: ``LLMEngine.fork()`` on a 2-worker engine forks on every worker — each
worker's weight shard forked over the same pages (+0 weight bytes per worker, measured on each
worker's device), the fork's own pool and KV cache on every worker — over the worker set's one
command channel. The parent and the fork serve interleaved requests (one thread, and two
threads at once) with outputs token for token equal to a 1-worker parent and fork; closing the
fork releases its device bytes on every worker; a fork that fails on one worker is closed on
every worker and names it; a worker lost during a fork fails it naming the rank; sleeping the
parent (a barrier) leaves the awake fork's weight pages mapped on every worker."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.distributed.conftest import BASE, alive
from xllm_vmm.engine.distributed import DistributedError, WorkerLost
from xllm_vmm.engine.llm_engine import LLMEngine
from xllm_vmm.engine.sampling_params import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
P1 = list(range(5, 45))  # 40 tokens: two full blocks (prefix cache)
P2 = [9, 4, 17, 33, 2, 8, 21, 5, 13, 40, 11, 6, 30, 19, 7, 25, 3]
VMM = {"enable_vmm_kvcache": True, "enable_vmm_weights": True}
FIXED_CACHE = 12 << 20  # max_cache_size of the fixed runs: weights (2 MiB) + an 8 MiB KV cache
SMALL = "36MiB"  # a worker's device that holds the fixed parent but not a second KV cache
MODES = {
    "elastic-prefix": {**VMM, "vmm_elastic": True, "enable_prefix_cache": True},
    "fixed": {**VMM, "vmm_elastic": False, "enable_prefix_cache": False,
              "max_cache_size": FIXED_CACHE},
}


def interleaved(parent, child) -> dict[str, list[int]]:
    """Requests on both instances, stepped alternately, the second pair admitted while the
    first runs; every request's tokens by ``instance/request``."""
    out: dict[str, list[int]] = {}
    engines = {"parent": parent, "fork": child}
    parent.add_request("a", P1, SP)
    child.add_request("a", P2, SP)
    n = 0
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, e in engines.items():
            for o in e.step():
                out.setdefault(f"{name}/{o.request_id}", []).extend(o.new_token_ids)
        n += 1
        if n == 2:
            parent.add_request("b", P2, SP)
            child.add_request("b", P1, SP)
    return out


def threaded(parent, child) -> dict[str, list[int]]:
    """Each instance stepped by its own thread at the same time (as ``serve`` runs a parent
    and its fork): the worker set's command lock keeps their commands apart."""
    out: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def run(name, eng, prompts):
        try:
            for i, p in enumerate(prompts):
                eng.add_request(f"t{i}", p, SP)
            while eng.has_unfinished_requests():
                for o in eng.step():
                    out.setdefault(f"{name}/{o.request_id}", []).extend(o.new_token_ids)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            errors.append(e)

    ts = [threading.Thread(target=run, args=("parent", parent, [P2, P1])),
          threading.Thread(target=run, args=("fork", child, [P1, P2, P1[:20]]))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not errors, errors
    assert not any(t.is_alive() for t in ts)
    return out


def foreign_bytes(eng) -> list[int]:
    """Per rank: device bytes in use that are not the parent's pool (a fork's pool, or a
    leak)."""
    return [s["device_used_bytes"] - s["held_bytes"] for s in eng.distributed.refresh()]


def session(eng) -> dict:
    child = eng.fork()
    try:
        shares = child.weights.shares_pages_with(eng.weights)
        first = interleaved(eng, child)
        both = threaded(eng, child)
        report = child.distributed.fork_workers if child.distributed is not None else None
        during = foreign_bytes(eng) if eng.distributed is not None else None
    finally:
        child.shutdown()
    after = run_one(eng, "after")
    return {"shares": shares, "first": first, "both": both, "report": report,
            "during": during, "after": after}


def run_one(eng, rid) -> list[int]:
    eng.add_request(rid, P1, SP)
    toks: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks += o.new_token_ids
    return toks


@pytest.mark.parametrize("model,mode", [("llama_dir", "elastic-prefix"), ("llama_dir", "fixed"),
                                        ("qwen3_dir", "elastic-prefix")])
def test_fork_on_every_worker_matches_one_worker(request, model, mode):
    llama_dir = request.getfixturevalue(model)  # the checkpoint (a Llama or a Qwen3)
    flags = {**BASE, **MODES[mode]}
    one = LLMEngine.from_flags(str(llama_dir), **flags)
    try:
        ref = session(one)
    finally:
        one.shutdown()
    assert ref["shares"] and len(ref["first"]) == 4 and len(ref["both"]) == 5

    eng = LLMEngine.from_flags(str(llama_dir), **flags, nnodes=2)
    try:
        base = foreign_bytes(eng)
        got = session(eng)
        assert got["shares"]
        assert got["first"] == ref["first"]  # token for token, interleaved
        assert got["both"] == ref["both"]    # two threads at once
        assert got["after"] == ref["after"]  # the parent outlives its fork
        report = got["report"]
        assert [w["rank"] for w in report] == [0, 1]
        for w in report:  # each worker's shard forked over its pages: no weight byte added
            assert w["weight_bytes_added"] == 0 and w["parent_pool_bytes_added"] == 0
            assert w["device_bytes_added"] == w["pool_held_bytes"]
            if mode == "fixed":  # a fixed pool backs the fork's whole KV cache at once
                assert w["pool_held_bytes"] > 0
        # the fork's cache lived on both workers; closing it gave every byte back on both
        assert all(d > b for d, b in zip(got["during"], base))
        assert foreign_bytes(eng) == base
        assert eng.weights.stats()["instances"] == 1
    finally:
        eng.shutdown()


def test_fork_with_the_host_tier_is_refused_across_workers(llama_dir):
    from xllm_vmm.config import ConfigError

    eng = LLMEngine.from_flags(str(llama_dir), **BASE, **VMM, vmm_elastic=True, nnodes=2,
                               host_blocks_factor=1.0)
    try:
        with pytest.raises(ConfigError, match="host_blocks_factor=1: fork across 2 workers"):
            eng.fork()
        assert eng.weights.stats()["instances"] == 1
        assert len(run_one(eng, "r")) == SP.max_tokens  # the worker set still steps together
    finally:
        eng.shutdown()


def test_a_fork_failing_on_one_worker_is_closed_on_every_worker(llama_dir):
    # rank 1's device holds the parent (weights + its fixed KV cache) but not a second cache
    eng = LLMEngine.from_flags(str(llama_dir), **BASE, **VMM, vmm_elastic=False, nnodes=2,
                               max_cache_size=FIXED_CACHE,
                               worker_device_memory=[BASE["device_memory"], SMALL])
    try:
        base = foreign_bytes(eng)
        with pytest.raises(DistributedError, match=r"fork failed on worker rank 1: ") as e:
            eng.fork()
        assert e.value.rank == 1 and not isinstance(e.value, WorkerLost)
        assert foreign_bytes(eng) == base  # nothing of the fork left on either worker
        assert eng.weights.stats()["instances"] == 1
        assert not eng._forks
        assert len(run_one(eng, "r")) == SP.max_tokens
    finally:
        eng.shutdown()


def test_a_worker_lost_during_a_fork_is_named(llama_dir):
    heartbeat = 2
    eng = LLMEngine.from_flags(str(llama_dir), **BASE, **VMM, vmm_elastic=True, nnodes=2,
                               dist_timeout=120, dist_heartbeat_timeout=heartbeat)
    pid = eng.distributed.worker_stats()[1]["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)  # rank 1 gets the fork command and never answers
        t0 = time.monotonic()
        with pytest.raises(WorkerLost) as e:
            eng.fork()
        assert e.value.rank == 1 and "worker rank 1 stopped answering" in str(e.value)
        assert time.monotonic() - t0 < heartbeat + 30 < 120  # not the collective timeout
        assert not eng._forks and eng.weights.stats()["instances"] == 1
        with pytest.raises(WorkerLost):
            eng.fork()
    finally:
        eng.shutdown()
    assert not alive(pid)


def test_admin_fork_route_on_a_two_process_launch(llama_dir):
    """``POST /fork`` on rank 0 of an operator's two-process launch forks on both workers;
    the fork's completions equal one worker's, and the route reports per-worker bytes."""
    import openai

    from tests.distributed.test_serve_launch import (finish, free_port, kill_leftovers,
                                                     ready_url, reference_text, serve)

    want = reference_text(llama_dir)
    master = f"127.0.0.1:{free_port()}"
    extra = ("--enable-admin", "--enable_vmm_kvcache=true", "--vmm_elastic=true",
             "--enable_vmm_weights=true")
    r0 = serve(llama_dir, 0, master, *extra)
    r1 = serve(llama_dir, 1, master, *extra)
    try:
        import httpx

        from tests.distributed.test_serve_launch import PROMPT

        url = ready_url(r0)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        model = client.models.list().data[0].id
        r = httpx.post(f"{url}/fork", json={"name": "fork"}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [w["rank"] for w in body["workers"]] == [0, 1]
        assert all(w["weight_bytes_added"] == 0 for w in body["workers"])
        for name in (model, "fork", model):
            got = client.completions.create(model=name, prompt=PROMPT, max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert got.choices[0].text == want, name
        r0.terminate()  # the operator stops the service: parent, fork and worker go
        code0, _, err0 = finish(r0)
        code1, out1, err1 = finish(r1)
    finally:
        kill_leftovers(r0, r1)
    assert code0 == 0, err0
    assert code1 == 0, out1 + err1


def test_sleeping_the_parent_leaves_the_fork_serving_on_every_worker(llama_dir):
    eng = LLMEngine.from_flags(str(llama_dir), **BASE, **MODES["elastic-prefix"], nnodes=2)
    try:
        ref = run_one(eng, "r0")
        child = eng.fork()
        rep = eng.sleep(1)  # a barrier on both workers; the fork stays awake
        assert [w["rank"] for w in rep["workers"]] == [0, 1]
        for w in rep["workers"]:  # only the parent's KV goes: the awake fork uses the weights
            assert w["bytes_freed"] == w["kv_bytes_freed"] > 0
        assert run_one(child, "f") == ref
        eng.wake_up()
        assert run_one(eng, "r1") == ref
        child.shutdown()
        assert run_one(eng, "r2") == ref
    finally:
        eng.shutdown()
