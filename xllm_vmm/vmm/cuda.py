"""The NVIDIA driver: CUDA driver-API VMM through ctypes on ``libcuda.so.1``.

As the reference prescribes: the library is ``libcuda.so.1`` (``library`` argument or
``$XLLM_VMM_CUDA_LIBRARY`` to override), never cudart; the ``_v2`` symbols where ``cuda.h``
renames them (``cuMemGetInfo_v2``, ``cuMemcpy*_v2``); the device's *primary* context, shared with
PyTorch (``cuDevicePrimaryCtxRetain`` + ``cuCtxSetCurrent`` in every thread that calls CUDA,
never ``cuCtxCreate``); the granularity queried at run time (MINIMUM); ``cuMemSetAccess`` (read
and write for this device) after every ``cuMemMap``; CUDA's struct layouts and enum values
(``CU_MEM_ALLOCATION_TYPE_PINNED`` = 1, location ``(type, id)``); a handle mapped whole and
unmapped one mapping at a time. Failures carry the ``CUresult`` and ``cuGetErrorString`` text.
Copies are ``cuMemcpy`` (unified addressing, any direction) per block. Its tests skip without a
GPU; ``tests/device/run_gpu_checks.sh`` runs them on one.
"""

from __future__ import annotations

import ctypes as C
import os
import threading
from typing import Sequence

from xllm_vmm.vmm import native
from xllm_vmm.vmm.base import LedgerDriver
from xllm_vmm.vmm.driver import CopyKind, VmmError, VmmInvalidArgument, VmmOutOfMemory, VmmUnavailable
from xllm_vmm.vmm.ledger import Codes

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_ALREADY_MAPPED = 208
CUDA_ERROR_NOT_MAPPED = 211
CUDA_ERROR_ILLEGAL_STATE = 401
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102

CODES = Codes(invalid=CUDA_ERROR_INVALID_VALUE, already_mapped=CUDA_ERROR_ALREADY_MAPPED,
              not_mapped=CUDA_ERROR_NOT_MAPPED, busy=CUDA_ERROR_ILLEGAL_STATE,
              oom=CUDA_ERROR_OUT_OF_MEMORY)


class CUmemLocation(C.Structure):
    _fields_ = [("type", C.c_int32), ("id", C.c_int32)]


class CUmemAllocFlags(C.Structure):
    _fields_ = [("compressionType", C.c_ubyte), ("gpuDirectRDMACapable", C.c_ubyte),
                ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]


class CUmemAllocationProp(C.Structure):
    _fields_ = [("type", C.c_int32), ("requestedHandleTypes", C.c_int32), ("location", CUmemLocation),
                ("win32HandleMetaData", C.c_void_p), ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(C.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", C.c_int32)]


assert C.sizeof(CUmemAllocationProp) == 32 and CUmemAllocationProp.allocFlags.offset == 24
assert C.sizeof(CUmemAccessDesc) == 12

_P = C.POINTER
_U64 = C.c_uint64
_PROTOTYPES: dict[str, list] = {
    "cuInit": [C.c_uint],
    "cuDeviceGet": [_P(C.c_int), C.c_int],
    "cuDeviceGetCount": [_P(C.c_int)],
    "cuDeviceGetAttribute": [_P(C.c_int), C.c_int, C.c_int],
    "cuDevicePrimaryCtxRetain": [_P(C.c_void_p), C.c_int],
    "cuCtxSetCurrent": [C.c_void_p],
    "cuCtxSynchronize": [],
    "cuMemGetInfo_v2": [_P(C.c_size_t), _P(C.c_size_t)],
    "cuMemAddressReserve": [_P(_U64), C.c_size_t, C.c_size_t, _U64, C.c_ulonglong],
    "cuMemAddressFree": [_U64, C.c_size_t],
    "cuMemCreate": [_P(_U64), C.c_size_t, _P(CUmemAllocationProp), C.c_ulonglong],
    "cuMemRelease": [_U64],
    "cuMemMap": [_U64, C.c_size_t, C.c_size_t, _U64, C.c_ulonglong],
    "cuMemUnmap": [_U64, C.c_size_t],
    "cuMemSetAccess": [_U64, C.c_size_t, _P(CUmemAccessDesc), C.c_size_t],
    "cuMemGetAllocationGranularity": [_P(C.c_size_t), _P(CUmemAllocationProp), C.c_int],
    "cuMemcpy": [_U64, _U64, C.c_size_t],
    "cuMemAllocHost_v2": [_P(C.c_void_p), C.c_size_t],
    "cuMemFreeHost": [C.c_void_p],
    "cuGetErrorString": [C.c_int, _P(C.c_char_p)],
}

def load_library(path: str) -> C.CDLL:
    """Loads a CUDA driver library once per process and declares the prototypes."""
    return native.load_ctypes_library(
        path, {name: (argtypes, C.c_int) for name, argtypes in _PROTOTYPES.items()},
        op="load CUDA driver",
        unloadable="cannot load {path}: no NVIDIA driver on this machine; use --device cpu, or "
                   "set XLLM_VMM_CUDA_LIBRARY to libcuda.so.1's path",
        missing_symbol="{path} has no {name}: the VMM API needs CUDA 10.2 or newer")


class CudaDriver(LedgerDriver):
    """VMM on an NVIDIA GPU. Thread-safe."""

    name = "cuda"
    device_kind = "cuda"
    _invalid_code = CUDA_ERROR_INVALID_VALUE

    def __init__(self, *, device_index: int = 0, device_memory: int | None = None,
                 library: str | None = None) -> None:
        self.library = library or os.environ.get("XLLM_VMM_CUDA_LIBRARY") or "libcuda.so.1"
        self._cu = load_library(self.library)
        self.device_index = device_index
        self.device_memory = device_memory
        self._tls = threading.local()
        self._lock = threading.RLock()
        rc = self._cu.cuInit(0)
        if rc != CUDA_SUCCESS:
            raise VmmUnavailable("cuInit", rc, self._text(rc),
                                 "the CUDA driver found no usable GPU; use --device cpu")
        count = C.c_int()
        self._check("cuDeviceGetCount", self._cu.cuDeviceGetCount(C.byref(count)))
        if not 0 <= device_index < count.value:
            raise VmmUnavailable("open cuda driver", CUDA_ERROR_NO_DEVICE, "",
                                 f"device index {device_index} out of range: {count.value} GPU(s) visible")
        dev = C.c_int()
        self._check("cuDeviceGet", self._cu.cuDeviceGet(C.byref(dev), device_index))
        self._dev = dev.value
        supported = C.c_int()
        self._check("cuDeviceGetAttribute", self._cu.cuDeviceGetAttribute(
            C.byref(supported), CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, self._dev))
        if not supported.value:
            raise VmmUnavailable("open cuda driver", 801, "", f"GPU {device_index} does not support VMM")
        ctx = C.c_void_p()
        self._check("cuDevicePrimaryCtxRetain", self._cu.cuDevicePrimaryCtxRetain(C.byref(ctx), self._dev))
        self._ctx = ctx.value
        self._bind()
        self._prop = CUmemAllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED, requestedHandleTypes=0,
                                         location=CUmemLocation(type=CU_MEM_LOCATION_TYPE_DEVICE, id=self._dev))
        self._access = CUmemAccessDesc(location=CUmemLocation(type=CU_MEM_LOCATION_TYPE_DEVICE, id=self._dev),
                                       flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        gran = C.c_size_t()
        self._check("cuMemGetAllocationGranularity", self._cu.cuMemGetAllocationGranularity(
            C.byref(gran), C.byref(self._prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        self._init_common(device_index, device_memory, gran.value, CODES)

    # ---- plumbing -------------------------------------------------------------------------

    def _text(self, rc: int) -> str:
        s = C.c_char_p()
        if self._cu.cuGetErrorString(rc, C.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode(errors="replace")
        return ""

    def _check(self, op: str, rc: int, detail: str = "") -> None:
        if rc == CUDA_SUCCESS:
            return
        cls = VmmOutOfMemory if rc == CUDA_ERROR_OUT_OF_MEMORY else (
            VmmInvalidArgument if rc in (1, 208, 211, 400, 401) else VmmError)
        raise cls(op, rc, self._text(rc), detail)

    def _bind(self) -> None:
        """Makes the primary context current in this thread (once per thread)."""
        if getattr(self._tls, "bound", False):
            return
        self._check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(self._ctx))
        self._tls.bound = True

    def _call(self, op: str, fn, *args, detail: str = "") -> None:
        self._bind()
        self._check(op, fn(*args), detail)

    def _sync_framework(self) -> None:
        """Kernels queued by PyTorch may still use pages about to be unmapped."""
        self._call("cuCtxSynchronize", self._cu.cuCtxSynchronize)

    # ---- device calls (the ledger has checked them) ---------------------------------------

    def _dev_mem_info(self) -> tuple[int, int]:
        free, total = C.c_size_t(), C.c_size_t()
        self._call("cuMemGetInfo_v2", self._cu.cuMemGetInfo_v2, C.byref(free), C.byref(total))
        return free.value, total.value

    def _dev_reserve(self, size: int) -> int:
        va = C.c_uint64()
        self._call("cuMemAddressReserve", self._cu.cuMemAddressReserve, C.byref(va), size,
                   self._granularity, 0, 0, detail=f"size={size}")
        return va.value

    def _dev_release(self, va: int, size: int) -> None:
        self._call("cuMemAddressFree", self._cu.cuMemAddressFree, va, size, detail=f"va={va:#x}")

    def _dev_create(self, size: int) -> int:
        h = C.c_uint64()
        self._call("cuMemCreate", self._cu.cuMemCreate, C.byref(h), size, C.byref(self._prop), 0,
                   detail=f"size={size}")
        return h.value

    def _dev_free(self, handle: int) -> None:
        self._call("cuMemRelease", self._cu.cuMemRelease, handle, detail=f"handle={handle:#x}")

    def _dev_map(self, va: int, size: int, handle: int) -> None:
        """``cuMemMap``, then ``cuMemSetAccess`` (undone by ``cuMemUnmap`` if it fails)."""
        self._call("cuMemMap", self._cu.cuMemMap, va, size, 0, handle, 0, detail=f"va={va:#x}")
        try:
            self._call("cuMemSetAccess", self._cu.cuMemSetAccess, va, size, C.byref(self._access), 1,
                       detail=f"va={va:#x}")
        except VmmError:
            self._cu.cuMemUnmap(va, size)
            raise

    def _dev_unmap(self, va: int, size: int) -> None:
        self._call("cuMemUnmap", self._cu.cuMemUnmap, va, size, detail=f"va={va:#x}")

    def _dev_copy(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                  kind: CopyKind) -> None:
        """``cuMemcpy`` per block (unified addressing: any direction)."""
        memcpy = self._cu.cuMemcpy
        for d, s, n in zip(dsts, srcs, sizes):
            self._check("cuMemcpy", memcpy(d, s, n), f"dst={d:#x} src={s:#x} n={n}")

    def _dev_synchronize(self) -> None:
        self._sync_framework()

    def _dev_alloc_host(self, size: int) -> int:
        """Page-locked host memory from ``cuMemAllocHost``."""
        p = C.c_void_p()
        self._call("cuMemAllocHost_v2", self._cu.cuMemAllocHost_v2, C.byref(p), size, detail=f"size={size}")
        return p.value

    def _dev_free_host(self, ptr: int) -> None:
        self._call("cuMemFreeHost", self._cu.cuMemFreeHost, ptr)

    def __repr__(self) -> str:
        return f"CudaDriver(device_index={self.device_index})"
