"""The device driver protocol: the only way anything above this layer touches memory.

Units: every size and address is in bytes. Addresses are plain ``int`` virtual addresses.
A *handle* is an opaque ``int`` naming one physical allocation of ``size`` bytes (a multiple
of :attr:`Driver.granularity`). A *reservation* is a virtual range returned by
:meth:`Driver.reserve`; handles are mapped inside reservations, whole (offset 0, size equal to
the handle's size — the strictest of the real devices, ACL, sets the rule for every driver).

Misuse that real devices refuse is refused by every driver with :class:`VmmInvalidArgument`
(or a subclass): mapping over a mapped range, sizes or addresses not aligned to the
granularity, unmapping something that is not mapped, releasing a reservation that still has
mappings, freeing a handle that is still mapped. Running out of device memory raises
:class:`VmmOutOfMemory`. Both carry the device's own error code and message.
"""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable


class VmmError(RuntimeError):
    """A driver call failed. ``code`` is the device's own error code (errno for the host
    driver, ``aclError`` for ACL, ``CUresult`` for CUDA); ``device_message`` its own text."""

    def __init__(self, op: str, code: int, device_message: str = "", detail: str = "") -> None:
        self.op = op
        self.code = code
        self.device_message = device_message
        self.detail = detail
        msg = f"{op} failed with code {code}"
        if device_message:
            msg += f": {device_message}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class VmmOutOfMemory(VmmError):
    """The device (or the configured emulated device size) has no memory for the request.
    Callers above the driver treat this as "not now", never as a crash."""


class VmmInvalidArgument(VmmError):
    """Misuse: unaligned size/address, double map, unmap of an unmapped range, release of a
    range with live mappings, free of a mapped handle, unknown handle or address."""


def check_size(op: str, size: object, *, granularity: int | None = None,
               code: int = errno.EINVAL) -> None:
    """Raises :class:`VmmInvalidArgument` naming the ``size`` argument unless it is a positive
    int (and, with ``granularity``, a multiple of it): misuse, never "out of memory"."""
    ok = isinstance(size, int) and not isinstance(size, bool) and size > 0
    if ok and granularity is not None:
        ok = size % granularity == 0
    if not ok:
        want = (f"a positive multiple of the granularity ({granularity} bytes)"
                if granularity is not None else "a positive number of bytes")
        raise VmmInvalidArgument(op, code, "", f"size must be {want}, got {size!r}")


class VmmAlreadyMapped(VmmInvalidArgument):
    """Mapping onto a range that already has a mapping."""


class VmmNotMapped(VmmInvalidArgument):
    """Unmapping a range that has no mapping at that address."""


class VmmBusy(VmmInvalidArgument):
    """Releasing a reservation or freeing a handle that still has mappings."""


class VmmUnavailable(VmmError):
    """The driver cannot be used here (library missing, no device). The message says why and
    what to install or select instead."""


#: errno → exception class, for drivers whose codes are errno values (the host driver)
ERRNO_ERRORS: dict[int, type[VmmError]] = {
    errno.ENOMEM: VmmOutOfMemory,
    errno.ENOSPC: VmmOutOfMemory,
    errno.EEXIST: VmmAlreadyMapped,
    errno.ENOENT: VmmNotMapped,
    errno.EBUSY: VmmBusy,
    errno.EINVAL: VmmInvalidArgument,
    errno.EFAULT: VmmInvalidArgument,
    errno.EBADF: VmmInvalidArgument,
}


class CopyKind(enum.IntEnum):
    """Direction of a copy. Values follow ``aclrtMemcpyKind`` (H2H=0, H2D=1, D2H=2, D2D=3)."""

    H2H = 0
    H2D = 1
    D2H = 2
    D2D = 3


@dataclass(frozen=True)
class MemInfo:
    """Device memory as the driver sees it now, in bytes."""

    free: int
    total: int


@runtime_checkable
class Transfer(Protocol):
    """An asynchronous batched copy in flight. ``wait`` raises the copy's error, if any."""

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> None: ...


@runtime_checkable
class Driver(Protocol):
    """One device's VMM primitives. Implementations: ``host`` (memfd+mmap, native C),
    ``acl`` (libascendcl via ctypes, or its emulation), ``cuda`` (libcuda via ctypes)."""

    name: str  # "host", "acl", "cuda", ...
    device_kind: str  # "cpu", "npu", "cuda"
    device_index: int

    @property
    def granularity(self) -> int:
        """Physical page size in bytes (2 MiB on every supported device)."""
        ...

    def mem_info(self) -> MemInfo: ...

    # virtual ranges
    def reserve(self, size: int) -> int: ...

    def release(self, va: int, size: int) -> None: ...

    # physical handles
    def create_handle(self, size: int) -> int: ...

    def create_handles(self, count: int, size: int) -> list[int]:
        """``count`` handles of ``size`` bytes, all or nothing: on failure (typically
        :class:`VmmOutOfMemory`) the handles this call created are freed before raising."""
        ...

    def free_handle(self, handle: int) -> None: ...

    # mappings (a handle is always mapped whole, at offset 0)
    def map(self, va: int, handle: int) -> None: ...

    def unmap(self, va: int) -> None: ...

    def map_batch(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        """Map ``handles[i]`` at ``vas[i]`` for every i, all or nothing: on failure every
        mapping this call made is undone before the error is raised."""
        ...

    def unmap_batch(self, vas: Sequence[int]) -> None:
        """Unmap the mapping starting at each ``vas[i]``, all or nothing (what this call
        unmapped is mapped again before the error is raised)."""
        ...

    # copies (device addresses are mapped VAs; host addresses are ordinary host pointers)
    def copy(self, dst: int, src: int, nbytes: int, kind: CopyKind) -> None: ...

    def copy_batch(
        self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], kind: CopyKind
    ) -> None: ...

    def copy_batch_async(
        self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], kind: CopyKind
    ) -> Transfer: ...

    def synchronize(self) -> None: ...

    # host staging buffers (pinned where the device has such memory)
    def alloc_host(self, size: int) -> int:
        """A host buffer of ``size`` bytes for copies to and from the device; its address."""
        ...

    def free_host(self, ptr: int) -> None: ...

    def close(self) -> None:
        """Release everything the driver still holds (mappings, handles, reservations)."""
        ...
