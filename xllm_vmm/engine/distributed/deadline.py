"""Collectives rank 0 can walk away from: a silent worker is detected by its heartbeat, not
by the collective timeout.

A worker that stops answering (``SIGSTOP``, a hung device) leaves every collective of rank 0
waiting until the serving group's timeout (``dist_timeout``). Rank 0's collectives are
therefore issued asynchronously and waited for in slices of :data:`SLICE_S` seconds; between
two slices the *abort* event is looked at — the runtime sets it when the watchdog calls a
worker lost (no heartbeat for ``dist_heartbeat_timeout`` seconds, shorter than
``dist_timeout``) — and a set event ends the wait with :class:`CollectiveAborted`. The
abandoned collective is never completed: the runtime is lost for good, its processes are
reaped and the group destroyed.

Ranks > 0 (``abort`` None) wait as ``torch.distributed`` does (they end with rank 0).
"""

from __future__ import annotations

import datetime as _dt
import pickle
import threading
from typing import Any

from xllm_vmm.engine.distributed.errors import DistributedError

SLICE_S = 0.05
"""Seconds of one wait slice (a completed collective returns at once; this bounds only how
late an abort is seen)."""

_SLICE = _dt.timedelta(seconds=SLICE_S)


class CollectiveAborted(DistributedError):
    """Rank 0 stopped waiting for a collective because a worker was lost (the runtime's
    failure names the rank)."""


def finish(work: Any, abort: threading.Event | None, what: str) -> None:
    """Wait for the async ``work`` of collective ``what``; :class:`CollectiveAborted` as soon
    as ``abort`` is set (None: wait as torch does)."""
    if abort is None:
        work.wait()
        return
    while True:
        if abort.is_set():
            raise CollectiveAborted(f"{what} abandoned: a worker of the set was lost")
        try:
            work.wait(_SLICE)
            return
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            if work.is_completed():  # completed right after the slice ran out (a race, not a
                work.wait()          # failure): its own result, or its own error, at once
                return


def all_reduce(x: Any, group: Any, abort: threading.Event | None) -> None:
    """``dist.all_reduce(x)`` (sum, in place) that ends early when ``abort`` is set."""
    import torch.distributed as dist

    finish(dist.all_reduce(x, group=group, async_op=True), abort, "all_reduce")


def gather(part: Any, bufs: list | None, group: Any, abort: threading.Event | None) -> None:
    """``dist.gather(part, bufs, dst=0)`` that ends early when ``abort`` is set."""
    import torch.distributed as dist

    finish(dist.gather(part, bufs, dst=0, group=group, async_op=True), abort, "gather")


def all_gather(rows: list, row: Any, group: Any, abort: threading.Event | None) -> None:
    """``dist.all_gather(rows, row)`` that ends early when ``abort`` is set."""
    import torch.distributed as dist

    finish(dist.all_gather(rows, row, group=group, async_op=True), abort, "all_gather")


def all_gather_object(obj: Any, world: int, group: Any,
                      abort: threading.Event | None) -> list[Any]:
    """Every rank's picklable ``obj`` (index = rank), as ``dist.all_gather_object``, in two
    abortable all-gathers (the byte lengths, then the padded bytes)."""
    import torch

    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(world)]
    all_gather(sizes, size, group, abort)
    n = max(int(s.item()) for s in sizes)
    buf = torch.zeros(n, dtype=torch.uint8)
    buf[:data.numel()] = data
    bufs = [torch.empty_like(buf) for _ in range(world)]
    all_gather(bufs, buf, group, abort)
    return [pickle.loads(b[:int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes)]
