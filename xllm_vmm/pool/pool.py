"""``VmmPool``: one per worker. A stable virtual arena, tenants, the live budget, map/unmap.

Memory model (units: bytes; a *page* is ``driver.granularity`` bytes, 2 MiB on devices)::

    arena (reserved once at start, never moves)
    page 0                                                          page N-1
    |  KV tenant (from the low end) -->   ...free...   <-- weights tenant (from the high end) |

- :meth:`VmmPool.add_tenant` carves a :class:`Region` of whole pages for a tenant, KV from the
  low end and weights from the high end (VMM-02: both share one budget).
- Elastic mode: a page is backed only while mapped. :meth:`map_pages` creates handles (or takes
  them from a ready set of at most ``ready_pages`` created-but-unmapped handles, counted in the
  budget) and maps them in one batched driver call; :meth:`unmap_pages` unmaps in one batched
  call and frees the handles at once (EL-01) beyond the ready set. :meth:`fill_ready` creates
  ready handles ahead of demand (the KV cache manager, between engine steps, a few at a
  time) and :meth:`drain_ready` frees them (idle, sleep).
- Fixed mode: a tenant's region is created and mapped whole when it is added and never
  returned; ``map_pages``/``unmap_pages`` only mark pages in use.
- Physical mode: a tenant's region is one plain resident allocation (one handle, one map).
  A tenant added with ``paged=True`` (the weights with weight-only VMM: VMM-03 keeps the KV
  cache physical, W-03 makes the weights elastic) is elastic inside the physical pool: its
  pages are backed only while mapped, and its growth is bounded by free − execution peak −
  reserve (``max_cache_size`` caps the physical KV cache, not it).

Invariant 3 (docs/architecture.md): the pool never holds more than the budget allows (elastic: free −
execution peak − reserve ≥ 0 after growth, and total ≤ ``max_cache_size`` when set). A
failing create or map undoes everything that call did and :meth:`map_pages` returns ``False``
("not now"); only misuse (:class:`~xllm_vmm.vmm.driver.VmmInvalidArgument`, which is a bug
above the driver) raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from xllm_vmm.pool.budget import (
    DEFAULT_EXECUTION_HEADROOM_FRACTION,
    BudgetConfig,
    BudgetMode,
    ExecutionPeak,
    budget_bytes,
    static_capacity_bytes,
)
from xllm_vmm.vmm.driver import Driver, VmmError, VmmInvalidArgument

__all__ = ["VmmPool", "Region", "PoolStats", "PoolCapacityError"]


class PoolCapacityError(RuntimeError):
    """The pool cannot be set up as asked (start-up only; never raised on the serving path).
    The message carries the numbers and what to change."""


@dataclass(frozen=True)
class Region:
    """A tenant's contiguous part of the arena: pages ``[first_page, first_page + pages)``."""

    tenant: str
    first_page: int
    pages: int
    base_va: int
    page_bytes: int

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes

    def page_va(self, page: int) -> int:
        """Virtual address of the region's ``page``-th page (0-based inside the region)."""
        return self.base_va + page * self.page_bytes


@dataclass
class PoolStats:
    """A snapshot of the pool. Bytes unless named otherwise; ``*_seconds`` is time spent in the
    driver's map/unmap calls."""

    mode: str
    page_bytes: int
    reserved_bytes: int
    mapped_bytes: int
    held_bytes: int  # physical memory the pool holds: mapped + ready handles
    ready_bytes: int
    pages_in_use: int
    budget_left_bytes: int
    execution_peak_bytes: int
    map_calls: int
    unmap_calls: int
    pages_mapped_total: int
    pages_unmapped_total: int
    failed_maps: int
    map_seconds: float
    unmap_seconds: float
    per_tenant_mapped_bytes: dict[str, int] = field(default_factory=dict)
    per_tag_mapped_bytes: dict[str, int] = field(default_factory=dict)


class VmmPool:
    """The VMM pool of one worker (see the module docstring for the memory model).

    ``arena_bytes`` is rounded up to whole pages and reserved at once. ``ready_pages`` (elastic
    only, default 0) keeps up to that many created, unmapped handles for reuse; they count as
    held memory in the budget and in :class:`PoolStats`.
    """

    def __init__(self, driver: Driver, budget: BudgetConfig, arena_bytes: int, *,
                 ready_pages: int = 0) -> None:
        if arena_bytes <= 0:
            raise PoolCapacityError(f"arena size must be positive, got {arena_bytes} bytes")
        if ready_pages < 0:
            raise PoolCapacityError(f"ready_pages must be >= 0, got {ready_pages}")
        self.driver = driver
        self.budget = budget
        self.page_bytes = driver.granularity
        self.arena_pages = -(-arena_bytes // self.page_bytes)
        self.ready_pages = ready_pages if budget.mode is BudgetMode.ELASTIC else 0
        total = driver.mem_info().total
        self.execution_peak = ExecutionPeak(
            default=int(total * DEFAULT_EXECUTION_HEADROOM_FRACTION),
            initial=budget.execution_peak_bytes)
        self.arena_va = driver.reserve(self.arena_pages * self.page_bytes)
        self._regions: dict[str, Region] = {}
        self._low = 0  # next free page from the low end
        self._high = self.arena_pages  # one past the last free page from the high end
        self._mapped: dict[int, int] = {}  # arena page -> handle (elastic, fixed)
        self._resident: dict[str, int] = {}  # tenant -> handle of its one allocation (physical)
        self._in_use: dict[str, set[int]] = {}  # tenant -> region pages marked in use
        self._paged: set[str] = set()  # elastic tenants of a physical pool (add_tenant paged)
        self._tag_pages: dict[str, int] = {}
        self._ready: list[int] = []
        self._held = 0
        self.map_calls = 0
        self.unmap_calls = 0
        self.pages_mapped_total = 0
        self.pages_unmapped_total = 0
        self.failed_maps = 0
        self.map_seconds = 0.0
        self.unmap_seconds = 0.0
        self._closed = False
        self.peer_budget_left_bytes: int | None = None
        """The least budget left (bytes) among the other workers of a tensor-parallel worker
        set, refreshed by ``xllm_vmm.engine.distributed`` after every step (AD-02):
        :meth:`mappable_pages` (what admission counts on) never exceeds it. None: one worker."""

    # -- tenants -------------------------------------------------------------------------
    @property
    def mode(self) -> BudgetMode:
        return self.budget.mode

    def static_capacity_bytes(self) -> int:
        """Bytes a physical or fixed pool may hold in total (module docstring of
        :mod:`xllm_vmm.pool.budget`), minus what is already held."""
        info = self.driver.mem_info()
        cap = static_capacity_bytes(self.budget, info.free + self._held, info.total,
                                    self.execution_peak.bytes, self.page_bytes)
        return max(0, cap - self._held)

    def add_tenant(self, name: str, nbytes: int, *, end: str = "low",
                   paged: bool = False) -> Region:
        """Carve ``nbytes`` (rounded up to pages) for tenant ``name`` from the ``"low"`` or
        ``"high"`` end of the arena. Fixed and physical pools back the region at once and raise
        :class:`PoolCapacityError` when the budget does not allow it. ``paged=True`` makes the
        tenant elastic in a physical pool (module docstring); elastic pools page every tenant
        and fixed pools none, so there it changes nothing."""
        if name in self._regions:
            raise PoolCapacityError(f"tenant {name!r} already has a region")
        if end not in ("low", "high"):
            raise PoolCapacityError(f"tenant end must be 'low' or 'high', got {end!r}")
        pages = -(-nbytes // self.page_bytes)
        if pages <= 0:
            raise PoolCapacityError(f"tenant {name!r}: size must be positive, got {nbytes}")
        if pages > self._high - self._low:
            raise PoolCapacityError(
                f"tenant {name!r} needs {pages} pages but the arena has "
                f"{self._high - self._low} of {self.arena_pages} pages left; size the arena for "
                "every tenant")
        paged_here = paged and self.mode is BudgetMode.PHYSICAL
        if self.mode is not BudgetMode.ELASTIC and not paged_here:
            cap = self.static_capacity_bytes()
            if pages * self.page_bytes > cap:
                raise PoolCapacityError(
                    f"tenant {name!r} needs {pages * self.page_bytes} bytes but the "
                    f"{self.mode.value} budget allows {cap} bytes (max_memory_utilization="
                    f"{self.budget.max_memory_utilization}, max_cache_size="
                    f"{self.budget.max_cache_size}); raise the ratio or size the cache smaller")
        if end == "low":
            first = self._low
            self._low += pages
        else:
            self._high -= pages
            first = self._high
        region = Region(name, first, pages, self.arena_va + first * self.page_bytes,
                        self.page_bytes)
        self._regions[name] = region
        self._in_use[name] = set()
        if paged_here:
            self._paged.add(name)
        elif self.mode is not BudgetMode.ELASTIC:
            try:
                self._back_whole(region)
            except BaseException:  # a failed backing carves nothing: the arena space returns
                self._regions.pop(name, None)
                del self._in_use[name]
                if end == "low":
                    self._low -= pages
                else:
                    self._high += pages
                raise
        return region

    def _is_paged(self, region: Region) -> bool:
        """True when ``region``'s pages are backed only while mapped (elastic behaviour)."""
        return self.mode is BudgetMode.ELASTIC or region.tenant in self._paged

    def _back_whole(self, region: Region) -> None:
        d = self.driver
        try:
            if self.mode is BudgetMode.PHYSICAL:
                h = d.create_handle(region.nbytes)
                try:
                    d.map(region.base_va, h)
                except BaseException:
                    d.free_handle(h)
                    raise
                self._resident[region.tenant] = h
            else:
                handles: list[int] = []
                try:
                    for _ in range(region.pages):
                        handles.append(d.create_handle(self.page_bytes))
                    vas = [region.page_va(p) for p in range(region.pages)]
                    d.map_batch(vas, handles)
                except BaseException:
                    for h in handles:
                        d.free_handle(h)
                    raise
                for p, h in enumerate(handles):
                    self._mapped[region.first_page + p] = h
                self.map_calls += 1
                self.pages_mapped_total += region.pages
        except VmmInvalidArgument:
            raise
        except VmmError as e:
            del self._regions[region.tenant]
            raise PoolCapacityError(
                f"tenant {region.tenant!r}: backing {region.nbytes} bytes at start failed: {e}; "
                "lower max_memory_utilization or max_cache_size") from e
        self._held += region.nbytes

    def region(self, name: str) -> Region:
        return self._regions[name]

    def has_tenant(self, name: str) -> bool:
        return name in self._regions

    def remove_tenant(self, name: str) -> None:
        """Give tenant ``name``'s region back: its pages in use are unmapped and their memory
        freed (fixed and physical pools too), and the name may be used again. Per-tag counts
        are not adjusted for pages still in use: take tagged pages out of use first. The arena space
        returns to the free middle when the region is the innermost one of its end (the last
        carved there); otherwise it stays carved but unbacked (the arena is a bump allocator
        from both ends)."""
        region = self._regions[name]
        d = self.driver
        if self.mode is BudgetMode.PHYSICAL and name not in self._paged:
            h = self._resident.pop(name, None)
            if h is not None:
                d.unmap(region.base_va)
                d.free_handle(h)
                self._held -= region.nbytes
        else:
            in_use = sorted(self._in_use[name])
            if in_use:  # elastic: unmapped and freed here; fixed: only marked
                self.unmap_pages(region, in_use, release=True)
            backed = [p for p in range(region.pages) if (region.first_page + p) in self._mapped]
            if backed:  # fixed: the region was backed whole when it was added
                d.unmap_batch([region.page_va(p) for p in backed])
                for p in backed:
                    d.free_handle(self._mapped.pop(region.first_page + p))
                self._held -= len(backed) * self.page_bytes
                self.unmap_calls += 1
                self.pages_unmapped_total += len(backed)
        del self._regions[name]
        del self._in_use[name]
        self._paged.discard(name)
        if region.first_page == self._high:
            self._high += region.pages
        elif region.first_page + region.pages == self._low:
            self._low -= region.pages

    def arena_bytes_left(self) -> int:
        """Bytes of arena not yet carved into a tenant region (between the two ends)."""
        return (self._high - self._low) * self.page_bytes

    # -- budget --------------------------------------------------------------------------
    def observe_execution_peak(self, nbytes: int) -> None:
        """The engine reports an observed execution memory peak (bytes); the budget keeps the
        largest one seen free."""
        self.execution_peak.observe(nbytes)

    def reset_execution_peak(self, nbytes: int) -> None:
        """Replace the execution watermark (backends with reliable allocator statistics)."""
        self.execution_peak.reset(nbytes)

    def growth_left_bytes(self) -> int:
        """Bytes of new physical memory the pool may take now (elastic; 0 otherwise)."""
        if self.mode is not BudgetMode.ELASTIC:
            return 0
        info = self.driver.mem_info()  # the elastic budget's one formula: budget.budget_bytes
        return max(0, budget_bytes(self.budget, total=info.total, free=info.free,
                                   execution_peak=self.execution_peak.bytes, held=self._held))

    def _paged_growth_left_bytes(self) -> int:
        """Growth of a paged tenant of a physical pool: free − execution peak − reserve − the
        slots reserved outside the pool (``BudgetConfig.outside_bytes``)."""
        free = self.driver.mem_info().free
        return max(0, free - self.execution_peak.bytes - self.budget.reserve_bytes
                   - self.budget.outside_bytes)

    def budget_left_bytes(self) -> int:
        """Bytes of pages the pool could map now: ready handles plus allowed growth."""
        return len(self._ready) * self.page_bytes + self.growth_left_bytes()

    def mappable_pages(self, region: Region) -> int:
        """Pages of ``region`` that :meth:`map_pages` could bring into use now."""
        unused = region.pages - len(self._in_use[region.tenant])
        if region.tenant in self._paged:
            return min(unused, self._paged_growth_left_bytes() // self.page_bytes)
        if self.mode is not BudgetMode.ELASTIC:
            return unused
        left = self.budget_left_bytes()
        if self.peer_budget_left_bytes is not None:  # a worker set: the smallest (AD-02)
            left = min(left, self.peer_budget_left_bytes)
        return min(unused, left // self.page_bytes)

    # -- map / unmap ---------------------------------------------------------------------
    def map_pages(self, region: Region, pages: Sequence[int], tag: str = "") -> bool:
        """Bring ``pages`` (indices inside ``region``) into use, all or nothing.

        Elastic: back and map them in one batched driver call. Returns ``False`` ("not now")
        when the budget refuses or the driver runs out of memory or fails; everything this
        call did is undone then. Mapping a page that is already in use is a bug and raises
        ``ValueError``.
        """
        in_use = self._in_use[region.tenant]
        n = len(pages)
        if n == 0:
            return True
        if min(pages) < 0 or max(pages) >= region.pages or not in_use.isdisjoint(pages):
            for p in pages:  # the slow path only names the offending page
                if not 0 <= p < region.pages:
                    raise ValueError(f"page {p} outside tenant {region.tenant!r} "
                                     f"({region.pages} pages)")
                if p in in_use:
                    raise ValueError(f"page {p} of tenant {region.tenant!r} is already in use")
        if n > 1 and len(set(pages)) != n:
            raise ValueError(f"map_pages: duplicate pages in {list(pages)}")
        if self._is_paged(region):
            if not self._map_elastic(region, pages):
                self.failed_maps += 1
                return False
        in_use.update(pages)
        if tag:
            self._tag_pages[tag] = self._tag_pages.get(tag, 0) + n
        return True

    def _map_elastic(self, region: Region, pages: Sequence[int]) -> bool:
        n = len(pages)
        from_ready = min(n, len(self._ready))
        new = n - from_ready
        left = self.growth_left_bytes() if self.mode is BudgetMode.ELASTIC \
            else self._paged_growth_left_bytes()
        if new * self.page_bytes > left:
            return False
        d = self.driver
        handles = self._ready[len(self._ready) - from_ready:]
        del self._ready[len(self._ready) - from_ready:]
        created: list[int] = []
        try:
            for _ in range(new):
                created.append(d.create_handle(self.page_bytes))
            vas = [region.page_va(p) for p in pages]
            t0 = time.perf_counter()
            try:
                d.map_batch(vas, handles + created)
            finally:
                self.map_seconds += time.perf_counter() - t0
        except VmmInvalidArgument:
            self._undo_handles(handles, created)
            raise
        except VmmError:
            self._undo_handles(handles, created)
            return False
        self.map_calls += 1
        self.pages_mapped_total += n
        self._held += new * self.page_bytes
        for p, h in zip(pages, handles + created):
            self._mapped[region.first_page + p] = h
        return True

    def fill_ready(self, max_new: int) -> int:
        """Create up to ``max_new`` handles ahead of demand into the ready set (elastic pools),
        up to ``ready_pages`` ready in all and within the growth budget (invariant 3: ready
        handles are held memory, counted in the budget). :meth:`map_pages` takes ready
        handles before it creates any, so a step that needs new pages maps them without
        waiting for their creation (a handle's creation commits and zeroes its page: ~1 ms
        on the host driver, the costly part of growth). A create that fails stops the fill
        quietly (the next :meth:`map_pages` creates on demand and reports "not now" itself).
        Returns the handles created."""
        want = min(max_new, self.ready_pages - len(self._ready))
        if want <= 0 or self._closed or self.mode is not BudgetMode.ELASTIC:
            return 0
        want = min(want, self.growth_left_bytes() // self.page_bytes)
        made = 0
        d = self.driver
        for _ in range(want):
            try:
                h = d.create_handle(self.page_bytes)
            except VmmInvalidArgument:
                raise
            except VmmError:
                break
            self._ready.append(h)
            self._held += self.page_bytes
            made += 1
        return made

    def drain_ready(self) -> int:
        """Free every ready handle now (idle, sleep: the held memory comes back down to what
        is mapped). ``ready_pages`` is unchanged. Returns the handles freed."""
        n = len(self._ready)
        for h in self._ready:
            self.driver.free_handle(h)
        self._ready.clear()
        self._held -= n * self.page_bytes
        return n

    def _undo_handles(self, ready: list[int], created: list[int]) -> None:
        self._ready.extend(ready)
        for h in created:
            self.driver.free_handle(h)

    def unmap_pages(self, region: Region, pages: Sequence[int], tag: str = "", *,
                    release: bool = False) -> None:
        """Take ``pages`` out of use. Elastic: unmap them in one batched call and free their
        handles at once (beyond the ready set; with ``release=True`` none is kept ready: the
        weights going to sleep give their memory back whole). Unmapping a page not in use
        raises ``ValueError``."""
        in_use = self._in_use[region.tenant]
        if not in_use.issuperset(pages):
            p = next(p for p in pages if p not in in_use)
            raise ValueError(f"page {p} of tenant {region.tenant!r} is not in use")
        if not pages:
            return
        if self._is_paged(region):
            vas = [region.page_va(p) for p in pages]
            t0 = time.perf_counter()
            try:
                self.driver.unmap_batch(vas)
            finally:
                self.unmap_seconds += time.perf_counter() - t0
            self.unmap_calls += 1
            self.pages_unmapped_total += len(pages)
            for p in pages:
                h = self._mapped.pop(region.first_page + p)
                if not release and len(self._ready) < self.ready_pages:
                    self._ready.append(h)
                else:
                    self.driver.free_handle(h)
                    self._held -= self.page_bytes
        in_use.difference_update(pages)
        if tag:
            self._tag_pages[tag] -= len(pages)

    def is_mapped(self, region: Region, page: int) -> bool:
        """True when ``page`` of ``region`` has physical memory under it now."""
        if self.mode is BudgetMode.PHYSICAL and region.tenant not in self._paged:
            return region.tenant in self._resident and 0 <= page < region.pages
        return (region.first_page + page) in self._mapped

    def pages_in_use(self, region: Region) -> frozenset[int]:
        return frozenset(self._in_use[region.tenant])

    # -- statistics / shutdown -----------------------------------------------------------
    @property
    def mapped_bytes(self) -> int:
        resident = sum(self._regions[t].nbytes for t in self._resident)
        return resident + len(self._mapped) * self.page_bytes

    @property
    def held_bytes(self) -> int:
        return self._held

    def stats(self) -> PoolStats:
        per_tenant = {}
        for name, r in self._regions.items():
            if self.mode is BudgetMode.PHYSICAL and name not in self._paged:
                per_tenant[name] = r.nbytes if name in self._resident else 0
            else:
                lo, hi = r.first_page, r.first_page + r.pages
                per_tenant[name] = sum(1 for p in self._mapped if lo <= p < hi) * self.page_bytes
        return PoolStats(
            mode=self.mode.value,
            page_bytes=self.page_bytes,
            reserved_bytes=self.arena_pages * self.page_bytes,
            mapped_bytes=self.mapped_bytes,
            held_bytes=self._held,
            ready_bytes=len(self._ready) * self.page_bytes,
            pages_in_use=sum(len(s) for s in self._in_use.values()),
            budget_left_bytes=self.budget_left_bytes(),
            execution_peak_bytes=self.execution_peak.bytes,
            map_calls=self.map_calls,
            unmap_calls=self.unmap_calls,
            pages_mapped_total=self.pages_mapped_total,
            pages_unmapped_total=self.pages_unmapped_total,
            failed_maps=self.failed_maps,
            map_seconds=self.map_seconds,
            unmap_seconds=self.unmap_seconds,
            per_tenant_mapped_bytes=per_tenant,
            per_tag_mapped_bytes={k: v * self.page_bytes for k, v in self._tag_pages.items()},
        )

    def close(self) -> None:
        """Unmap and free everything and release the arena. Idempotent."""
        if self._closed:
            return
        d = self.driver
        if self._mapped:
            d.unmap_batch([self.arena_va + p * self.page_bytes for p in self._mapped])
            for h in self._mapped.values():
                d.free_handle(h)
            self._mapped.clear()
        for tenant, h in self._resident.items():
            d.unmap(self._regions[tenant].base_va)
            d.free_handle(h)
        self._resident.clear()
        for h in self._ready:
            d.free_handle(h)
        self._ready.clear()
        self._held = 0
        d.release(self.arena_va, self.arena_pages * self.page_bytes)
        self._closed = True

    def __enter__(self) -> "VmmPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
