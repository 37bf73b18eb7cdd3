"""Slot activation on every worker at once: the KV cache manager's ``SlotBacking`` for a
worker set.

Block ids are the same on every worker, so a slot is one page offset across every tensor of
its group *on every worker*. :class:`FanoutBacking` replaces rank 0's
:class:`~xllm_vmm.kvcache.VirtualKVCache` as its allocator's backing:

- ``activate(slots)``: every worker maps the slots' pages in its own pool; all or nothing —
  when one worker's map fails ("not now": budget or device memory), every worker that mapped
  unmaps again, and the allocator sees ``False`` (invariant 3 across workers);
- ``deactivate(slots)``: every worker unmaps;
- ``move(moves)``: every worker copies the blocks (compaction); ``False`` when any worker's
  copy failed (the allocator then keeps the old blocks, which still hold their data
  everywhere).

Each call ends with the workers' status (budget left, mapped bytes), which refreshes the
admission cap of rank 0's pool (AD-02: the minimum across workers).

The same object is the host KV tier's copy driver on rank 0 (:meth:`copy_batch_async`,
:meth:`copy_batch`): a host-tier offload (device→host) or restore (host→device) is copied on
every worker, each between its own device blocks and its own host pool (same block ids, same
geometry: addresses travel as ``(region, offset)`` over :class:`CopyRegions`); the transfer
succeeds only when every worker's copy did — a failed one fails the transfer for the tier
(an offload is not indexed, a restore is computed instead, on every worker alike).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.kvcache import VirtualKVCache


class WorkerCalls(Protocol):
    """What the fan-out needs of the distributed runtime (``Runtime`` has it): whether the
    followers are up, one verb run on every worker with the local part on this rank, the
    check of the workers' statuses, and the group's address for errors. The runtime builds
    the fan-out; this keeps the fan-out from importing it back."""

    active: bool
    group: Any

    def call(self, op: str, payload: Any, local: Callable[[], dict | None]) -> list[dict]: ...

    def check_errors(self, op: str, statuses: list[dict]) -> None: ...


class CopyRegions:
    """The address spaces a host-tier copy touches on one worker: every tensor of every KV
    group (``tensor_va``, ``num_slots`` pages) and the host pool's buffer, in one order that
    is the same on every worker (their geometry is checked equal at attach). An address is
    ``(region, offset)`` between workers."""

    def __init__(self, cache: Any, host_pool: Any) -> None:
        spans = []
        for name in sorted(cache.geometry):
            geo = cache.geometry[name]
            for t in range(geo.num_tensors):
                spans.append((int(geo.tensor_va(t)), int(geo.num_slots * geo.page_bytes)))
        spans.append((int(host_pool.buffer.address),
                      int(host_pool.capacity * host_pool.block_bytes)))
        self.spans = spans
        self._order = sorted(range(len(spans)), key=lambda i: spans[i][0])
        self._bases = [spans[i][0] for i in self._order]

    def relative(self, addrs: Sequence[int]) -> list[tuple[int, int]]:
        out = []
        for a in addrs:
            k = bisect.bisect_right(self._bases, a) - 1
            i = self._order[k] if k >= 0 else -1
            if i < 0 or not a < self.spans[i][0] + self.spans[i][1]:
                raise ValueError(f"address {a:#x} is in no KV tensor and not in the host pool")
            out.append((i, a - self.spans[i][0]))
        return out

    def absolute(self, rel: Sequence[tuple[int, int]]) -> list[int]:
        return [self.spans[i][0] + off for i, off in rel]


class _Finished:
    """A transfer that is over (every worker copied synchronously): ``wait`` raises its error."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        if self.error is not None:
            raise self.error


def run_copy(driver: Any, regions: CopyRegions, payload: tuple) -> dict:
    """A worker's part of a fanned-out host-tier copy (``payload`` from rank 0)."""
    kind, dsts, srcs, sizes = payload
    driver.copy_batch(regions.absolute(dsts), regions.absolute(srcs), sizes, kind)
    return {"ok": True}


class FanoutBacking:
    def __init__(self, local: VirtualKVCache, runtime: WorkerCalls, *, copy_driver: Any = None,
                 regions: CopyRegions | None = None) -> None:
        self.local = local
        self.runtime = runtime
        self.copy_driver = copy_driver  # the host tier's driver on this rank (None: no tier)
        self.regions = regions

    def _plain(self, slots: Mapping[str, Sequence]) -> dict[str, list]:
        return {g: list(v) for g, v in slots.items()}

    def activate(self, slots: Mapping[str, Sequence[int]]) -> bool:
        if not self.runtime.active:
            return self.local.activate(slots)
        slots = self._plain(slots)
        statuses = self.runtime.call("activate", slots,
                                     lambda: {"ok": bool(self.local.activate(slots))})
        ok_here = statuses[0]["ok"]
        ok = all(s["ok"] for s in statuses)
        if not ok and ok_here:
            self.local.deactivate(slots)
        self.runtime.check_errors("activate", statuses)
        return ok

    def deactivate(self, slots: Mapping[str, Sequence[int]]) -> None:
        if not self.runtime.active:
            self.local.deactivate(slots)
            return
        slots = self._plain(slots)
        self.runtime.call("deactivate", slots, lambda: self.local.deactivate(slots) or {})

    def move(self, moves: Mapping[str, Sequence[tuple[int, int]]]) -> bool:
        if not self.runtime.active:
            return self.local.move(moves)
        moves = {g: [tuple(p) for p in v] for g, v in moves.items()}
        statuses = self.runtime.call("move", moves, lambda: {"ok": bool(self.local.move(moves))})
        return all(s["ok"] for s in statuses)

    # -- the host tier's copies (rank 0's tier calls these as its driver) ---------------------
    def copy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                   kind: Any) -> None:
        """Copy on every worker (each its own blocks and host pool); raises the first
        failure — this rank's, or a :class:`DistributedError` naming the worker."""
        from xllm_vmm.engine.distributed.errors import DistributedError

        if not self.runtime.active:
            self.copy_driver.copy_batch(dsts, srcs, sizes, kind)
            return
        rel = self.regions
        payload = (kind, rel.relative(dsts), rel.relative(srcs), [int(n) for n in sizes])
        box: dict[str, BaseException] = {}

        def here() -> dict:
            try:
                self.copy_driver.copy_batch(dsts, srcs, sizes, kind)
            except Exception as e:  # noqa: BLE001 - reported like any worker's failure
                box["error"] = e
                return {"ok": False}
            return {"ok": True}

        statuses = self.runtime.call("copy", payload, here)
        if "error" in box:
            raise box["error"]
        bad = next((s for s in statuses[1:] if not s.get("ok")), None)
        if bad is not None:
            raise DistributedError(f"host-tier copy failed on worker rank {bad['rank']}: "
                                   f"{bad.get('error', 'failed')}", rank=bad["rank"],
                                   address=self.runtime.group.address)

    def copy_batch_async(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                         kind: Any) -> Any:
        """:meth:`copy_batch` on every worker, returned as a finished transfer (its ``wait``
        raises when any worker's copy failed): all or nothing for the tier."""
        if not self.runtime.active:
            return self.copy_driver.copy_batch_async(dsts, srcs, sizes, kind)
        try:
            self.copy_batch(dsts, srcs, sizes, kind)
        except Exception as e:  # noqa: BLE001 - the tier finishes the copy as failed
            from xllm_vmm.engine.distributed.errors import WorkerLost

            if isinstance(e, WorkerLost):
                raise
            return _Finished(e)
        return _Finished(None)

    def __getattr__(self, name: str):  # anything else the allocator asks of its backing
        return getattr(self.local, name)
