"""Which threads run the native kernels' parallel parts: torch's OpenMP team, or each native
library's own pool.

The native kernels (``libxllm_paged_attn.so``'s attention, ``libxllm_layer_ops.so``'s norms and
rotary embedding) split their work over ``torch.get_num_threads()`` threads
(``native/threadpool.h``). With ``pool`` each library starts its own persistent workers, which spin
for a while and then sleep between calls, beside torch's OpenMP workers, which do the same
between the matrix products. A decode step alternates the two (a product, a norm, a product,
attention, ...), so on a machine with as many cores as threads the next pool's worker found
the previous pool's worker spinning on the core it needed, and the caller waited at the end
of the call for a worker the scheduler had not run yet. With ``omp`` (the default) the kernels
run on torch's OpenMP team: the same threads, already awake from the product before, and no
second set of threads to schedule.

``XLLM_VMM_NATIVE_THREADS``: ``omp`` (default) or ``pool`` (each library's own
workers). ``omp`` falls back on ``pool`` (``mode()`` says which is in use) when torch's parallel
backend is not OpenMP, its runtime's entry points cannot be found in the process, or the
runtime was told not to spin (``OMP_WAIT_POLICY=passive``, ``GOMP_SPINCOUNT=0``: its threads
then sleep after every region, and a kernel handed to them pays a wake-up each time; measured
slower in ``bench engine``, docs/benchmarks.md; the pool's own 50 µs spin keeps those hand-offs
cheap).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Callable, Mapping

ENV = "XLLM_VMM_NATIVE_THREADS"
MODES = ("omp", "pool")

_lock = threading.Lock()
_setters: list[Callable[..., int]] = []
_mode: str | None = None
_entry: tuple[int, int, int] | None | bool = False  # False: not looked up yet
_runtime: Any = False  # the runtime's CDLL, None, or False: not looked up yet


def wanted(env: Mapping[str, str] | None = None) -> str:
    """The mode ``XLLM_VMM_NATIVE_THREADS`` of ``env`` (default ``os.environ``) asks for
    (``omp`` when unset); ValueError naming the variable for any other value."""
    raw = (os.environ if env is None else env).get(ENV, "").strip().lower()
    if not raw:
        return "omp"
    if raw not in MODES:
        raise ValueError(f"{ENV}={raw!r} (environment): expected one of {', '.join(MODES)} "
                         f"(omp: torch's OpenMP threads, the default; pool: the native "
                         f"libraries' own)")
    return raw


def _openmp_library() -> str | None:
    """The path of the OpenMP runtime torch loaded (``libgomp`` / ``libiomp5``), from the
    process's mappings; None when torch's parallel backend is not OpenMP."""
    import torch

    if not getattr(torch._C, "has_openmp", False):
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return None
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    found = sorted((not p.startswith(torch_lib), p) for p in paths
                   if os.path.basename(p).startswith(("libgomp", "libiomp5")))
    return found[0][1] if found else None


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded, opened with ``RTLD_NOLOAD`` (never a second copy), or
    None. Looked up once per process."""
    global _runtime
    if _runtime is False:
        path = _openmp_library()
        try:
            _runtime = (None if path is None
                        else ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        except OSError:
            _runtime = None
    return _runtime  # type: ignore[return-value]


def openmp_entry_points() -> tuple[int, int, int] | None:
    """Addresses of ``GOMP_parallel``, ``omp_get_thread_num`` and ``omp_get_num_threads`` of the
    OpenMP runtime already loaded by torch (:func:`_openmp`), or None. Looked up once per
    process."""
    global _entry
    if _entry is not False:
        return _entry  # type: ignore[return-value]
    entry = None
    lib = _openmp()
    if lib is not None:
        try:
            entry = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
                          for name in ("GOMP_parallel", "omp_get_thread_num",
                                       "omp_get_num_threads"))
            if not all(entry):
                entry = None
        except AttributeError:
            entry = None
    _entry = entry
    return entry


def openmp_passive(env: Mapping[str, str] | None = None) -> bool:
    """The OpenMP runtime was told not to spin (``OMP_WAIT_POLICY=passive`` or
    ``GOMP_SPINCOUNT=0``): its threads sleep after every parallel region, so each kernel handed
    to them would pay a wake-up (``bench engine`` and ``bench attention`` run this way)."""
    e = os.environ if env is None else env
    return (e.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"
            or e.get("GOMP_SPINCOUNT", "").strip() == "0")


def _apply(setter: Callable[..., int], mode: str) -> str:
    entry = openmp_entry_points() if mode == "omp" and not openmp_passive() else None
    if entry is None:
        setter(None, None, None)
        return "pool"
    return "omp" if setter(*entry) == 1 else "pool"


def attach(setter: Callable[..., int]) -> str:
    """Register a native library's ``*_use_omp(parallel, thread_num, num_threads)`` setter
    (ctypes function: three ``c_void_p``, returns ``c_int``) and apply the current mode to it;
    returns the mode in use for it."""
    global _mode
    with _lock:
        if _mode is None:
            _mode = wanted()
        _setters.append(setter)
        return _apply(setter, _mode)


def set_mode(mode: str) -> str:
    """Switch every registered library to ``mode`` (``omp`` or ``pool``; for A/B measurements
    and tests; never while a kernel runs). Returns the mode now in use."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"native threads mode {mode!r}: expected one of {', '.join(MODES)}")
    with _lock:
        _mode = mode
        for setter in _setters:
            _apply(setter, mode)
    return _in_use()


def mode() -> str:
    """The mode in use: ``omp`` when it is asked for, torch's OpenMP runtime was found and it
    spins between regions (:func:`openmp_passive` is false), else ``pool``."""
    return _in_use()


def _in_use() -> str:
    with _lock:
        want = _mode if _mode is not None else wanted()
    return ("omp" if want == "omp" and not openmp_passive()
            and openmp_entry_points() is not None else "pool")


def release_team() -> bool:
    """End the calling thread's OpenMP team (``omp_pause_resource_all(omp_pause_soft)`` of the
    runtime torch loaded: its idle workers exit; a later parallel region on this thread starts
    a new team). True when released.

    libgomp spins between parallel regions only while the process's OpenMP threads are no more
    than its CPUs; past that it polls ~100 times and sleeps, and every product and kernel of a
    step then waits for its workers to wake. ``serve`` loads and warms the model on its main
    thread and steps it on the engine thread: two teams, 4 threads on 2 cores. Releasing the
    main thread's team once it is done with torch leaves the engine thread's as the only one.
    Measured (``bench serve``'s load on the engine in a second thread, interleaved, quiet): TPOT
    median 12.5-12.9 against 18.5-19.5 ms, output 3,184-3,261 against 2,840-2,954 tok/s."""
    lib = _openmp()
    if lib is None:
        return False
    try:
        pause = lib.omp_pause_resource_all
    except AttributeError:
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(1) == 0  # omp_pause_soft


def prototype() -> tuple[list, Any]:
    """The ctypes prototype of a library's ``*_use_omp`` setter."""
    return ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int)
