"""What ``xllm-vmm serve`` does differently in a worker set.

As in the engine's multi-node launch: every process gets the same command line with its own
``--node_rank`` (and ``--devices``); rank 0 serves HTTP on ``--port`` and runs the scheduler;
the other ranks open no HTTP port — they join rank 0 at ``--master_node_addr`` and run its
steps (:func:`run_worker_rank`). On rank 0, :func:`watch_workers` turns a lost worker into
``/health`` 503 (the front's failure) and a clean stop of the server naming the rank.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TextIO

UNHEALTHY_GRACE_S = 2.0
"""Seconds rank 0 keeps answering ``/health`` 503 after a worker is lost, before it stops
(probes and load balancers see the failure, not just a closed port)."""


def run_worker_rank(engine: Any, out: TextIO, err: TextIO) -> int:
    """Serve rank 0's commands until it shuts the worker set down (exit 0) or is gone (exit
    1, the reason on ``err``); the engine is released either way."""
    rt = engine.distributed
    out.write(f"xllm-vmm serve: worker rank {rt.rank} of {rt.world} joined rank 0 at "
              f"{rt.group.address}; no HTTP port on this rank\n")
    out.flush()
    try:
        code = rt.serve(engine)
    finally:
        engine.shutdown()
    if code == 0:
        out.write(f"xllm-vmm serve: worker rank {rt.rank} stopped with rank 0\n")
        out.flush()
        return 0
    err.write(f"error: worker rank {rt.rank}: rank 0 at {rt.group.address} is gone; stopped\n")
    return 1


def watch_workers(engine: Any, front: Any, stop: Callable[[], None]) -> list:
    """On rank 0 of a worker set: when a worker is lost, mark the front failed (``/health``
    503, new requests 503) and call ``stop()`` (thread-safe) :data:`UNHEALTHY_GRACE_S` later. Returns a list that holds the
    :class:`~xllm_vmm.engine.distributed.errors.WorkerLost` once it happened (empty: none;
    also empty at world size 1, where nothing is watched)."""
    seen: list = []
    rt = getattr(engine, "distributed", None)
    if rt is None or rt.rank != 0:
        return seen

    def lost(e: Exception) -> None:
        seen.append(e)
        mark = getattr(front, "mark_failed", None)
        if mark is not None:
            mark(str(e))
        t = threading.Timer(UNHEALTHY_GRACE_S, stop)
        t.daemon = True
        t.start()

    rt.add_failure_listener(lost)
    return seen
