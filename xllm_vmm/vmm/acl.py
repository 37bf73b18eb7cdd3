"""The Ascend driver: the ACL runtime's VMM calls through ctypes on ``libascendcl.so``.

Library: the ``library`` argument, else ``$XLLM_VMM_ACL_LIBRARY``, else ``libascendcl.so`` (found
through ``LD_LIBRARY_PATH``, set by CANN's ``set_env.sh``). ``"emulation"`` selects the bundled
``libascendcl_emu.so`` (``native/acl_emu.c``), which implements the same ABI subset over host
memory with the real constraints, so this module runs the very same ctypes path on a laptop.

What the driver does as the reference (``device-vmm-apis.md``) prescribes: ``aclInit`` treats
``ACL_ERROR_REPEAT_INITIALIZE`` as success (torch_npu initialises first) and the driver never
calls ``aclFinalize``/``aclrtResetDevice``; every thread that calls ACL binds the device once
(``aclrtSetDevice``; ACL state is per thread); physical memory is ``ACL_HBM_MEM_HUGE`` (2 MiB
pages, granularity queried at run time) with the ACL struct layouts and enum values (which
differ from CUDA's); a handle is mapped whole (size = handle size, offset 0) and unmapped by its
start address, one ``aclrtUnmapMem`` per earlier map; torch_npu's queued work is synchronised
(``torch.npu.synchronize()``) before unmapping and before raw copies when torch_npu is loaded;
failures carry the ``aclError`` code and ``aclGetRecentErrMsg`` text. The reserve ``flags``
argument is 0 (as vllm-ascend and xllm pass; ``$XLLM_VMM_ACL_RESERVE_FLAGS=1`` for torch_npu's
choice). Copies use synchronous ``aclrtMemcpy`` per block. Untested on a real NPU.
"""

from __future__ import annotations

import ctypes as C
import os
import sys
import threading
from typing import Sequence

from xllm_vmm.vmm import native
from xllm_vmm.vmm.base import LedgerDriver
from xllm_vmm.vmm.driver import CopyKind, VmmError, VmmInvalidArgument, VmmOutOfMemory, VmmUnavailable
from xllm_vmm.vmm.ledger import Codes

ACL_SUCCESS = 0
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_HBM_MEM = 1
ACL_HBM_MEM_HUGE = 4
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_MEM_ALLOCATION_TYPE_PINNED = 0
ACL_MEM_HANDLE_TYPE_NONE = 0
ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
#: aclError codes that mean "out of memory"
OOM_CODES = frozenset({200000, 207001, 207018, 300000})

CODES = Codes(invalid=ACL_ERROR_RT_PARAM_INVALID, already_mapped=ACL_ERROR_RT_PARAM_INVALID,
              not_mapped=ACL_ERROR_RT_PARAM_INVALID, busy=ACL_ERROR_RT_PARAM_INVALID, oom=207001)


class aclrtMemLocation(C.Structure):
    _fields_ = [("id", C.c_uint32), ("type", C.c_int32)]


class aclrtPhysicalMemProp(C.Structure):
    _fields_ = [("handleType", C.c_int32), ("allocationType", C.c_int32), ("memAttr", C.c_int32),
                ("location", aclrtMemLocation), ("reserve", C.c_uint64)]


assert C.sizeof(aclrtMemLocation) == 8 and C.sizeof(aclrtPhysicalMemProp) == 32
assert aclrtPhysicalMemProp.location.offset == 12 and aclrtPhysicalMemProp.reserve.offset == 24

_P = C.POINTER
_PROTOTYPES: dict[str, tuple[list, object]] = {
    "aclInit": ([C.c_char_p], C.c_int),
    "aclrtSetDevice": ([C.c_int32], C.c_int),
    "aclrtGetDeviceCount": ([_P(C.c_uint32)], C.c_int),
    "aclrtGetMemInfo": ([C.c_int, _P(C.c_size_t), _P(C.c_size_t)], C.c_int),
    "aclrtMemGetAllocationGranularity": ([_P(aclrtPhysicalMemProp), C.c_int, _P(C.c_size_t)], C.c_int),
    "aclrtReserveMemAddress": ([_P(C.c_void_p), C.c_size_t, C.c_size_t, C.c_void_p, C.c_uint64], C.c_int),
    "aclrtReleaseMemAddress": ([C.c_void_p], C.c_int),
    "aclrtMallocPhysical": ([_P(C.c_void_p), C.c_size_t, _P(aclrtPhysicalMemProp), C.c_uint64], C.c_int),
    "aclrtFreePhysical": ([C.c_void_p], C.c_int),
    "aclrtMapMem": ([C.c_void_p, C.c_size_t, C.c_size_t, C.c_void_p, C.c_uint64], C.c_int),
    "aclrtUnmapMem": ([C.c_void_p], C.c_int),
    "aclrtMemcpy": ([C.c_void_p, C.c_size_t, C.c_void_p, C.c_size_t, C.c_int], C.c_int),
    "aclrtSynchronizeDevice": ([], C.c_int),
    "aclrtMallocHost": ([_P(C.c_void_p), C.c_size_t], C.c_int),
    "aclrtFreeHost": ([C.c_void_p], C.c_int),
    "aclGetRecentErrMsg": ([], C.c_char_p),
}

def resolve_library(library: str | None) -> str:
    """The ACL library path to load: argument, ``$XLLM_VMM_ACL_LIBRARY``, or libascendcl.so;
    ``"emulation"`` (or ``"emu"``) is the bundled emulation."""
    choice = library or os.environ.get("XLLM_VMM_ACL_LIBRARY") or "libascendcl.so"
    if choice in ("emulation", "emu"):
        return str(native.library_path(native.ACL_EMULATION_LIBRARY))
    return choice


def load_library(path: str) -> C.CDLL:
    """Loads an ACL library once per process and declares the prototypes."""
    return native.load_ctypes_library(
        path, _PROTOTYPES, op="load ACL runtime",
        unloadable="cannot load {path}: on an Ascend host source CANN's set_env.sh (it puts "
                   "libascendcl.so on LD_LIBRARY_PATH) or set XLLM_VMM_ACL_LIBRARY to its path; "
                   "without an NPU use --device cpu, or XLLM_VMM_ACL_LIBRARY=emulation for the "
                   "bundled ACL emulation",
        missing_symbol="{path} has no {name}: the VMM API needs CANN 8.0 or newer")


def _sync_framework() -> None:
    """Drains torch_npu's task queue, so raw ACL calls do not overtake queued kernels."""
    if "torch_npu" in sys.modules:
        import torch

        torch.npu.synchronize()


class AclDriver(LedgerDriver):
    """VMM on an Ascend NPU (or the ACL emulation). Thread-safe."""

    name = "acl"
    device_kind = "npu"
    _invalid_code = ACL_ERROR_RT_PARAM_INVALID

    def __init__(self, *, device_index: int = 0, device_memory: int | None = None,
                 library: str | None = None) -> None:
        self.library = resolve_library(library)
        self.emulated = os.path.basename(self.library) == native.ACL_EMULATION_LIBRARY
        self._acl = load_library(self.library)
        self.device_index = device_index
        self.device_memory = device_memory
        self._tls = threading.local()
        self._lock = threading.RLock()
        rc = self._acl.aclInit(None)
        if rc not in (ACL_SUCCESS, ACL_ERROR_REPEAT_INITIALIZE):
            self._raise("aclInit", rc)
        self._acl.aclGetRecentErrMsg()  # clear the repeat-initialisation message
        count = C.c_uint32()
        self._call("aclrtGetDeviceCount", self._acl.aclrtGetDeviceCount, C.byref(count))
        if not 0 <= device_index < count.value:
            raise VmmUnavailable("open acl driver", 0, "",
                                 f"device index {device_index} out of range: {count.value} NPU(s) visible")
        self._bind()
        self._prop = aclrtPhysicalMemProp(
            handleType=ACL_MEM_HANDLE_TYPE_NONE, allocationType=ACL_MEM_ALLOCATION_TYPE_PINNED,
            memAttr=ACL_HBM_MEM_HUGE,
            location=aclrtMemLocation(id=device_index, type=ACL_MEM_LOCATION_TYPE_DEVICE), reserve=0)
        gran = C.c_size_t()
        self._call("aclrtMemGetAllocationGranularity", self._acl.aclrtMemGetAllocationGranularity,
                   C.byref(self._prop), ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED, C.byref(gran))
        self._reserve_flags = int(os.environ.get("XLLM_VMM_ACL_RESERVE_FLAGS", "0"))
        self._init_common(device_index, device_memory, gran.value, CODES)

    # ---- plumbing -------------------------------------------------------------------------

    def _bind(self) -> None:
        """Binds this thread to the device (once per thread)."""
        if getattr(self._tls, "bound", False):
            return
        rc = self._acl.aclrtSetDevice(self.device_index)
        if rc != ACL_SUCCESS:
            self._raise("aclrtSetDevice", rc)
        self._tls.bound = True

    def _raise(self, op: str, rc: int, detail: str = "") -> None:
        msg = self._acl.aclGetRecentErrMsg()
        text = msg.decode(errors="replace") if msg else ""
        cls = VmmOutOfMemory if rc in OOM_CODES else (
            VmmInvalidArgument if rc in (100000, 107000, 107008, 107016, 107017, 200003) else VmmError)
        raise cls(op, rc, text, detail)

    def _call(self, op: str, fn, *args, detail: str = "") -> None:
        self._bind()
        rc = fn(*args)
        if rc != ACL_SUCCESS:
            self._raise(op, rc, detail)

    def _sync_framework(self) -> None:
        _sync_framework()

    # ---- device calls (the ledger has checked them) ---------------------------------------

    def _dev_mem_info(self) -> tuple[int, int]:
        """``aclrtGetMemInfo(ACL_HBM_MEM)``."""
        free, total = C.c_size_t(), C.c_size_t()
        self._call("aclrtGetMemInfo", self._acl.aclrtGetMemInfo, ACL_HBM_MEM, C.byref(free), C.byref(total))
        return free.value, total.value

    def _dev_reserve(self, size: int) -> int:
        va = C.c_void_p()
        self._call("aclrtReserveMemAddress", self._acl.aclrtReserveMemAddress, C.byref(va), size, 0,
                   None, self._reserve_flags, detail=f"size={size}")
        return va.value

    def _dev_release(self, va: int, size: int) -> None:
        self._call("aclrtReleaseMemAddress", self._acl.aclrtReleaseMemAddress, va, detail=f"va={va:#x}")

    def _dev_create(self, size: int) -> int:
        h = C.c_void_p()
        self._call("aclrtMallocPhysical", self._acl.aclrtMallocPhysical, C.byref(h), size,
                   C.byref(self._prop), 0, detail=f"size={size}")
        return h.value

    def _dev_free(self, handle: int) -> None:
        self._call("aclrtFreePhysical", self._acl.aclrtFreePhysical, handle, detail=f"handle={handle:#x}")

    def _dev_map(self, va: int, size: int, handle: int) -> None:
        self._call("aclrtMapMem", self._acl.aclrtMapMem, va, size, 0, handle, 0,
                   detail=f"va={va:#x} handle={handle:#x}")

    def _dev_unmap(self, va: int, size: int) -> None:
        self._call("aclrtUnmapMem", self._acl.aclrtUnmapMem, va, detail=f"va={va:#x}")

    def _dev_copy(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                  kind: CopyKind) -> None:
        """Synchronous ``aclrtMemcpy`` per block."""
        memcpy = self._acl.aclrtMemcpy
        self._bind()
        for d, s, n in zip(dsts, srcs, sizes):
            rc = memcpy(d, n, s, n, int(kind))
            if rc != ACL_SUCCESS:
                self._raise("aclrtMemcpy", rc, f"dst={d:#x} src={s:#x} n={n}")

    def _dev_synchronize(self) -> None:
        self._call("aclrtSynchronizeDevice", self._acl.aclrtSynchronizeDevice)

    def _dev_alloc_host(self, size: int) -> int:
        """Page-locked host memory from ``aclrtMallocHost``."""
        p = C.c_void_p()
        self._call("aclrtMallocHost", self._acl.aclrtMallocHost, C.byref(p), size, detail=f"size={size}")
        return p.value

    def _dev_free_host(self, ptr: int) -> None:
        self._call("aclrtFreeHost", self._acl.aclrtFreeHost, ptr)

    def __repr__(self) -> str:
        return f"AclDriver(device_index={self.device_index}, library={self.library!r})"
