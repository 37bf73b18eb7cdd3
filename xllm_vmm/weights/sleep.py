"""``SleepController``: one instance's sleep and wakeup over its weights and the other tenants
that can sleep (the KV cache manager), for the engine to call.

A tenant is anything with ``sleep() -> int`` (device bytes released; it raises when it cannot
sleep now) and ``wake_up() -> None`` (:class:`Sleepable`); ``KVCacheManager`` is one.

Order and atomicity:

- sleep: the running-request check first (``busy``: the engine's count, or a function giving
  it; more than 0 is :class:`~xllm_vmm.weights.errors.SleepRefused`), then every tenant, then the
  weights. If one of them fails, the tenants already asleep are woken again and the error is
  raised: the instance stays awake. Deepening a light sleep (level 2 after level 1) touches
  only the weights (the tenants are asleep already).
- wakeup: the weights first (all or nothing, :mod:`xllm_vmm.weights.store`), then the tenants.
  If a tenant fails to wake, the tenants woken so far sleep again and the weights go back to
  the level they were at; the error is raised. Both are idempotent.

Without weight VMM (no weights given, or weights loaded without a VMM pool) sleep and wakeup
are refused with W-02 (:class:`~xllm_vmm.weights.errors.WeightVmmRequired`).

Draining (wait until no request runs, then sleep) is the engine's: it keeps stepping until
idle. :func:`wait_idle` serves an engine whose loop runs on another thread.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence, runtime_checkable

from xllm_vmm.weights.errors import SleepRefused, WeightVmmRequired
from xllm_vmm.weights.model_weights import (LIGHT_SLEEP, WAKEUP, Busy, ModelWeights,
                                            SleepReport, WakeReport, _busy_count)
from xllm_vmm.weights.phases import PhaseClock

__all__ = ["Sleepable", "SleepController", "wait_idle"]


@runtime_checkable
class Sleepable(Protocol):
    """A tenant that releases its device memory while the instance sleeps."""

    def sleep(self) -> int:
        """Release device memory; returns the bytes released. Raises when it cannot now."""
        ...

    def wake_up(self) -> None:
        """Allow device memory again. Idempotent."""
        ...


def wait_idle(busy: Callable[[], int], timeout: float | None, *, poll: float = 0.005) -> None:
    """Waits until ``busy()`` is 0, for at most ``timeout`` seconds (None: no limit); raises
    :class:`SleepRefused` with the count still running when the time is up."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        n = _busy_count(busy)
        if n == 0:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise SleepRefused(n)
        time.sleep(poll)


class SleepController:
    """See the module docstring."""

    def __init__(self, weights: ModelWeights | None, tenants: Sequence[Sleepable] = ()) -> None:
        for t in tenants:
            if not isinstance(t, Sleepable):
                raise TypeError(f"{t!r} is not sleepable: it needs sleep() -> int and "
                                "wake_up() -> None")
        self.weights = weights
        self.tenants = tuple(tenants)

    def _weights(self, action: str) -> ModelWeights:
        if self.weights is None or not self.weights.vmm:
            raise WeightVmmRequired(action)
        return self.weights

    @property
    def state(self) -> str:
        return WAKEUP if self.weights is None else self.weights.state

    def is_sleeping(self) -> bool:
        return self.state in ("LIGHT_SLEEP", "DEEP_SLEEP")

    def sleep(self, level: int = 1, *, busy: Busy = None) -> SleepReport:
        """Sleeps the tenants and the weights (see the module docstring)."""
        t0 = time.perf_counter()
        tenant_seconds = 0.0
        w = self._weights("sleep")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (light) or 2 (deep), got {level!r}")
        n = _busy_count(busy)
        if n:
            raise SleepRefused(n)
        tenant_bytes = 0
        slept: list[Sleepable] = []
        if w.state == WAKEUP:
            try:
                for t in self.tenants:
                    t1 = time.perf_counter()
                    tenant_bytes += int(t.sleep())
                    tenant_seconds += time.perf_counter() - t1
                    slept.append(t)
                report = w.sleep(level)
            except BaseException:
                for t in reversed(slept):
                    t.wake_up()
                raise
        else:
            report = w.sleep(level)
        seconds = time.perf_counter() - t0
        return SleepReport(level, w.state, report.bytes_freed + tenant_bytes,
                           report.host_bytes_freed, seconds, tenants_bytes_freed=tenant_bytes,
                           phases=_with_tenants(report.phases, tenant_seconds, seconds))

    def wake_up(self) -> WakeReport:
        """Wakes the weights, then the tenants (see the module docstring)."""
        t0 = time.perf_counter()
        w = self._weights("wakeup")
        before = w.state
        report = w.wake_up()
        woken: list[Sleepable] = []
        t1 = time.perf_counter()
        try:
            for t in self.tenants:
                t.wake_up()
                woken.append(t)
        except BaseException:
            for t in reversed(woken):
                t.sleep()
            if before != WAKEUP:
                w.sleep(1 if before == LIGHT_SLEEP else 2)
            raise
        tenant_seconds = time.perf_counter() - t1
        seconds = time.perf_counter() - t0
        return WakeReport(w.state, report.source, report.bytes_mapped, seconds,
                          phases=_with_tenants(report.phases, tenant_seconds, seconds))


def _with_tenants(phases: dict[str, float], tenant_seconds: float,
                  seconds: float) -> dict[str, float]:
    """The weights' phases plus ``tenants``; ``other`` is recomputed against the controller's
    wall time ``seconds`` (its own bookkeeping included)."""
    clock = PhaseClock()
    for name, s in phases.items():
        if name != "other":
            clock.add(name, s)
    if tenant_seconds:
        clock.add("tenants", tenant_seconds)
    return clock.finish(seconds)
