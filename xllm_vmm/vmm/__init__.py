"""The device layer: VMM drivers (host memfd/mmap, Ascend ACL, CUDA) behind one protocol.

Open a driver with :func:`open_driver`; everything above this package speaks only the
:class:`~xllm_vmm.vmm.driver.Driver` protocol. Importing this package loads no native code and
no torch.
"""

from __future__ import annotations

import errno

from xllm_vmm.vmm.driver import (
    CopyKind,
    Driver,
    MemInfo,
    Transfer,
    VmmAlreadyMapped,
    VmmBusy,
    VmmError,
    VmmInvalidArgument,
    VmmNotMapped,
    VmmOutOfMemory,
    VmmUnavailable,
)

DRIVER_KINDS = {"host": "host", "cpu": "host", "acl": "acl", "npu": "acl", "cuda": "cuda"}


def open_driver(kind: str = "host", *, device_index: int = 0, device_memory: int | None = None,
                library: str | None = None, populate: bool = False,
                hugepages: str | None = None) -> Driver:
    """Opens the VMM driver for a device kind.

    ``kind``: ``"host"``/``"cpu"`` (memfd + mmap), ``"acl"``/``"npu"`` (libascendcl through
    ctypes; ``library`` or ``$XLLM_VMM_ACL_LIBRARY`` selects the library, ``"emulation"`` the
    bundled ACL emulation), ``"cuda"`` (libcuda.so.1). ``device_memory`` (bytes) emulates a
    device of that size: ``mem_info().total`` reports it and creating handles beyond it raises
    :class:`VmmOutOfMemory` (host driver; for ACL it caps what the driver will allocate).
    ``populate`` (host driver) fills the page tables of each new mapping at map time, so the
    first writes into freshly mapped pages (KV slots) take no page faults; device memory has no
    such faults and the ACL and CUDA drivers ignore it. ``hugepages`` (host driver): what backs
    its handles — ``"auto"``, ``"hugetlb"``, ``"thp"`` or ``"off"`` (None: ``$XLLM_VMM_HOST_HUGEPAGES``,
    else auto; see :mod:`xllm_vmm.vmm.hugepages`); device memory needs no such choice.
    Raises :class:`VmmUnavailable` when the device or its library is missing.
    """
    resolved = DRIVER_KINDS.get(str(kind).lower())
    if resolved is None:
        raise VmmInvalidArgument("open_driver", errno.EINVAL, "",
                                 f"unknown driver kind {kind!r}; choose one of "
                                 f"{', '.join(sorted(DRIVER_KINDS))}")
    if resolved == "host":
        from xllm_vmm.vmm.host import HostDriver

        return HostDriver(device_index=device_index, device_memory=device_memory, populate=populate,
                          hugepages=hugepages)
    if resolved == "acl":
        from xllm_vmm.vmm.acl import AclDriver

        return AclDriver(device_index=device_index, device_memory=device_memory, library=library)
    from xllm_vmm.vmm.cuda import CudaDriver

    return CudaDriver(device_index=device_index, device_memory=device_memory, library=library)


__all__ = [
    "CopyKind", "Driver", "MemInfo", "Transfer", "VmmAlreadyMapped", "VmmBusy", "VmmError",
    "VmmInvalidArgument", "VmmNotMapped", "VmmOutOfMemory", "VmmUnavailable", "open_driver",
    "DRIVER_KINDS",
]
