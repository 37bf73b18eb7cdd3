"""Bookkeeping of tensor views over a driver's arena, so that none outlives its reservation.

A view (see :mod:`xllm_vmm.vmm.tensor`) keeps an *owner* object alive for as long as any tensor
sharing its storage lives. The registry holds a weak reference to each owner together with the
range it covers; :meth:`check_release` refuses to release a reservation (and :meth:`check_close`
to close the driver) while an owner over it is still alive. Pages under a view may be unmapped
and re-mapped while the view lives (that is how the KV cache works: the view spans the arena and
only mapped pages may be touched); the reservation itself may not go away.
"""

from __future__ import annotations

import errno
import itertools
import threading
import weakref

from xllm_vmm.vmm.driver import VmmBusy


class ViewRegistry:
    """Live view ranges ``[va, va + nbytes)`` of one driver."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, tuple[int, int, str]] = {}
        self._ids = itertools.count()

    def register(self, owner: object, va: int, nbytes: int, what: str = "tensor view") -> None:
        """Tracks ``owner`` (must support weak references) as covering ``[va, va+nbytes)``."""
        key = next(self._ids)
        with self._lock:
            self._live[key] = (va, nbytes, what)
        weakref.finalize(owner, self._drop, key)

    def _drop(self, key: int) -> None:
        with self._lock:
            self._live.pop(key, None)

    def live(self, va: int | None = None, size: int | None = None) -> list[tuple[int, int, str]]:
        """Live views overlapping ``[va, va+size)`` (all views when ``va`` is None)."""
        with self._lock:
            views = list(self._live.values())
        if va is None:
            return views
        end = va + (size or 0)
        return [v for v in views if v[0] < end and va < v[0] + v[1]]

    def check_release(self, va: int, size: int) -> None:
        views = self.live(va, size)
        if views:
            first = views[0]
            raise VmmBusy("release", errno.EBUSY, "",
                          f"{len(views)} {first[2]}(s) over the reservation at {va:#x} are still "
                          f"alive (first: {first[1]} bytes at {first[0]:#x}); drop every tensor "
                          "made from them before releasing")

    def check_close(self) -> None:
        views = self.live()
        if views:
            raise VmmBusy("close", errno.EBUSY, "",
                          f"{len(views)} tensor view(s) over the driver's arena are still alive; "
                          "drop them before closing the driver")
