r"""glibc ``malloc`` tuning for the CPU engine: keep freed activation memory in the heap.

Why: every step allocates its activations (q/k/v, the MLP's ``(T, intermediate)`` products,
logits) through torch's CPU allocator, which is glibc ``malloc``. By default glibc serves
blocks above a *dynamic* mmap threshold (128 KiB at start, raised up to 32 MiB as large blocks
are freed) with fresh ``mmap`` calls, ``munmap``\s them on ``free``, and ``trim``\s the heap's
free top above ``M_TRIM_THRESHOLD`` back to the OS. The next step then page-faults the same
memory back in, zeroed by the kernel, which measured about 1.4x slower prefill steps on the
bench's bf16 Llama (docs/benchmarks.md, "Measurements behind defaults"). vLLM's CPU docs recommend tcmalloc for the same reason.

What :func:`configure_host_malloc` sets (once per process, process-wide: the server runs the
engine in-process and its own allocations get the same behaviour):

- ``M_TRIM_THRESHOLD`` = :data:`TRIM_THRESHOLD_BYTES` (1 GiB): the heap's free top is returned
  to the OS only above 1 GiB;
- ``M_MMAP_THRESHOLD`` = :data:`MMAP_THRESHOLD_BYTES` (32 MiB, glibc's largest on 64-bit): blocks
  below it come from the heap and are reused after ``free``; this also fixes the threshold
  (glibc stops adjusting it);
- ``M_TOP_PAD`` = :data:`TOP_PAD_BYTES` (64 MiB, the size of a thread arena's heap): a thread
  other than the main one (``serve`` runs the engine on its own thread) allocates from its own
  arena, a chain of 64 MiB heaps, and glibc *deletes* (``munmap``\s) a heap as soon as it is
  wholly free unless the heap below it has ``M_TOP_PAD`` of room left, whatever
  ``M_TRIM_THRESHOLD`` says. With the pad at a heap's size that never holds, so the engine
  thread's heaps stay. Measured in ``bench serve`` before this (strace of one round): the
  engine thread created and deleted 45-138 such heaps per round, and every new heap's pages
  were faulted and zeroed by the kernel again (system time, ``clear_page_erms`` in ``perf``).
  In the main arena the pad only means ``brk`` grows, and the trimmed heap keeps, 64 MiB more
  address space than asked for (pages are not touched until used).

Cost: freed activation memory stays in the process heap, up to the largest step's peak (plus
fragmentation); RSS does not fall back after a big step. Blocks of 32 MiB and more are still
``mmap``\\ed and returned at once. Weights and the KV arena are not ``malloc`` memory and are
not affected.

``XLLM_VMM_MALLOPT=0`` (or ``false``/``off``/``no``) leaves glibc's defaults alone. On a libc
that is not glibc (musl, macOS) the call is a no-op that says why (:class:`MallocTuning`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from dataclasses import dataclass

ENV = "XLLM_VMM_MALLOPT"
"""``0``/``false``/``off``/``no``: keep glibc's default trim / mmap thresholds."""

TRIM_THRESHOLD_BYTES = 1 << 30
"""``M_TRIM_THRESHOLD``: free heap top above this many bytes goes back to the OS."""

MMAP_THRESHOLD_BYTES = 32 << 20
"""``M_MMAP_THRESHOLD``: blocks of at least this many bytes are ``mmap``\\ed (glibc's maximum
on 64-bit, ``DEFAULT_MMAP_THRESHOLD_MAX``; a larger value is refused by ``mallopt``)."""

TOP_PAD_BYTES = 64 << 20
"""``M_TOP_PAD``: free room kept at a heap's top; at a thread arena heap's size (glibc's
``HEAP_MAX_SIZE`` on 64-bit) no wholly free thread heap is ever deleted (module doc)."""

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


@dataclass(frozen=True)
class MallocTuning:
    """What :func:`configure_host_malloc` did: ``applied`` True when the thresholds and the pad
    were set;
    otherwise ``reason`` says why not (switched off, not glibc, ``mallopt`` refused)."""

    applied: bool
    reason: str
    trim_threshold_bytes: int = 0
    mmap_threshold_bytes: int = 0
    top_pad_bytes: int = 0


_RESULT: MallocTuning | None = None


def _switched_off() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no")


def _glibc():
    """The process's glibc (``ctypes.CDLL(None)`` resolves symbols over everything loaded), or
    None with the reason."""
    lib_name, _version = platform.libc_ver()
    if lib_name != "glibc":
        return None, f"the C library is not glibc ({lib_name or 'unknown'}): mallopt not used"
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError) as e:
        return None, f"glibc's mallopt is not reachable through ctypes ({e})"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return libc, ""


def configure_host_malloc() -> MallocTuning:
    """Set glibc's trim and mmap thresholds and top pad once for this process (module doc);
    later calls return the first call's result. Never raises: a libc without ``mallopt`` or the
    ``XLLM_VMM_MALLOPT=0`` switch gives ``applied=False`` with the reason."""
    global _RESULT
    if _RESULT is not None:
        return _RESULT
    if _switched_off():
        _RESULT = MallocTuning(False, f"{ENV}=0: glibc's default thresholds kept")
        return _RESULT
    libc, reason = _glibc()
    if libc is None:
        _RESULT = MallocTuning(False, reason)
        return _RESULT
    ok_trim = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    ok_mmap = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok_pad = libc.mallopt(_M_TOP_PAD, TOP_PAD_BYTES) == 1
    if ok_trim and ok_mmap and ok_pad:
        _RESULT = MallocTuning(True, "glibc mallopt set", TRIM_THRESHOLD_BYTES,
                               MMAP_THRESHOLD_BYTES, TOP_PAD_BYTES)
    else:
        said = ", ".join(f"{name} {'set' if ok else 'refused'}" for name, ok in (
            ("M_TRIM_THRESHOLD", ok_trim), ("M_MMAP_THRESHOLD", ok_mmap), ("M_TOP_PAD", ok_pad)))
        _RESULT = MallocTuning(False, f"glibc refused mallopt ({said})")
    return _RESULT


def host_malloc_tuning() -> MallocTuning | None:
    """This process's result of :func:`configure_host_malloc` (None: not called yet)."""
    return _RESULT


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def mallinfo2() -> dict[str, int] | None:
    """glibc's ``mallinfo2()`` as a dict of byte / count fields (``arena``: heap bytes from
    ``brk``; ``hblkhd``: bytes in ``mmap``\\ed blocks; ``fordblks``: free heap bytes), or None
    when the libc lacks it (glibc < 2.33, not glibc)."""
    libc, _ = _glibc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.argtypes = []
    fn.restype = _Mallinfo2
    info = fn()
    return {name: int(getattr(info, name)) for name, _ in _Mallinfo2._fields_}


__all__ = ["ENV", "MMAP_THRESHOLD_BYTES", "MallocTuning", "TOP_PAD_BYTES", "TRIM_THRESHOLD_BYTES",
           "configure_host_malloc", "host_malloc_tuning", "mallinfo2"]
