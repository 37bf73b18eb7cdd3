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
import errno
import os
import sys
import threading
from typing import Sequence

from xllm_vmm.vmm import native
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

_libs: dict[str, C.CDLL] = {}
_libs_lock = threading.Lock()


def resolve_library(library: str | None) -> str:
    """The ACL library path to load: argument, ``$XLLM_VMM_ACL_LIBRARY``, or libascendcl.so;
    ``"emulation"`` (or ``"emu"``) is the bundled emulation."""
    choice = library or os.environ.get("XLLM_VMM_ACL_LIBRARY") or "libascendcl.so"
    if choice in ("emulation", "emu"):
        return str(native.library_path(native.ACL_EMULATION_LIBRARY))
    return choice


def load_library(path: str) -> C.CDLL:
    """Loads an ACL library once per process and declares the prototypes."""
    with _libs_lock:
        lib = _libs.get(path)
        if lib is not None:
            return lib
        try:
            lib = C.CDLL(path)
        except OSError as exc:
            raise VmmUnavailable(
                "load ACL runtime", 0, str(exc),
                f"cannot load {path}: on an Ascend host source CANN's set_env.sh (it puts "
                "libascendcl.so on LD_LIBRARY_PATH) or set XLLM_VMM_ACL_LIBRARY to its path; "
                "without an NPU use --device cpu, or XLLM_VMM_ACL_LIBRARY=emulation for the "
                "bundled ACL emulation") from exc
        for name, (argtypes, restype) in _PROTOTYPES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as exc:
                raise VmmUnavailable("load ACL runtime", 0, str(exc),
                                     f"{path} has no {name}: the VMM API needs CANN 8.0 or newer") from exc
            fn.argtypes = argtypes
            fn.restype = restype
        _libs[path] = lib
        return lib


def _sync_framework() -> None:
    """Drains torch_npu's task queue, so raw ACL calls do not overtake queued kernels."""
    if "torch_npu" in sys.modules:
        import torch

        torch.npu.synchronize()


class AclDriver:
    """VMM on an Ascend NPU (or the ACL emulation). Thread-safe."""

    name = "acl"
    device_kind = "npu"

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
        self._granularity = gran.value
        self._reserve_flags = int(os.environ.get("XLLM_VMM_ACL_RESERVE_FLAGS", "0"))
        self._ledger = Ledger(self._granularity, CODES, device_memory)
        self._host_buffers: set[int] = set()
        self._worker = CopyWorker(f"xllm-vmm-acl{device_index}-copy", self._bind)
        self.views = ViewRegistry()
        self._closed = False

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

    def _live(self) -> None:
        if self._closed:
            raise VmmInvalidArgument("acl driver", errno.EBADF, "", "the driver is closed")

    # ---- info -----------------------------------------------------------------------------

    @property
    def granularity(self) -> int:
        return self._granularity

    def mem_info(self) -> MemInfo:
        """``aclrtGetMemInfo(ACL_HBM_MEM)``, capped by ``device_memory`` when configured."""
        free, total = C.c_size_t(), C.c_size_t()
        self._call("aclrtGetMemInfo", self._acl.aclrtGetMemInfo, ACL_HBM_MEM, C.byref(free), C.byref(total))
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
            va = C.c_void_p()
            self._call("aclrtReserveMemAddress", self._acl.aclrtReserveMemAddress, C.byref(va), size, 0,
                       None, self._reserve_flags, detail=f"size={size}")
            self._ledger.add_reservation(va.value, size)
            return va.value

    def release(self, va: int, size: int) -> None:
        self._live()
        with self._lock:
            self._ledger.check_release(va, size)
            self.views.check_release(va, size)
            self._call("aclrtReleaseMemAddress", self._acl.aclrtReleaseMemAddress, va, detail=f"va={va:#x}")
            self._ledger.remove_reservation(va)

    # ---- handles --------------------------------------------------------------------------

    def create_handle(self, size: int) -> int:
        self._live()
        with self._lock:
            self._ledger.check_create(size)
            h = C.c_void_p()
            self._call("aclrtMallocPhysical", self._acl.aclrtMallocPhysical, C.byref(h), size,
                       C.byref(self._prop), 0, detail=f"size={size}")
            self._ledger.add_handle(h.value, size)
            return h.value

    def create_handles(self, count: int, size: int) -> list[int]:
        """``count`` handles of ``size`` bytes, all or nothing."""
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
            self._call("aclrtFreePhysical", self._acl.aclrtFreePhysical, handle, detail=f"handle={handle:#x}")
            self._ledger.remove_handle(handle)

    # ---- mappings -------------------------------------------------------------------------

    def _map_one(self, va: int, handle: int) -> None:
        size = self._ledger.check_map(va, handle)
        self._call("aclrtMapMem", self._acl.aclrtMapMem, va, size, 0, handle, 0,
                   detail=f"va={va:#x} handle={handle:#x}")
        self._ledger.add_mapping(va, handle, size)

    def _unmap_one(self, va: int) -> None:
        self._ledger.check_unmap(va)
        self._call("aclrtUnmapMem", self._acl.aclrtUnmapMem, va, detail=f"va={va:#x}")
        self._ledger.remove_mapping(va)

    def map(self, va: int, handle: int) -> None:
        self._live()
        with self._lock:
            self._map_one(va, handle)

    def unmap(self, va: int) -> None:
        self._live()
        _sync_framework()
        with self._lock:
            self._unmap_one(va)

    def map_batch(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        """Maps every pair, all or nothing (what this call mapped is unmapped on failure)."""
        self._live()
        if len(vas) != len(handles):
            raise VmmInvalidArgument("map_batch", ACL_ERROR_RT_PARAM_INVALID, "",
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
        """One ``aclrtUnmapMem`` per mapping, all or nothing (re-mapped on failure)."""
        self._live()
        _sync_framework()
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

    def _check_copy(self, op, dst, src, n, kind: CopyKind) -> None:
        if kind in (CopyKind.H2D, CopyKind.D2D):
            self._ledger.check_mapped(op, dst, n, "destination")
        if kind in (CopyKind.D2H, CopyKind.D2D):
            self._ledger.check_mapped(op, src, n, "source")

    def copy(self, dst: int, src: int, nbytes: int, kind: CopyKind) -> None:
        self.copy_batch([dst], [src], [nbytes], kind)

    def copy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                   kind: CopyKind) -> None:
        """One ``aclrtMemcpy`` per block; every device range is checked before the first."""
        self._live()
        kind = CopyKind(kind)
        if not (len(dsts) == len(srcs) == len(sizes)):
            raise VmmInvalidArgument("copy_batch", ACL_ERROR_RT_PARAM_INVALID, "",
                                     f"{len(dsts)} destinations, {len(srcs)} sources, {len(sizes)} sizes")
        with self._lock:
            for d, s, n in zip(dsts, srcs, sizes):
                self._check_copy("copy_batch", d, s, n, kind)
        _sync_framework()
        memcpy = self._acl.aclrtMemcpy
        self._bind()
        for d, s, n in zip(dsts, srcs, sizes):
            rc = memcpy(d, n, s, n, int(kind))
            if rc != ACL_SUCCESS:
                self._raise("aclrtMemcpy", rc, f"dst={d:#x} src={s:#x} n={n}")

    def copy_batch_async(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                         kind: CopyKind) -> Transfer:
        dsts, srcs, sizes = list(dsts), list(srcs), list(sizes)
        self._live()
        return self._worker.submit(lambda: self.copy_batch(dsts, srcs, sizes, kind))

    def synchronize(self) -> None:
        self._worker.drain()
        self._call("aclrtSynchronizeDevice", self._acl.aclrtSynchronizeDevice)

    # ---- host buffers ---------------------------------------------------------------------

    def alloc_host(self, size: int) -> int:
        """Page-locked host memory from ``aclrtMallocHost``."""
        p = C.c_void_p()
        self._call("aclrtMallocHost", self._acl.aclrtMallocHost, C.byref(p), size, detail=f"size={size}")
        with self._lock:
            self._host_buffers.add(p.value)
        return p.value

    def free_host(self, ptr: int) -> None:
        with self._lock:
            if ptr not in self._host_buffers:
                raise VmmInvalidArgument("free_host", ACL_ERROR_RT_PARAM_INVALID, "",
                                         f"{ptr:#x} is not a host buffer of this driver")
            self._host_buffers.discard(ptr)
        self._call("aclrtFreeHost", self._acl.aclrtFreeHost, ptr)

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Unmaps, frees and releases everything this driver made (never aclFinalize)."""
        if self._closed:
            return
        self._worker.shutdown()
        self.views.check_close()
        _sync_framework()
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

    def __enter__(self) -> "AclDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AclDriver(device_index={self.device_index}, library={self.library!r})"
