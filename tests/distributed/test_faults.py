"""Faults of a spawned worker set (offline engine): a worker killed or stopped (silent) makes
the next step raise ``WorkerLost`` naming the rank — a silent one within the heartbeat
timeout, well before the collective timeout; never a hang — and shutdown still reaps every
process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.distributed.conftest import BASE, alive
from xllm_vmm.engine.distributed import DistributedError, WorkerLost
from xllm_vmm.engine.llm_engine import LLMEngine
from xllm_vmm.engine.sampling_params import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)


COLLECTIVE_S, HEARTBEAT_S = 120, 2


@pytest.mark.parametrize("how", ["killed", "silent"])
def test_lost_worker_is_named_and_reaped(llama_dir, how):
    eng = LLMEngine.from_flags(str(llama_dir), **BASE, dist_timeout=COLLECTIVE_S,
                               dist_heartbeat_timeout=HEARTBEAT_S, nnodes=2)
    pid = eng.distributed.worker_stats()[1]["pid"]
    heard = []
    eng.distributed.add_failure_listener(heard.append)
    try:
        eng.add_request("r", [5, 6, 7], SP)
        eng.step()
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerLost) as e:
            for _ in range(100):
                eng.step()
        took = time.monotonic() - t0
        assert e.value.rank == 1 and "worker rank 1" in str(e.value)
        assert ("exited with signal 9" if how == "killed" else "stopped answering") in str(e.value)
        # the heartbeat timeout plus slack, far below the collective timeout: a silent worker
        # no longer holds rank 0's step in a collective until it times out
        assert took < HEARTBEAT_S + 20 < COLLECTIVE_S
        assert heard and heard[0] is e.value
        with pytest.raises(WorkerLost):  # every later call fails the same way
            eng.step()
    finally:
        eng.shutdown()
    assert not alive(pid)


def test_heartbeat_timeout_must_be_below_the_collective_timeout(llama_dir):
    from xllm_vmm.config import ConfigError

    with pytest.raises(ConfigError, match=r"dist_heartbeat_timeout=5 s must be below "
                                          r"dist_timeout=5 s"):
        LLMEngine.from_flags(str(llama_dir), **BASE, nnodes=2, dist_timeout=5,
                             dist_heartbeat_timeout=5)


def test_a_worker_failing_at_start_up_fails_start_up_naming_it(llama_dir):
    # rank 1's emulated device cannot hold one KV slot: its engine refuses to build
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"worker rank 1 \(pid \d+\) exited with code 2 "
                                               "during start-up"):
        LLMEngine.from_flags(str(llama_dir), **BASE, nnodes=2,
                             worker_device_memory=[BASE["device_memory"], "4MiB"])
    assert time.monotonic() - t0 < 120  # at once, not after the start-up timeout (300 s)


def test_a_failed_command_keeps_the_protocol_in_step(llama_dir):
    eng = LLMEngine.from_flags(str(llama_dir), **BASE, nnodes=2)
    try:
        backing = eng.kv_cache_manager.cache.allocator.backing
        with pytest.raises(ValueError, match="duplicate pages"):
            backing.activate({"attn": [0, 0]})  # duplicate pages: refused on every rank
        eng.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        toks = []
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks += o.new_token_ids
        assert len(toks) == 3  # the worker set still steps together
        assert [s["rank"] for s in eng.distributed.refresh()] == [0, 1]
    finally:
        eng.shutdown()
