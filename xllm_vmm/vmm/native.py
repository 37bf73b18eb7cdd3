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
from typing import Any, Mapping

from xllm_vmm.vmm.driver import VmmUnavailable

HOST_LIBRARY = "libxllm_hostvmm.so"
ACL_EMULATION_LIBRARY = "libascendcl_emu.so"

_lock = threading.Lock()

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


_libs: dict[str, C.CDLL] = {}


def load_ctypes_library(path: str, prototypes: Mapping[str, tuple[list, Any]], *, op: str,
                        unloadable: str, missing_symbol: str, keep_gil: bool = False) -> C.CDLL:
    """Loads the shared library ``path`` once per process and declares ``prototypes`` (symbol →
    (argtypes, restype)). A library that cannot be loaded, or lacks a symbol, raises
    :class:`VmmUnavailable` for ``op`` with ``unloadable`` / ``missing_symbol`` as the advice
    (``{path}`` and ``{name}`` are filled in). ``keep_gil``: calls hold the GIL (``PyDLL``:
    for short calls on state Python also reads; ~70 ns less per call than releasing it)."""
    with _lock:
        lib = _libs.get(path)
        if lib is not None:
            return lib
        try:
            lib = (C.PyDLL if keep_gil else C.CDLL)(path)
        except OSError as exc:
            raise VmmUnavailable(op, 0, str(exc), unloadable.format(path=path)) from exc
        for name, (argtypes, restype) in prototypes.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as exc:
                raise VmmUnavailable(op, 0, str(exc),
                                     missing_symbol.format(path=path, name=name)) from exc
            fn.argtypes = argtypes
            fn.restype = restype
        _libs[path] = lib
        return lib



_optional: dict[str, C.CDLL | None] = {}


def optional_library(name: str, prototypes: Mapping[str, tuple[list, Any]],
                     keep_gil: bool = False) -> C.CDLL | None:
    """An optional kernel library (the engine's ``libxllm_paged_attn.so``,
    ``libxllm_layer_ops.so``) from :func:`library_dir`, loaded once with ``prototypes``
    declared — or None when it is not built, cannot be loaded or lacks a symbol (built from
    older sources), so that the caller falls back on its torch path. The answer is kept for the
    process."""
    try:
        return _optional[name]
    except KeyError:
        pass
    path = library_dir() / name
    lib = None
    if path.is_file():
        try:
            lib = load_ctypes_library(str(path), prototypes, op="load native library",
                                      unloadable="{path}", missing_symbol="{name}",
                                      keep_gil=keep_gil)
        except VmmUnavailable:
            lib = None
    _optional[name] = lib
    return lib

_POOL = C.c_void_p
_INT = C.c_int
_HOST_PROTOTYPES: dict[str, tuple[list, Any]] = {
    "hv_last_error": ([], C.c_char_p),
    "hv_pool_open": ([C.POINTER(C.c_void_p), _U64, _U64], _INT),
    "hv_pool_open_backed": ([C.POINTER(C.c_void_p), _U64, _U64, _INT], _INT),
    "hv_pool_close": ([_POOL], None),
    "hv_pool_fd": ([_POOL], _INT),
    "hv_granule": ([_POOL], _U64),
    "hv_stats": ([_POOL, _P], None),
    "hv_set_limit": ([_POOL, _U64], None),
    "hv_set_max_mappings": ([_POOL, _U64], None),
    "hv_set_populate": ([_POOL, _INT], None),
    "hv_create": ([_POOL, _U64, C.POINTER(_U64)], _INT),
    "hv_free": ([_POOL, _U64], _INT),
    "hv_free_deferred": ([_POOL, _U64], _INT),
    "hv_handle_info": ([_POOL, _U64, C.POINTER(_U64), C.POINTER(_U64)], _INT),
    "hv_reserve": ([_POOL, _U64, C.POINTER(_U64)], _INT),
    "hv_release": ([_POOL, _U64, _U64], _INT),
    "hv_reservation_size": ([_POOL, _U64, C.POINTER(_U64)], _INT),
    "hv_map": ([_POOL, _U64, _U64], _INT),
    "hv_unmap": ([_POOL, _U64, C.POINTER(_U64)], _INT),
    "hv_map_batch": ([_POOL, _P, _P, _U64, C.POINTER(_U64)], _INT),
    "hv_unmap_batch": ([_POOL, _P, _U64, C.POINTER(_U64)], _INT),
    "hv_map_runs": ([_POOL, _P, _U64, C.POINTER(_U64)], _INT),
    "hv_unmap_runs": ([_POOL, _P, _U64, C.POINTER(_U64)], _INT),
    "hv_map_prepared": ([_P], _INT),
    "hv_unmap_prepared": ([_P], _INT),
    "hv_check_mapped": ([_POOL, _U64, _U64], _INT),
    "hv_copy_batch_checked": ([_POOL, _P, _P, _P, _U64, _INT, _INT, C.POINTER(_U64)], _INT),
    "hv_copy": ([_U64, _U64, _U64], None),
    "hv_copy_batch": ([_P, _P, _P, _U64], None),
    "hv_host_alloc": ([_U64, C.POINTER(_U64)], _INT),
    "hv_host_free": ([_U64, _U64], _INT),
    "hv_bench_raw_map_unmap": ([_INT, _U64, _P, _U64, _U64, _U64, _INT], _INT),
    "hv_bench_raw_map_unmap_coalesced": ([_INT, _U64, _P, _U64, _U64, _U64, _INT], _INT),
    "hv_bench_raw_map_unmap_at": ([_INT, _P, _P, _U64, _U64, _U64, _INT], _INT),
}


def host_library() -> C.CDLL:
    """The loaded ``libxllm_hostvmm.so`` with every prototype declared (loaded once)."""
    return load_ctypes_library(
        str(library_path(HOST_LIBRARY)), _HOST_PROTOTYPES, op="load native library",
        unloadable="{path} exists but could not be loaded; rebuild it with `pip install -e .`",
        missing_symbol="{path} lacks {name}: it was built from older sources; rebuild it with "
                       "`pip install -e .` (or `python setup.py build_ext --inplace`)")
