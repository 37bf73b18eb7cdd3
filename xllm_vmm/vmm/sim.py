"""A pure-Python *simulated* VMM driver: bookkeeping only, no backing memory.

Addresses are integers in a fake address space (they are never dereferenced); handles are
integers. It keeps every misuse rule of :mod:`xllm_vmm.vmm.driver` (the strictest device, ACL,
sets them) and raises the same typed errors, so code above the driver can be tested fast and
the fragmentation benchmark can model a realistic 36-layer model without real memory.

Units: bytes. ``device_memory`` is the simulated device size: creating handles beyond it raises
:class:`~xllm_vmm.vmm.driver.VmmOutOfMemory`. :meth:`SimDriver.set_external_use` simulates
memory used outside the VMM pool (weights loaded elsewhere, execution buffers), so that
``mem_info().free`` moves like it does on a real device.

Fault injection: :meth:`SimDriver.fail_nth` makes the n-th next ``create`` or ``map`` call fail
(each element of a batch counts as one call); a failing ``map_batch`` undoes what it did first,
like a real driver.

Copies check that every device byte they touch is mapped (invariant 1, docs/architecture.md): a copy
that touches an unmapped page raises :class:`~xllm_vmm.vmm.driver.VmmNotMapped`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from xllm_vmm.vmm.driver import (
    CopyKind,
    MemInfo,
    VmmAlreadyMapped,
    VmmBusy,
    VmmError,
    VmmInvalidArgument,
    VmmNotMapped,
    VmmOutOfMemory,
)

__all__ = ["SimDriver", "SimCounters"]

_MiB = 1 << 20
_BASE_VA = 0x7F00_0000_0000  # start of the fake address space
_ENOMEM = 12
_EINVAL = 22
_EBUSY = 16


@dataclass
class SimCounters:
    """Calls made on the driver (a batch of n counts n in ``maps``/``unmaps`` and 1 in
    ``map_batches``/``unmap_batches``)."""

    creates: int = 0
    frees: int = 0
    maps: int = 0
    unmaps: int = 0
    map_batches: int = 0
    unmap_batches: int = 0
    reserves: int = 0
    releases: int = 0
    copies: int = 0


class _DoneTransfer:
    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None


@dataclass
class _Reservation:
    va: int
    size: int
    mapped: dict[int, int] = field(default_factory=dict)  # mapping start va -> handle
    covered: dict[int, int] = field(default_factory=dict)  # page va -> mapping start va


class SimDriver:
    """Simulated device with ``device_memory`` bytes and pages of ``granularity`` bytes."""

    name = "sim"

    def __init__(
        self,
        device_memory: int = 1 << 30,
        *,
        granularity: int = 2 * _MiB,
        device_kind: str = "cpu",
        device_index: int = 0,
    ) -> None:
        if granularity <= 0 or granularity & (granularity - 1):
            raise ValueError(f"granularity must be a positive power of two, got {granularity}")
        if device_memory < 0:
            raise ValueError(f"device_memory must be >= 0, got {device_memory}")
        self.device_kind = device_kind
        self.device_index = device_index
        self._gran = granularity
        self.device_memory = device_memory
        self._external = 0
        self._created = 0
        self._next_va = _BASE_VA
        self._next_handle = 1
        self._handles: dict[int, int] = {}  # handle -> size
        self._handle_maps: dict[int, int] = {}  # handle -> number of live mappings
        self._res: dict[int, _Reservation] = {}  # reservation va -> reservation
        self._res_starts: list[int] = []  # sorted reservation starts
        self._fail: dict[str, list[tuple[int, type[VmmError]]]] = {"create": [], "map": []}
        self._calls = {"create": 0, "map": 0}
        self.counters = SimCounters()
        self.closed = False

    # -- configuration -------------------------------------------------------------------
    @property
    def granularity(self) -> int:
        return self._gran

    def set_external_use(self, nbytes: int) -> None:
        """Bytes of device memory used outside this driver's handles (lowers ``free``)."""
        if nbytes < 0:
            raise ValueError(f"external use must be >= 0, got {nbytes}")
        self._external = nbytes

    def fail_nth(self, op: str, n: int = 1, error: type[VmmError] = VmmOutOfMemory) -> None:
        """Make the ``n``-th next call of ``op`` (``"create"`` or ``"map"``, 1-based, each
        element of a batch counting once) raise ``error``."""
        if op not in self._fail:
            raise ValueError(f"fail_nth: op must be 'create' or 'map', got {op!r}")
        if n < 1:
            raise ValueError(f"fail_nth: n must be >= 1, got {n}")
        self._fail[op].append((self._calls[op] + n, error))

    def _tick(self, op: str) -> None:
        self._calls[op] += 1
        now = self._calls[op]
        for i, (at, error) in enumerate(self._fail[op]):
            if at == now:
                del self._fail[op][i]
                code = _ENOMEM if issubclass(error, VmmOutOfMemory) else _EINVAL
                raise error(op, code, "injected failure", f"call {now}")

    # -- queries -------------------------------------------------------------------------
    def mem_info(self) -> MemInfo:
        used = self._created + self._external
        return MemInfo(free=max(0, self.device_memory - used), total=self.device_memory)

    @property
    def created_bytes(self) -> int:
        """Bytes of live physical handles."""
        return self._created

    @property
    def mapped_bytes(self) -> int:
        return sum(self._handles[h] for r in self._res.values() for h in r.mapped.values())

    def is_mapped(self, va: int, nbytes: int = 1) -> bool:
        """True when every byte of ``[va, va + nbytes)`` lies in a mapped handle."""
        end = va + nbytes
        while va < end:
            found = self._mapping_at(va)
            if found is None:
                return False
            start, size = found
            va = start + size
        return True

    def _reservation_of(self, va: int) -> _Reservation | None:
        i = bisect.bisect_right(self._res_starts, va) - 1
        if i < 0:
            return None
        r = self._res[self._res_starts[i]]
        return r if va < r.va + r.size else None

    def _mapping_at(self, va: int) -> tuple[int, int] | None:
        r = self._reservation_of(va)
        if r is None:
            return None
        start = r.covered.get(va - (va - r.va) % self._gran)
        if start is None:
            return None
        return start, self._handles[r.mapped[start]]

    # -- virtual ranges ------------------------------------------------------------------
    def _check_size(self, op: str, size: int) -> None:
        if size <= 0 or size % self._gran:
            raise VmmInvalidArgument(op, _EINVAL, "invalid size",
                                     f"{size} is not a positive multiple of {self._gran}")

    def reserve(self, size: int) -> int:
        self._check_size("reserve", size)
        va = self._next_va
        self._next_va += size + self._gran  # a guard page between reservations
        self._res[va] = _Reservation(va, size)
        bisect.insort(self._res_starts, va)
        self.counters.reserves += 1
        return va

    def release(self, va: int, size: int) -> None:
        r = self._res.get(va)
        if r is None or r.size != size:
            raise VmmInvalidArgument("release", _EINVAL, "unknown reservation",
                                     f"va={va:#x} size={size}")
        if r.mapped:
            raise VmmBusy("release", _EBUSY, "reservation has mappings",
                          f"{len(r.mapped)} mappings left")
        del self._res[va]
        self._res_starts.remove(va)
        self.counters.releases += 1

    # -- physical handles ----------------------------------------------------------------
    def create_handle(self, size: int) -> int:
        self._check_size("create_handle", size)
        self._tick("create")
        used = self._created + self._external
        if used + size > self.device_memory:
            raise VmmOutOfMemory("create_handle", _ENOMEM, "out of device memory",
                                 f"need {size} bytes, {max(0, self.device_memory - used)} free")
        h = self._next_handle
        self._next_handle += 1
        self._handles[h] = size
        self._handle_maps[h] = 0
        self._created += size
        self.counters.creates += 1
        return h

    def free_handle(self, handle: int) -> None:
        if handle not in self._handles:
            raise VmmInvalidArgument("free_handle", _EINVAL, "unknown handle", str(handle))
        if self._handle_maps[handle]:
            raise VmmBusy("free_handle", _EBUSY, "handle is mapped", str(handle))
        self._created -= self._handles.pop(handle)
        del self._handle_maps[handle]
        self.counters.frees += 1

    # -- mappings ------------------------------------------------------------------------
    def map(self, va: int, handle: int) -> None:
        size = self._handles.get(handle)
        if size is None:
            raise VmmInvalidArgument("map", _EINVAL, "unknown handle", str(handle))
        if va % self._gran:
            raise VmmInvalidArgument("map", _EINVAL, "unaligned address", f"va={va:#x}")
        r = self._reservation_of(va)
        if r is None or va + size > r.va + r.size:
            raise VmmInvalidArgument("map", _EINVAL, "range outside any reservation",
                                     f"va={va:#x} size={size}")
        for p in range(va, va + size, self._gran):
            if self._mapping_at(p) is not None:
                raise VmmAlreadyMapped("map", _EINVAL, "range already mapped", f"va={p:#x}")
        self._tick("map")
        r.mapped[va] = handle
        for p in range(va, va + size, self._gran):
            r.covered[p] = va
        self._handle_maps[handle] += 1
        self.counters.maps += 1

    def unmap(self, va: int) -> None:
        r = self._reservation_of(va)
        if r is None or va not in r.mapped:
            raise VmmNotMapped("unmap", _EINVAL, "no mapping starts here", f"va={va:#x}")
        h = r.mapped.pop(va)
        for p in range(va, va + self._handles[h], self._gran):
            del r.covered[p]
        self._handle_maps[h] -= 1
        self.counters.unmaps += 1

    def map_batch(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        if len(vas) != len(handles):
            raise VmmInvalidArgument("map_batch", _EINVAL, "length mismatch",
                                     f"{len(vas)} addresses, {len(handles)} handles")
        self.counters.map_batches += 1
        done: list[int] = []
        try:
            for va, h in zip(vas, handles):
                self.map(va, h)
                done.append(va)
        except BaseException:
            for va in reversed(done):
                self.unmap(va)
            raise

    def unmap_batch(self, vas: Sequence[int]) -> None:
        self.counters.unmap_batches += 1
        for va in vas:
            r = self._reservation_of(va)
            if r is None or va not in r.mapped:
                raise VmmNotMapped("unmap_batch", _EINVAL, "no mapping starts here",
                                   f"va={va:#x}")
        for va in vas:
            self.unmap(va)

    # -- copies (bookkeeping: check mappings, move nothing) ---------------------------------
    def _check_copy(self, dst: int, src: int, nbytes: int, kind: CopyKind) -> None:
        if nbytes < 0:
            raise VmmInvalidArgument("copy", _EINVAL, "negative size", str(nbytes))
        if kind in (CopyKind.H2D, CopyKind.D2D) and not self.is_mapped(dst, nbytes):
            raise VmmNotMapped("copy", _EINVAL, "destination not mapped", f"dst={dst:#x}")
        if kind in (CopyKind.D2H, CopyKind.D2D) and not self.is_mapped(src, nbytes):
            raise VmmNotMapped("copy", _EINVAL, "source not mapped", f"src={src:#x}")

    def copy(self, dst: int, src: int, nbytes: int, kind: CopyKind) -> None:
        self._check_copy(dst, src, nbytes, kind)
        self.counters.copies += 1

    def copy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                   kind: CopyKind) -> None:
        for d, s, n in zip(dsts, srcs, sizes, strict=True):
            self._check_copy(d, s, n, kind)
        self.counters.copies += len(sizes)

    def copy_batch_async(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                         kind: CopyKind) -> _DoneTransfer:
        self.copy_batch(dsts, srcs, sizes, kind)
        return _DoneTransfer()

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        for r in list(self._res.values()):
            for va in list(r.mapped):
                self.unmap(va)
            self.release(r.va, r.size)
        for h in list(self._handles):
            self.free_handle(h)
        self.closed = True
