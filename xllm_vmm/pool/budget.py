"""The memory budget of a VMM pool, in bytes: how much physical memory the pool may hold.

Three modes (:class:`BudgetMode`), exactly as the specification puts them:

- ``physical`` (``enable_vmm_kvcache=false``): one plain resident allocation sized at start by
  ``max_memory_utilization`` (and capped by ``max_cache_size`` when set).
- ``fixed`` (a VMM pool with ``vmm_elastic=false``): sized at start like ``physical``, fully
  mapped at start, never returns memory (EL-03).
- ``elastic`` (``vmm_elastic=true``): the pool grows while
  ``free − execution_peak − reserve_bytes ≥ 0`` after the growth, and while the pool stays within
  ``max_cache_size`` when that is positive (EL-07). ``max_memory_utilization`` plays no part
  (EL-02). ``free`` is read from the driver at every decision, so memory released outside the
  pool becomes usable without a restart.

Static capacity (physical, fixed)::

    capacity = max_memory_utilization × total − (total − free) − execution_peak
    capacity = min(capacity, max_cache_size)            when max_cache_size > 0

rounded down to whole pages. ``total − free`` is what the device already holds (weights,
resident graphs) when the pool is sized.

The execution peak is an observation the engine reports at run time
(:meth:`ExecutionPeak.observe`). Until it reports one, a conservative default is used:
:data:`DEFAULT_EXECUTION_HEADROOM_FRACTION` of the device's total memory. A reserve of 0 still
keeps that headroom (the specification: "vmm_memory_reserve_bytes=0 still preserves runtime
execution headroom").

This module takes plain numbers; it does not depend on the configuration package.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "BudgetMode",
    "BudgetConfig",
    "BudgetConfigError",
    "ExecutionPeak",
    "DEFAULT_EXECUTION_HEADROOM_FRACTION",
    "static_capacity_bytes",
    "budget_bytes",
]

DEFAULT_EXECUTION_HEADROOM_FRACTION = 0.05
"""Execution headroom kept before the engine has observed a peak: 5 % of total device memory."""


class BudgetMode(str, enum.Enum):
    PHYSICAL = "physical"
    FIXED = "fixed"
    ELASTIC = "elastic"


class BudgetConfigError(ValueError):
    """A budget setting is out of range. The message names the flag and what to do."""


@dataclass(frozen=True)
class BudgetConfig:
    """The numbers that decide a pool's budget.

    ``max_memory_utilization``: ratio of total device memory (physical, fixed; ignored in
    elastic mode). ``max_cache_size``: byte quota of the whole pool (KV + weights), 0 = none.
    ``reserve_bytes``: ``vmm_memory_reserve_bytes``, kept free beside the execution peak.
    ``execution_peak_bytes``: the observed execution peak to start with; ``None`` = not observed
    yet (the conservative default applies until the engine reports one).
    ``outside_bytes``: bytes the engine reserves outside the pool for per-sequence slots — the
    MTP hidden-state ("embedding") slots of AD-03, ``M × m`` with ``m`` from
    :func:`xllm_vmm.planner.sizing.mtp_embedding_bytes_per_seq` — taken off the live budget in
    every mode, after the quota, exactly as ``plan`` takes them off its budget
    (``B_s = B − M × m``), so the running pool and ``plan`` agree on the KV budget.
    """

    mode: BudgetMode = BudgetMode.ELASTIC
    max_memory_utilization: float = 0.8
    max_cache_size: int = 0
    reserve_bytes: int = 0
    execution_peak_bytes: int | None = None
    outside_bytes: int = 0

    def __post_init__(self) -> None:
        try:
            mode = BudgetMode(self.mode)
        except ValueError:
            raise BudgetConfigError(
                f"budget mode {self.mode!r} is not one of physical, fixed, elastic") from None
        object.__setattr__(self, "mode", mode)
        r = self.max_memory_utilization
        if mode is BudgetMode.ELASTIC:
            if not 0.0 <= r <= 1.0:
                raise BudgetConfigError(
                    f"max_memory_utilization={r} is outside [0, 1] (EL-04); in elastic mode it "
                    "has no effect, use max_cache_size for a byte quota")
        elif not 0.0 < r <= 1.0:
            raise BudgetConfigError(
                f"max_memory_utilization={r} is outside (0, 1] (EL-03); physical KV cache and "
                "fixed VMM size the pool by this ratio: set a value such as 0.8")
        if self.max_cache_size < 0:
            raise BudgetConfigError(
                f"max_cache_size={self.max_cache_size} is negative (EL-05); use 0 for no quota")
        if self.reserve_bytes < 0:
            raise BudgetConfigError(
                f"vmm_memory_reserve_bytes={self.reserve_bytes} is negative (EL-05); use 0")
        if self.outside_bytes < 0:
            raise BudgetConfigError(
                f"outside_bytes={self.outside_bytes} (slots reserved outside the pool) is "
                "negative; use 0")
        if self.execution_peak_bytes is not None and self.execution_peak_bytes < 0:
            raise BudgetConfigError(
                f"execution peak {self.execution_peak_bytes} bytes is negative")


class ExecutionPeak:
    """The execution memory peak the budget keeps free, in bytes.

    ``observe(n)`` records an observation; the peak is the largest one seen (a watermark: a
    peak only grows, because an execution shape seen once can come back). ``reset(n)``
    replaces it, for backends whose allocator statistics say memory was given back.
    Before any observation, :attr:`bytes` is ``default`` (conservative).
    """

    def __init__(self, default: int, initial: int | None = None) -> None:
        self.default = max(0, int(default))
        self._observed: int | None = None if initial is None else int(initial)

    @property
    def observed(self) -> bool:
        return self._observed is not None

    @property
    def bytes(self) -> int:
        return self.default if self._observed is None else self._observed

    def observe(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"execution peak observation must be >= 0 bytes, got {nbytes}")
        self._observed = nbytes if self._observed is None else max(self._observed, nbytes)

    def reset(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"execution peak must be >= 0 bytes, got {nbytes}")
        self._observed = nbytes


def budget_bytes(cfg: BudgetConfig, *, total: int, free: int, execution_peak: int,
                 held: int = 0) -> int:
    """The live budget in bytes, signed (negative: how far short): what the pool may take beyond
    the ``held`` bytes it holds already, with ``free`` bytes free on the device now (the pool's
    own pages are not free) out of ``total``. The one home of the formula: the pool and
    ``plan`` (:mod:`xllm_vmm.planner.sizing`) both call it.

    - physical, fixed: ``min(floor(r × total) − (total − free − held) − execution_peak, Q) −
      held − outside`` (the pool's whole capacity, less what it holds);
    - elastic: ``min(free − execution_peak − reserve, Q − held) − outside``;

    with ``Q = max_cache_size`` when positive (no cap otherwise) and ``outside`` the slots
    reserved outside the pool (:attr:`BudgetConfig.outside_bytes`)."""
    quota = cfg.max_cache_size if cfg.max_cache_size > 0 else None
    if cfg.mode is BudgetMode.ELASTIC:
        left = free - execution_peak - cfg.reserve_bytes
        return (left if quota is None else min(left, quota - held)) - cfg.outside_bytes
    cap = int(cfg.max_memory_utilization * total) - (total - free - held) - execution_peak
    if quota is not None:
        cap = min(cap, quota)
    return cap - held - cfg.outside_bytes


def static_capacity_bytes(cfg: BudgetConfig, free: int, total: int, execution_peak: int,
                          page: int) -> int:
    """Bytes a physical or fixed pool gets at start (see the module docstring), a multiple of
    ``page``; 0 when the ratio leaves nothing."""
    cap = budget_bytes(cfg, total=total, free=free, execution_peak=execution_peak)
    return max(0, cap // page * page)
