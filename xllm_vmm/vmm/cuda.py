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
import errno
import os
import threading
from typing import Sequence

from xllm_vmm.vmm.driver import (
    CopyKind,
    MemInfo,
    Transfer,
    VmmError,
    VmmInvalidArgument,
    VmmOutOfMemory,
    VmmUnavailable,
)
from xllm_vmm.vmm.ledger import Codes, Ledger
from xllm_vmm.vmm.transfer import CopyWorker
from xllm_vmm.vmm.views import ViewRegistry

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

_libs: dict[str, C.CDLL] = {}
_libs_lock = threading.Lock()


def load_library(path: str) -> C.CDLL:
    with _libs_lock:
        lib = _libs.get(path)
        if lib is not None:
            return lib
        try:
            lib = C.CDLL(path)
        except OSError as exc:
            raise VmmUnavailable("load CUDA driver", 0, str(exc),
                                 f"cannot load {path}: no NVIDIA driver on this machine; use "
                                 "--device cpu, or set XLLM_VMM_CUDA_LIBRARY to libcuda.so.1's path") from exc
        for name, argtypes in _PROTOTYPES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as exc:
                raise VmmUnavailable("load CUDA driver", 0, str(exc),
                                     f"{path} has no {name}: the VMM API needs CUDA 10.2 or newer") from exc
            fn.argtypes = argtypes
            fn.restype = C.c_int
        _libs[path] = lib
        return lib


class CudaDriver:
    """VMM on an NVIDIA GPU. Thread-safe."""

    name = "cuda"
    device_kind = "cuda"

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
        self._granularity = gran.value
        self._ledger = Ledger(self._granularity, CODES, device_memory)
        self._host_buffers: set[int] = set()
        self._worker = CopyWorker(f"xllm-vmm-cuda{device_index}-copy", self._bind)
        self.views = ViewRegistry()
        self._closed = False

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

    def _live(self) -> None:
        if self._closed:
            raise VmmInvalidArgument("cuda driver", errno.EBADF, "", "the driver is closed")

    def _sync_framework(self) -> None:
        """Kernels queued by PyTorch may still use pages about to be unmapped."""
        self._call("cuCtxSynchronize", self._cu.cuCtxSynchronize)

    # ---- info -----------------------------------------------------------------------------

    @property
    def granularity(self) -> int:
        return self._granularity

    def mem_info(self) -> MemInfo:
        free, total = C.c_size_t(), C.c_size_t()
        self._call("cuMemGetInfo_v2", self._cu.cuMemGetInfo_v2, C.byref(free), C.byref(total))
        f, t = free.value, total.value
        if self.device_memory is not None:
            t = min(t, self.device_memory)
            with self._lock:
                f = min(f, max(0, self.device_memory - self._ledger.committed))
        return MemInfo(free=f, total=t)

    # ---- virtual ranges -------------------------------------------------------------------

    def reserve(self, size: int) -> int:
        self._live()
        with self._lock:
            self._ledger.check_reserve(size)
            va = C.c_uint64()
            self._call("cuMemAddressReserve", self._cu.cuMemAddressReserve, C.byref(va), size,
                       self._granularity, 0, 0, detail=f"size={size}")
            self._ledger.add_reservation(va.value, size)
            return va.value

    def release(self, va: int, size: int) -> None:
        self._live()
        with self._lock:
            self._ledger.check_release(va, size)
            self.views.check_release(va, size)
            self._call("cuMemAddressFree", self._cu.cuMemAddressFree, va, size, detail=f"va={va:#x}")
            self._ledger.remove_reservation(va)

    # ---- handles --------------------------------------------------------------------------

    def create_handle(self, size: int) -> int:
        self._live()
        with self._lock:
            self._ledger.check_create(size)
            h = C.c_uint64()
            self._call("cuMemCreate", self._cu.cuMemCreate, C.byref(h), size, C.byref(self._prop), 0,
                       detail=f"size={size}")
            self._ledger.add_handle(h.value, size)
            return h.value

    def create_handles(self, count: int, size: int) -> list[int]:
        made: list[int] = []
        try:
            for _ in range(count):
                made.append(self.create_handle(size))
        except VmmError:
            for h in made:
                self.free_handle(h)
            raise
        return made

    def free_handle(self, handle: int) -> None:
        self._live()
        with self._lock:
            self._ledger.check_free(handle)
            self._call("cuMemRelease", self._cu.cuMemRelease, handle, detail=f"handle={handle:#x}")
            self._ledger.remove_handle(handle)

    # ---- mappings -------------------------------------------------------------------------

    def _map_one(self, va: int, handle: int) -> None:
        size = self._ledger.check_map(va, handle)
        self._call("cuMemMap", self._cu.cuMemMap, va, size, 0, handle, 0, detail=f"va={va:#x}")
        try:
            self._call("cuMemSetAccess", self._cu.cuMemSetAccess, va, size, C.byref(self._access), 1,
                       detail=f"va={va:#x}")
        except VmmError:
            self._cu.cuMemUnmap(va, size)
            raise
        self._ledger.add_mapping(va, handle, size)

    def _unmap_one(self, va: int) -> None:
        _, size = self._ledger.check_unmap(va)
        self._call("cuMemUnmap", self._cu.cuMemUnmap, va, size, detail=f"va={va:#x}")
        self._ledger.remove_mapping(va)

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
        self._live()
        if len(vas) != len(handles):
            raise VmmInvalidArgument("map_batch", CUDA_ERROR_INVALID_VALUE, "",
                                     f"{len(vas)} addresses but {len(handles)} handles")
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
        self._live()
        self._sync_framework()
        with self._lock:
            done: list[tuple[int, int]] = []
            try:
                for va in vas:
                    handle, _ = self._ledger.check_unmap(va)
                    self._unmap_one(va)
                    done.append((va, handle))
            except VmmError:
                for va, handle in reversed(done):
                    self._map_one(va, handle)
                raise

    # ---- copies ---------------------------------------------------------------------------

    def copy(self, dst: int, src: int, nbytes: int, kind: CopyKind) -> None:
        self.copy_batch([dst], [src], [nbytes], kind)

    def copy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                   kind: CopyKind) -> None:
        self._live()
        kind = CopyKind(kind)
        if not (len(dsts) == len(srcs) == len(sizes)):
            raise VmmInvalidArgument("copy_batch", CUDA_ERROR_INVALID_VALUE, "",
                                     f"{len(dsts)} destinations, {len(srcs)} sources, {len(sizes)} sizes")
        with self._lock:
            for d, s, n in zip(dsts, srcs, sizes):
                if kind in (CopyKind.H2D, CopyKind.D2D):
                    self._ledger.check_mapped("copy_batch", d, n, "destination")
                if kind in (CopyKind.D2H, CopyKind.D2D):
                    self._ledger.check_mapped("copy_batch", s, n, "source")
        self._sync_framework()
        memcpy = self._cu.cuMemcpy
        for d, s, n in zip(dsts, srcs, sizes):
            self._check("cuMemcpy", memcpy(d, s, n), f"dst={d:#x} src={s:#x} n={n}")

    def copy_batch_async(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                         kind: CopyKind) -> Transfer:
        dsts, srcs, sizes = list(dsts), list(srcs), list(sizes)
        self._live()
        return self._worker.submit(lambda: self.copy_batch(dsts, srcs, sizes, kind))

    def synchronize(self) -> None:
        self._worker.drain()
        self._sync_framework()

    # ---- host buffers ---------------------------------------------------------------------

    def alloc_host(self, size: int) -> int:
        """Page-locked host memory from ``cuMemAllocHost``."""
        p = C.c_void_p()
        self._call("cuMemAllocHost_v2", self._cu.cuMemAllocHost_v2, C.byref(p), size, detail=f"size={size}")
        with self._lock:
            self._host_buffers.add(p.value)
        return p.value

    def free_host(self, ptr: int) -> None:
        with self._lock:
            if ptr not in self._host_buffers:
                raise VmmInvalidArgument("free_host", CUDA_ERROR_INVALID_VALUE, "",
                                         f"{ptr:#x} is not a host buffer of this driver")
            self._host_buffers.discard(ptr)
        self._call("cuMemFreeHost", self._cu.cuMemFreeHost, ptr)

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Unmaps, releases and frees everything this driver made; the primary context stays."""
        if self._closed:
            return
        self._worker.shutdown()
        self.views.check_close()
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

    def __enter__(self) -> "CudaDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CudaDriver(device_index={self.device_index})"
