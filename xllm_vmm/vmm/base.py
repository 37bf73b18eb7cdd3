"""What the drivers share: handle creation all or nothing, and — for the ctypes drivers (ACL,
CUDA) — the driver-side :class:`~xllm_vmm.vmm.ledger.Ledger`, the batched map/unmap loops with
their rollback, the checked copies, host buffers and shutdown.

A :class:`LedgerDriver` subclass supplies only the device calls (``_dev_*``), the code its
device reports for misuse (``_invalid_code``) and ``_sync_framework`` (wait for work a framework
queued before pages are unmapped or copied raw). Every public method checks the ledger first,
under the driver's lock, so misuse is refused with the same typed errors on every device,
before the device is asked. Units: bytes; addresses are plain ints.
"""

from __future__ import annotations

import abc
import errno
from typing import Sequence

from xllm_vmm.vmm.driver import (CopyKind, MemInfo, Transfer, VmmError, VmmInvalidArgument,
                                  check_size)
from xllm_vmm.vmm.ledger import Codes, Ledger
from xllm_vmm.vmm.transfer import CopyWorker
from xllm_vmm.vmm.views import ViewRegistry


class DriverBase(abc.ABC):
    """Methods every driver implements the same way on top of its single-item calls."""

    @abc.abstractmethod
    def create_handle(self, size: int) -> int:
        ...

    @abc.abstractmethod
    def free_handle(self, handle: int) -> None:
        ...

    @abc.abstractmethod
    def copy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                   kind: CopyKind) -> None:
        ...

    @abc.abstractmethod
    def close(self) -> None:
        ...

    def create_handles(self, count: int, size: int) -> list[int]:
        """Creates ``count`` handles of ``size`` bytes, all or nothing: on failure (typically
        :class:`VmmOutOfMemory`) the handles this call created are freed before raising."""
        made: list[int] = []
        try:
            for _ in range(count):
                made.append(self.create_handle(size))
        except VmmError:
            for h in made:
                self.free_handle(h)
            raise
        return made

    def copy(self, dst: int, src: int, nbytes: int, kind: CopyKind) -> None:
        """Copies ``nbytes``; device-side ranges must be mapped (checked, else VmmNotMapped)."""
        self.copy_batch([dst], [src], [nbytes], kind)

    def _begin_close(self) -> bool:
        """The first steps of every ``close``: False when already closed; else waits for the
        copy thread and refuses while tensor views over the arena are alive."""
        if self._closed:
            return False
        self._worker.shutdown()
        self.views.check_close()
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LedgerDriver(DriverBase):
    """A ctypes driver whose misuse checks live in a :class:`Ledger`. Thread-safe: one
    re-entrant lock around check + device call + record; copies run outside it."""

    name = "ledger"
    _invalid_code = errno.EINVAL

    def _init_common(self, device_index: int, device_memory: int | None, granularity: int,
                     codes: Codes) -> None:
        """The state every ledger driver has; call once the device is open and ``_bind`` works."""
        self._granularity = granularity
        self._ledger = Ledger(granularity, codes, device_memory)
        self._host_buffers: set[int] = set()
        self._worker = CopyWorker(f"xllm-vmm-{self.name}{device_index}-copy", self._bind)
        self.views = ViewRegistry()
        self._closed = False

    # ---- device calls, supplied by the subclass ---------------------------------------------

    @abc.abstractmethod
    def _bind(self) -> None:
        """Makes this thread able to call the device (once per thread)."""
        ...

    @abc.abstractmethod
    def _sync_framework(self) -> None:
        """Waits for work a framework queued on the device (before unmaps and raw copies)."""
        ...

    @abc.abstractmethod
    def _dev_mem_info(self) -> tuple[int, int]:
        ...

    @abc.abstractmethod
    def _dev_reserve(self, size: int) -> int:
        ...

    @abc.abstractmethod
    def _dev_release(self, va: int, size: int) -> None:
        ...

    @abc.abstractmethod
    def _dev_create(self, size: int) -> int:
        ...

    @abc.abstractmethod
    def _dev_free(self, handle: int) -> None:
        ...

    @abc.abstractmethod
    def _dev_map(self, va: int, size: int, handle: int) -> None:
        ...

    @abc.abstractmethod
    def _dev_unmap(self, va: int, size: int) -> None:
        ...

    @abc.abstractmethod
    def _dev_copy(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                  kind: CopyKind) -> None:
        ...

    @abc.abstractmethod
    def _dev_synchronize(self) -> None:
        ...

    @abc.abstractmethod
    def _dev_alloc_host(self, size: int) -> int:
        ...

    @abc.abstractmethod
    def _dev_free_host(self, ptr: int) -> None:
        ...

    # ---- plumbing -----------------------------------------------------------------------------

    def _live(self) -> None:
        if self._closed:
            raise VmmInvalidArgument(f"{self.name} driver", errno.EBADF, "", "the driver is closed")

    def _misuse(self, op: str, detail: str) -> VmmInvalidArgument:
        return VmmInvalidArgument(op, self._invalid_code, "", detail)

    # ---- info ---------------------------------------------------------------------------------

    @property
    def granularity(self) -> int:
        """Physical page size in bytes, as the device reports it."""
        return self._granularity

    def mem_info(self) -> MemInfo:
        """The device's free and total memory, capped by ``device_memory`` when configured."""
        f, t = self._dev_mem_info()
        if self.device_memory is not None:
            t = min(t, self.device_memory)
            with self._lock:
                f = min(f, max(0, self.device_memory - self._ledger.committed))
        return MemInfo(free=f, total=t)

    # ---- virtual ranges -----------------------------------------------------------------------

    def reserve(self, size: int) -> int:
        self._live()
        with self._lock:
            self._ledger.check_reserve(size)
            va = self._dev_reserve(size)
            self._ledger.add_reservation(va, size)
            return va

    def release(self, va: int, size: int) -> None:
        self._live()
        with self._lock:
            self._ledger.check_release(va, size)
            self.views.check_release(va, size)
            self._dev_release(va, size)
            self._ledger.remove_reservation(va)

    # ---- handles ------------------------------------------------------------------------------

    def create_handle(self, size: int) -> int:
        self._live()
        with self._lock:
            self._ledger.check_create(size)
            h = self._dev_create(size)
            self._ledger.add_handle(h, size)
            return h

    def free_handle(self, handle: int) -> None:
        self._live()
        with self._lock:
            self._ledger.check_free(handle)
            self._dev_free(handle)
            self._ledger.remove_handle(handle)

    # ---- mappings -----------------------------------------------------------------------------

    def _map_one(self, va: int, handle: int) -> None:
        size = self._ledger.check_map(va, handle)
        self._dev_map(va, size, handle)
        self._ledger.add_mapping(va, handle, size)

    def _unmap_one(self, va: int) -> int:
        """Unmaps the mapping starting at ``va``; returns its handle."""
        handle, size = self._ledger.check_unmap(va)
        self._dev_unmap(va, size)
        self._ledger.remove_mapping(va)
        return handle

    def map(self, va: int, handle: int) -> None:
        self._live()
        with self._lock:
            self._map_one(va, handle)

    def unmap(self, va: int) -> None:
        self._live()
        self._sync_framework()
        with self._lock:
            self._unmap_one(va)

    def map_batch(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        """Maps every pair, all or nothing (what this call mapped is unmapped on failure)."""
        self._live()
        if len(vas) != len(handles):
            raise self._misuse("map_batch", f"{len(vas)} addresses but {len(handles)} handles")
        with self._lock:
            done: list[int] = []
            try:
                for va, h in zip(vas, handles):
                    self._map_one(va, h)
                    done.append(va)
            except VmmError:
                for va in reversed(done):
                    self._unmap_one(va)
                raise

    def unmap_batch(self, vas: Sequence[int]) -> None:
        """One device unmap per mapping, all or nothing (re-mapped on failure)."""
        self._live()
        self._sync_framework()
        with self._lock:
            done: list[tuple[int, int]] = []
            try:
                for va in vas:
                    done.append((va, self._unmap_one(va)))
            except VmmError:
                for va, handle in reversed(done):
                    self._map_one(va, handle)
                raise

    # ---- copies -------------------------------------------------------------------------------

    def copy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                   kind: CopyKind) -> None:
        """One device copy per block; every device-side range is checked before the first."""
        self._live()
        kind = CopyKind(kind)
        if not (len(dsts) == len(srcs) == len(sizes)):
            raise self._misuse("copy_batch", f"{len(dsts)} destinations, {len(srcs)} sources, "
                                             f"{len(sizes)} sizes")
        with self._lock:
            for d, s, n in zip(dsts, srcs, sizes):
                if kind in (CopyKind.H2D, CopyKind.D2D):
                    self._ledger.check_mapped("copy_batch", d, n, "destination")
                if kind in (CopyKind.D2H, CopyKind.D2D):
                    self._ledger.check_mapped("copy_batch", s, n, "source")
        self._sync_framework()
        self._dev_copy(dsts, srcs, sizes, kind)

    def copy_batch_async(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                         kind: CopyKind) -> Transfer:
        """:meth:`copy_batch` on the driver's copy thread; transfers run in order."""
        dsts, srcs, sizes = list(dsts), list(srcs), list(sizes)
        self._live()
        return self._worker.submit(lambda: self.copy_batch(dsts, srcs, sizes, kind))

    def synchronize(self) -> None:
        """Waits for every asynchronous transfer, then for the device."""
        self._worker.drain()
        self._dev_synchronize()

    # ---- host buffers -------------------------------------------------------------------------

    def alloc_host(self, size: int) -> int:
        """Page-locked host memory from the device runtime; its address."""
        self._live()
        check_size("alloc_host", size, code=self._invalid_code)
        p = self._dev_alloc_host(size)
        with self._lock:
            self._host_buffers.add(p)
        return p

    def free_host(self, ptr: int) -> None:
        with self._lock:
            if ptr not in self._host_buffers:
                raise self._misuse("free_host", f"{ptr:#x} is not a host buffer of this driver")
            self._host_buffers.discard(ptr)
        self._dev_free_host(ptr)

    # ---- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for transfers, then unmaps, frees and releases everything this driver made.
        Idempotent. Tensor views over the arena must be dropped first."""
        if not self._begin_close():
            return
        self._sync_framework()
        with self._lock:
            led = self._ledger
            for va in list(led.mappings):
                self._unmap_one(va)
            for h in list(led.handles):
                self.free_handle(h)
            for va, (size, _) in list(led.reservations.items()):
                self.release(va, size)
            for p in list(self._host_buffers):
                self.free_host(p)
            self._closed = True
