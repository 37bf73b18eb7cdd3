"""Slot activation on every worker at once: the KV cache manager's ``SlotBacking`` for a
worker set (issue 14).

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.engine.distributed.runtime import Runtime
    from xllm_vmm.kvcache import VirtualKVCache


class FanoutBacking:
    def __init__(self, local: VirtualKVCache, runtime: Runtime) -> None:
        self.local = local
        self.runtime = runtime

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

    def __getattr__(self, name: str):  # anything else the allocator asks of its backing
        return getattr(self.local, name)
