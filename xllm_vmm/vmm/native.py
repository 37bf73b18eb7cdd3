"""Loading of the native libraries built from ``native/`` (ctypes, no Python ABI).

``libxllm_hostvmm.so`` (the host VMM pool and the copy hot path) and ``libascendcl_emu.so``
(the ACL emulation) are built by ``pip install .`` / ``pip install -e .`` next to this module.
``XLLM_VMM_NATIVE_DIR`` points the loader at another directory (e.g. an AddressSanitizer
build). A missing library raises :class:`VmmUnavailable` that says how to build it.
"""

from __future__ import annotations

import ctypes as C
import os
import threading
from pathlib import Path

from xllm_vmm.vmm.driver import VmmUnavailable

HOST_LIBRARY = "libxllm_hostvmm.so"
ACL_EMULATION_LIBRARY = "libascendcl_emu.so"

_lock = threading.Lock()
_host: C.CDLL | None = None

_U64 = C.c_uint64
_P = C.c_void_p  # pointers to uint64 arrays are passed as raw addresses (array.array buffers)


def library_dir() -> Path:
    """The directory the native libraries are loaded from."""
    override = os.environ.get("XLLM_VMM_NATIVE_DIR")
    return Path(override) if override else Path(__file__).resolve().parent


def library_path(name: str) -> Path:
    """Path of native library ``name``; raises :class:`VmmUnavailable` when it is not built."""
    path = library_dir() / name
    if not path.is_file():
        where = "XLLM_VMM_NATIVE_DIR" if os.environ.get("XLLM_VMM_NATIVE_DIR") else "the package"
        raise VmmUnavailable(
            "load native library",
            0,
            "",
            f"{name} not found in {path.parent} ({where}); it is compiled from native/*.c with gcc "
            "by `pip install .` or `pip install -e .` — reinstall (or run "
            "`python setup.py build_ext --inplace` in a checkout) and check the build log for "
            "compiler errors",
        )
    return path


def _sig(lib: C.CDLL, name: str, argtypes: list, restype=C.c_int) -> None:
    try:
        fn = getattr(lib, name)
    except AttributeError as exc:
        raise VmmUnavailable("load native library", 0, str(exc),
                             f"{lib._name} lacks {name}: it was built from older sources; "
                             "rebuild it with `pip install -e .` (or `python setup.py build_ext "
                             "--inplace`)") from exc
    fn.argtypes = argtypes
    fn.restype = restype


def host_library() -> C.CDLL:
    """The loaded ``libxllm_hostvmm.so`` with every prototype declared (loaded once)."""
    global _host
    with _lock:
        if _host is not None:
            return _host
        path = library_path(HOST_LIBRARY)
        try:
            lib = C.CDLL(str(path))
        except OSError as exc:
            raise VmmUnavailable("load native library", 0, str(exc),
                                 f"{path} exists but could not be loaded; rebuild it with "
                                 "`pip install -e .`") from exc
        pool = C.c_void_p
        _sig(lib, "hv_last_error", [], C.c_char_p)
        _sig(lib, "hv_pool_open", [C.POINTER(C.c_void_p), _U64, _U64])
        _sig(lib, "hv_pool_close", [pool], None)
        _sig(lib, "hv_pool_fd", [pool])
        _sig(lib, "hv_granule", [pool], _U64)
        _sig(lib, "hv_stats", [pool, _P], None)
        _sig(lib, "hv_set_limit", [pool, _U64], None)
        _sig(lib, "hv_set_max_mappings", [pool, _U64], None)
        _sig(lib, "hv_create", [pool, _U64, C.POINTER(_U64)])
        _sig(lib, "hv_free", [pool, _U64])
        _sig(lib, "hv_free_deferred", [pool, _U64])
        _sig(lib, "hv_handle_info", [pool, _U64, C.POINTER(_U64), C.POINTER(_U64)])
        _sig(lib, "hv_reserve", [pool, _U64, C.POINTER(_U64)])
        _sig(lib, "hv_release", [pool, _U64, _U64])
        _sig(lib, "hv_reservation_size", [pool, _U64, C.POINTER(_U64)])
        _sig(lib, "hv_map", [pool, _U64, _U64])
        _sig(lib, "hv_unmap", [pool, _U64, C.POINTER(_U64)])
        _sig(lib, "hv_map_batch", [pool, _P, _P, _U64, C.POINTER(_U64)])
        _sig(lib, "hv_unmap_batch", [pool, _P, _U64, C.POINTER(_U64)])
        _sig(lib, "hv_check_mapped", [pool, _U64, _U64])
        _sig(lib, "hv_copy_batch_checked", [pool, _P, _P, _P, _U64, C.c_int, C.c_int, C.POINTER(_U64)])
        _sig(lib, "hv_copy", [_U64, _U64, _U64], None)
        _sig(lib, "hv_copy_batch", [_P, _P, _P, _U64], None)
        _sig(lib, "hv_host_alloc", [_U64, C.POINTER(_U64)])
        _sig(lib, "hv_host_free", [_U64, _U64])
        _sig(lib, "hv_bench_raw_map_unmap", [C.c_int, _U64, _P, _U64, _U64, _U64])
        _host = lib
        return lib
