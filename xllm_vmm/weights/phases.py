"""Where a sleep or a wakeup spends its time: wall-clock seconds per named phase.

A :class:`PhaseClock` is started when a transition starts; the code adds the seconds of each
phase it runs (:meth:`PhaseClock.phase` around a block, or :meth:`PhaseClock.add`), and
:meth:`PhaseClock.finish` returns them with ``other`` = the transition's wall time minus the
named phases (bookkeeping: locks, Python, the pool's tables). Phases that did not run are
absent, so the values always add up to the wall time.

Phase names (one home, used by :mod:`xllm_vmm.weights.store`, the controller and
``bench weights``):

- sleep: ``sync`` (waiting for in-flight copies before unmapping), ``host_copy`` (a light
  sleep that has to make the host copy: device-to-host), ``unmap`` (the driver's batched
  unmap), ``release`` (freeing the physical pages: the driver's handle frees; on the host
  driver the kernel freeing the memfd's pages), ``host_free`` (a deep sleep dropping the
  host copy), ``tenants`` (the KV cache manager's sleep, controller only);
- wakeup: ``check`` (a deep wakeup checking the checkpoint files are unchanged), ``commit``
  (creating the physical pages: on the host driver the kernel allocates *and zeroes* them —
  for huge-page backings every page is written here, so the copy takes no page fault),
  ``map`` (the driver's batched map), ``copy`` (host copy to device; on the host driver with
  4 KiB pages this includes the first-touch page faults), ``reload`` (a deep wakeup reading
  the checkpoint files into the region), ``tenants`` (the KV cache manager's wakeup).

Units: seconds (``time.perf_counter``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

__all__ = ["PhaseClock", "SLEEP_PHASES", "WAKE_PHASES"]

SLEEP_PHASES = ("sync", "host_copy", "unmap", "release", "host_free", "tenants", "other")
WAKE_PHASES = ("check", "commit", "map", "copy", "reload", "tenants", "other")


class PhaseClock:
    """Seconds per phase of one transition (see the module docstring)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        """Adds ``seconds`` (>= 0; a negative difference of two clocks counts as 0) to
        ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with clock.phase("copy"): ...`` adds the block's wall time to ``name``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def finish(self, total: float | None = None) -> dict[str, float]:
        """The named phases and ``other`` = ``total`` (default: seconds since the clock
        started) minus their sum, never negative."""
        total = self.elapsed() if total is None else total
        out = dict(self.seconds)
        out["other"] = max(0.0, total - sum(out.values()))
        return out
