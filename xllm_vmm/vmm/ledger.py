"""The driver-side record of reservations, handles and mappings for the ctypes drivers (ACL,
CUDA), so that misuse is refused with the same typed errors as the host driver's native table,
before the device is asked, whatever the device itself would do.

All sizes and addresses are bytes; ``page`` is the granularity. Not thread-safe by itself: the
drivers hold their own lock around check + device call + record.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from xllm_vmm.vmm.driver import VmmAlreadyMapped, VmmBusy, VmmError, VmmInvalidArgument
from xllm_vmm.vmm.driver import VmmNotMapped, VmmOutOfMemory


@dataclass(frozen=True)
class Codes:
    """The device's own error codes reported for refusals made by the ledger."""

    invalid: int
    already_mapped: int
    not_mapped: int
    busy: int
    oom: int


class Ledger:
    def __init__(self, page: int, codes: Codes, device_memory: int | None = None) -> None:
        self.page = page
        self.codes = codes
        self.device_memory = device_memory
        self._starts: list[int] = []  # sorted reservation starts
        self.reservations: dict[int, list[int]] = {}  # start -> [size, mapped pages]
        self.handles: dict[int, list[int]] = {}  # handle -> [size, live mappings]
        self.mappings: dict[int, tuple[int, int]] = {}  # start va -> (handle, size)
        self._pages: dict[int, int] = {}  # page va -> start va of its mapping
        self.committed = 0

    # ---- helpers --------------------------------------------------------------------------

    def _bad(self, op: str, what: str) -> VmmError:
        return VmmInvalidArgument(op, self.codes.invalid, "", what)

    def _aligned(self, op: str, name: str, value: int) -> None:
        if not isinstance(value, int) or value <= 0 or value % self.page:
            raise self._bad(op, f"{name} {value} is not a positive multiple of the granularity {self.page}")

    def reservation_of(self, va: int) -> int | None:
        i = bisect.bisect_right(self._starts, va) - 1
        if i >= 0:
            start = self._starts[i]
            if va < start + self.reservations[start][0]:
                return start
        return None

    # ---- reservations ---------------------------------------------------------------------

    def check_reserve(self, size: int) -> None:
        self._aligned("reserve", "reservation size", size)

    def add_reservation(self, va: int, size: int) -> None:
        bisect.insort(self._starts, va)
        self.reservations[va] = [size, 0]

    def check_release(self, va: int, size: int) -> None:
        r = self.reservations.get(va)
        if r is None:
            raise self._bad("release", f"{va:#x} is not the start of a reservation")
        if size != r[0]:
            raise self._bad("release", f"release size {size} differs from the reserved size {r[0]} at {va:#x}")
        if r[1]:
            raise VmmBusy("release", self.codes.busy, "",
                          f"reservation at {va:#x} still has {r[1]} mapped page(s); unmap them first")

    def remove_reservation(self, va: int) -> None:
        del self.reservations[va]
        self._starts.remove(va)

    # ---- handles --------------------------------------------------------------------------

    def check_create(self, size: int) -> None:
        self._aligned("create_handle", "handle size", size)
        if self.device_memory is not None and self.committed + size > self.device_memory:
            raise VmmOutOfMemory("create_handle", self.codes.oom, "",
                                 f"out of device memory: {self.committed} bytes in use of the configured "
                                 f"{self.device_memory}, {size} more requested")

    def add_handle(self, handle: int, size: int) -> None:
        self.handles[handle] = [size, 0]
        self.committed += size

    def check_free(self, handle: int) -> None:
        h = self.handles.get(handle)
        if h is None:
            raise self._bad("free_handle", f"unknown handle {handle:#x} (never created, or already freed)")
        if h[1]:
            raise VmmBusy("free_handle", self.codes.busy, "",
                          f"handle {handle:#x} is still mapped {h[1]} time(s); unmap it before freeing")

    def remove_handle(self, handle: int) -> None:
        size, _ = self.handles.pop(handle)
        self.committed -= size

    # ---- mappings -------------------------------------------------------------------------

    def check_map(self, va: int, handle: int) -> int:
        """Returns the handle's size when mapping it at ``va`` is allowed."""
        h = self.handles.get(handle)
        if h is None:
            raise self._bad("map", f"unknown handle {handle:#x} (never created, or already freed)")
        if va % self.page:
            raise self._bad("map", f"map address {va:#x} is not aligned to the granularity {self.page}")
        start = self.reservation_of(va)
        if start is None:
            raise self._bad("map", f"map address {va:#x} is not inside a reservation")
        size = h[0]
        if va + size > start + self.reservations[start][0]:
            raise self._bad("map", f"mapping {size} bytes at {va:#x} runs past the end of its reservation")
        for p in range(va, va + size, self.page):
            if p in self._pages:
                raise VmmAlreadyMapped("map", self.codes.already_mapped, "",
                                       f"address {p:#x} is already mapped; unmap it first")
        return size

    def add_mapping(self, va: int, handle: int, size: int) -> None:
        self.mappings[va] = (handle, size)
        for p in range(va, va + size, self.page):
            self._pages[p] = va
        self.handles[handle][1] += 1
        self.reservations[self.reservation_of(va)][1] += size // self.page

    def check_unmap(self, va: int) -> tuple[int, int]:
        m = self.mappings.get(va)
        if m is None:
            if self.reservation_of(va) is None:
                raise self._bad("unmap", f"unmap address {va:#x} is not inside a reservation")
            inside = va - va % self.page in self._pages
            raise VmmNotMapped("unmap", self.codes.not_mapped, "",
                               f"address {va:#x} is {'inside a mapping but not its start' if inside else 'not mapped'}")
        return m

    def remove_mapping(self, va: int) -> None:
        handle, size = self.mappings.pop(va)
        for p in range(va, va + size, self.page):
            del self._pages[p]
        self.handles[handle][1] -= 1
        self.reservations[self.reservation_of(va)][1] -= size // self.page

    def check_mapped(self, op: str, va: int, nbytes: int, side: str) -> None:
        """Every byte of ``[va, va+nbytes)`` must lie in mapped pages."""
        if nbytes <= 0:
            return
        p = va - va % self.page
        while p < va + nbytes:
            if p not in self._pages:
                raise VmmNotMapped(op, self.codes.not_mapped, "",
                                   f"{side} range of {nbytes} bytes at {va:#x}: address {max(p, va):#x} is not mapped")
            p += self.page
