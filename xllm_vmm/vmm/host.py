"""The host driver: VMM over Linux memfd + mmap, through the native ``libxllm_hostvmm.so``.

One driver = one pooled memfd. A handle is a byte offset into it (never 0), committed eagerly
with ``fallocate`` (a lack of memory is :class:`VmmOutOfMemory` now, not SIGBUS later) and freed
by punching a hole. Reservations are ``PROT_NONE``/``MAP_NORESERVE`` ranges aligned to the
granularity; maps are ``MAP_SHARED|MAP_FIXED`` of the memfd; unmapping re-maps ``PROT_NONE`` so
the range stays reserved. The native pool keeps its own table of reservations, handles and
mappings and refuses misuse (``MAP_FIXED`` alone would replace silently). Batched map/unmap is
one native call, all or nothing.

``populate=True`` fills the page tables of every new mapping at map time (``MAP_POPULATE``;
shmem populates by read fault-around, 16 pages per fault, and zeroes a fallocated page on its
first use there), so the first writes into a freshly mapped page — a KV block restored from the
host tier, a block being filled — take no page fault: with shmem transparent huge pages off a
2 MiB page is 512 minor faults of ~1 µs. It moves that work into ``map``/``map_batch`` and
makes it cheaper (measured in docs/benchmarks.md); use it for pools whose pages are written
soon after mapping (KV slots). Best effort: a page that could not be populated faults later.

``max_mappings`` caps live mappings (:class:`VmmOutOfMemory` beyond it), to stay under
``vm.max_map_count``; without it, the kernel's own ENOMEM from ``mmap`` is reported the same way.

Memory: with ``device_memory`` set the driver emulates a device of that many bytes (``mem_info``
total, and out-of-memory once live handles would exceed it). Either way it commits host memory
only while the host can really give it: ``fallocate`` on a memfd does not fail when RAM runs
out (the kernel's OOM killer fires instead), so :meth:`create_handle` and :meth:`alloc_host`
raise :class:`VmmOutOfMemory` once the bytes this driver holds would exceed its *host
capacity*: what the host had available at the last reading (the cgroup's limit − usage, or
``MemAvailable``, whichever is smaller — both already count memory committed before it as
used), less what every host driver of this process committed since (one process-wide ledger
and lock per host-memory source: drivers of simulated workers in one process cannot together
over-commit), minus a safety margin left to everything else (``host_margin``;
default :func:`default_host_margin`: 1/32 of host memory, at least 512 MiB). The reading is
taken at open and again when it is over a second old or a request would not fit the previous
one (memory freed elsewhere becomes usable). ``mem_info().free`` is exactly what a new handle
may take now: the host headroom, and with ``device_memory`` the smaller of that and the device's
own free bytes. Handle memory counts as ``Shmem`` in ``/proc/meminfo``; host buffers are
populated (committed) at allocation. Every mapping costs VMAs (``vm.max_map_count``, 65530 by
default); contiguous handles mapped contiguously merge into one VMA. The memfd is one file
descriptor per driver.

Huge pages (``hugepages=``, env ``XLLM_VMM_HOST_HUGEPAGES``; :mod:`xllm_vmm.vmm.hugepages`):
``"off"`` backs handles with 4 KiB shmem pages; ``"thp"`` with shmem transparent huge pages
(committed through a ``MADV_HUGEPAGE`` mapping, still ``Shmem`` and host memory); ``"hugetlb"``
with a ``MFD_HUGETLB`` memfd: its handles are *not* host memory in ``MemAvailable`` or
``Shmem`` but come from the free 2 MiB huge pages, so they are counted against those (a
second ledger per hugetlb source, no margin) while host buffers stay on host memory; ``"auto"``
(the default) takes hugetlb when the free huge pages hold what the driver may take, else thp
where shmem THP is allowed, else off. The granularity stays 2 MiB on every backing, so a
freed handle punches whole huge pages; releasing a GiB frees 512 pages instead of 262,144.

Errors carry ``errno`` as ``code``. Not fork-safe: a forked child shares the mappings.
"""

from __future__ import annotations

import array
import ctypes as C
import errno
import threading
import time
import weakref
from typing import Callable, Sequence

from xllm_vmm.vmm import hugepages as hugepages_mod
from xllm_vmm.vmm import native
from xllm_vmm.vmm.base import DriverBase
from xllm_vmm.vmm.driver import (ERRNO_ERRORS, CopyKind, MemInfo, Transfer, VmmError,
                                  VmmInvalidArgument, VmmOutOfMemory, check_size)
from xllm_vmm.vmm.sysmem import host_memory
from xllm_vmm.vmm.transfer import CopyWorker
from xllm_vmm.vmm.views import ViewRegistry

GRANULARITY = 2 * 1024 * 1024
_MiB = 1024 * 1024
#: the smallest safety margin of host memory the driver leaves to the rest of the system
HOST_MARGIN_MIN = 512 * _MiB
#: seconds after which the host memory reading is taken again before the next commit
HOST_REREAD_S = 1.0


def default_host_margin(total: int) -> int:
    """Host memory (bytes) the driver leaves uncommitted: 1/32 of ``total``, at least 512 MiB
    (room for page tables, the process's own heap, other processes and the kernel)."""
    return max(HOST_MARGIN_MIN, total // 32)


class _HostLedger:
    """What the host drivers of this process that read one memory source hold, together.

    A driver's reading of the source counts everything committed before it as used; what any
    driver of the process commits after it is not in it. Each driver therefore subtracts what
    *all* of them committed since its reading (process-wide ``held`` now − ``held`` then), and
    checks and commits under the ledger's one lock: several drivers in one process (simulated
    workers) cannot together commit beyond what the source had."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.accounts: "weakref.WeakSet[_Account]" = weakref.WeakSet()

    def held(self) -> int:
        """Bytes every live driver's account on this ledger holds now."""
        return sum(a.held() for a in list(self.accounts))


#: one ledger per memory source (the default readers: every host driver of the process)
_LEDGERS: "weakref.WeakKeyDictionary[Callable[[], MemInfo], _HostLedger]" = weakref.WeakKeyDictionary()
_LEDGERS_LOCK = threading.Lock()


def _ledger_for(reader: Callable[[], MemInfo]) -> _HostLedger:
    with _LEDGERS_LOCK:
        try:
            return _LEDGERS[reader]
        except TypeError:  # a reader that cannot be weakly referenced: a ledger of its own
            return _HostLedger()
        except KeyError:
            ledger = _LEDGERS[reader] = _HostLedger()
            return ledger


class _Account:
    """One memory source as one driver commits against it: the source's last reading, what
    the process held then, the margin left to the system. ``counts``: what of the driver's
    memory comes from this source — ``"all"`` (4 KiB / THP shmem: handles and host buffers),
    ``"handles"`` (hugetlb pages) or ``"buffers"`` (the host buffers of a hugetlb driver)."""

    def __init__(self, driver: "HostDriver", reader: Callable[[], MemInfo], margin: int,
                 counts: str, what: str, first: MemInfo | None = None) -> None:
        self.reader, self.margin, self.counts, self.what = reader, margin, counts, what
        self.ledger = _ledger_for(reader)
        self._driver = weakref.ref(driver)
        with self.ledger.lock:
            self.reading = first if first is not None else reader()
            self.held_at_reading = self.ledger.held()
            self.read_at = time.monotonic()
            self.ledger.accounts.add(self)

    def held(self) -> int:
        """Bytes the driver holds from this source (0 once closed or gone)."""
        d = self._driver()
        if d is None or d._closed:
            return 0
        handles = d.stats()["committed_bytes"] if self.counts != "buffers" else 0
        buffers = d._hb_bytes if self.counts != "handles" else 0
        return handles + buffers

    def headroom(self, fresh: bool) -> int:
        """Bytes the driver may still commit from this source (may be negative): available
        at the last reading, less what the process's drivers committed since, less the margin.
        Re-reads when ``fresh`` or when the reading is older than :data:`HOST_REREAD_S`."""
        held = self.ledger.held()
        now = time.monotonic()
        if fresh or now - self.read_at > HOST_REREAD_S:
            self.reading = self.reader()
            self.held_at_reading = held
            self.read_at = now
        return self.reading.free - (held - self.held_at_reading) - self.margin

    def check_room(self, op: str, size: int) -> None:
        """:class:`VmmOutOfMemory` when committing ``size`` more bytes would leave the source
        less than the margin (caller holds ``ledger.lock``)."""
        if size <= 0 or size <= self.headroom(fresh=False):
            return
        room = self.headroom(fresh=True)
        if size <= room:
            return
        gib = 1024 ** 3
        d = self._driver()
        mine = self.held()
        if self.counts == "handles":
            raise VmmOutOfMemory(
                op, errno.ENOMEM,
                f"out of huge pages: {size} bytes ({size / gib:.2f} GiB) requested, "
                f"{max(0, room)} bytes ({max(0, room) / gib:.2f} GiB) of free 2 MiB hugetlb "
                f"pages ({self.reading.free / gib:.2f} GiB free at the last reading, "
                f"{mine / gib:.2f} GiB held by this driver, "
                f"{self.ledger.held() / gib:.2f} GiB by every hugetlb driver of this process)",
                "raise `sysctl vm.nr_hugepages`, ask for less, or open the driver with "
                "hugepages='thp' or 'off'")
        raise VmmOutOfMemory(
            op, errno.ENOMEM,
            f"out of host memory: {size} bytes ({size / gib:.2f} GiB) requested, "
            f"{max(0, room)} bytes ({max(0, room) / gib:.2f} GiB) can be committed "
            f"({self.reading.free / gib:.2f} GiB available on this host, a safety margin of "
            f"{self.margin / gib:.2f} GiB left to the system, "
            f"{(d._own_held() if d is not None else 0) / gib:.2f} GiB held by this driver, "
            f"{self.ledger.held() / gib:.2f} GiB by every host driver of this process)",
            "free host memory or ask for less")


_STAT_NAMES = ("committed_bytes", "handles", "reservations", "reserved_bytes", "mapped_bytes",
               "mappings", "limit_bytes", "file_end_bytes", "max_mappings", "release_pending",
               "backing")
#: the native pool's backing codes (HV_BACKING_* of hostvmm.h)
BACKING_CODES = {"off": 0, "hugetlb": 1, "thp": 2}


def _u64s(values: Sequence[int]) -> array.array:
    """``values`` as an ``array('Q')``: an ``array('Q')`` is passed as it is (no copy, no
    conversion), anything else is converted once."""
    if values.__class__ is array.array and values.typecode == "Q":
        return values
    try:
        return array.array("Q", values)
    except (OverflowError, TypeError) as exc:
        raise VmmInvalidArgument("batch", errno.EINVAL, "",
                                 f"addresses, handles and sizes must be non-negative ints: {exc}") from exc


def runs_of(vas: Sequence[int], handles: Sequence[int], sizes: Sequence[int] | int
            ) -> tuple[array.array, array.array]:
    """The run records of mapping ``handles[i]`` (``sizes[i]`` bytes, or one size for all) at
    ``vas[i]``: ``(map_runs, unmap_runs)`` arrays for :meth:`HostDriver.map_runs` /
    :meth:`HostDriver.unmap_runs`, one record per run of entries contiguous both in address
    and in memfd offset. Built once per layout; the arrays can be passed again and again."""
    if len(vas) != len(handles):
        raise VmmInvalidArgument("runs_of", errno.EINVAL, "",
                                 f"{len(vas)} addresses but {len(handles)} handles")
    one = sizes if isinstance(sizes, int) else None
    maps: list[int] = []
    unmaps: list[int] = []
    end_va = end_h = -1
    for i, (va, h) in enumerate(zip(vas, handles)):
        size = one if one is not None else sizes[i]
        if va == end_va and h == end_h:
            maps[-1] += size
            unmaps[-1] += size
        else:
            maps += (va, h, size)
            unmaps += (va, size)
        end_va, end_h = va + size, h + size
    return _u64s(maps), _u64s(unmaps)


class _Prepared(C.Structure):
    """``hv_prepared`` of hostvmm.h: the pool, both record arrays and their lengths, the
    failing run's index (out)."""

    _fields_ = [("pool", C.c_void_p), ("maps", C.c_void_p), ("nmaps", C.c_uint64),
                ("unmaps", C.c_void_p), ("nunmaps", C.c_uint64), ("failed", C.c_uint64)]


class RunBatch:
    """Run records prepared once (:meth:`HostDriver.prepare_runs`): ``maps`` holds
    ``(va, handle, nbytes)`` triples, ``unmaps`` the matching ``(va, nbytes)`` pairs, one per
    run contiguous in address and memfd offset. A batch prepared by a driver carries that
    driver's native call block (``hv_prepared``: the pool and both arrays), so mapping or
    unmapping the same layout again is one native call with one prebuilt pointer argument:
    nothing per page in Python and no argument conversion. A batch built directly (or used on
    another driver) goes through the general record path. The arrays must not be resized (the
    native call reads them by address); the block's pool is cleared when its driver closes."""

    __slots__ = ("maps", "unmaps", "nbytes", "_pool", "_call", "_ptr", "__weakref__")

    def __init__(self, maps: array.array, unmaps: array.array) -> None:
        self.maps, self.unmaps = maps, unmaps
        #: bytes in the batch (the runs' sizes added up)
        self.nbytes = sum(unmaps[1::2])
        #: the pool (address) whose call block this is; 0 = not prepared by a driver
        self._pool = 0
        self._call = _Prepared(None, maps.buffer_info()[0] if len(maps) else None, len(maps) // 3,
                               unmaps.buffer_info()[0] if len(unmaps) else None,
                               len(unmaps) // 2, 0)
        # a by-reference argument built once: ctypes passes it with the least work per call
        self._ptr = C.byref(self._call)

    def __len__(self) -> int:
        """Number of runs."""
        return len(self.unmaps) // 2


def _addr(arr: array.array) -> int:
    return arr.buffer_info()[0]


def _close_pool(lib: C.CDLL, pool: int, prepared: "weakref.WeakSet[RunBatch]") -> None:
    for batch in list(prepared):  # their call blocks no longer reach the pool (EBADF)
        batch._call.pool = None
    lib.hv_pool_close(pool)


class HostDriver(DriverBase):
    """VMM on host memory. Thread-safe (the native pool holds one mutex; copies take none)."""

    name = "host"
    device_kind = "cpu"

    def __init__(self, *, device_index: int = 0, device_memory: int | None = None,
                 granularity: int = GRANULARITY, max_mappings: int | None = None,
                 populate: bool = False, host_margin: int | None = None,
                 host_memory_reader: Callable[[], MemInfo] | None = None,
                 hugepages: str | None = None,
                 hugetlb_memory_reader: Callable[[], MemInfo] | None = None) -> None:
        """``host_margin``: bytes of host memory never committed (see the module);
        ``host_memory_reader``: where host free/total bytes come from (default
        :func:`~xllm_vmm.vmm.sysmem.host_memory`; tests pass a fake host).
        ``hugepages``: what backs the handles — ``"auto"``, ``"hugetlb"``, ``"thp"`` or
        ``"off"`` (see :mod:`xllm_vmm.vmm.hugepages`); ``None`` takes
        ``$XLLM_VMM_HOST_HUGEPAGES``, else ``"auto"``. The backing in use is :attr:`hugepages`
        (and ``stats()["backing"]``); an explicit mode the machine forbids is a
        :class:`VmmInvalidArgument` naming the setting to change. ``hugetlb_memory_reader``:
        where free/total hugetlb bytes come from (default
        :func:`~xllm_vmm.vmm.hugepages.hugetlb_memory`)."""
        if device_memory is not None and device_memory <= 0:
            raise VmmInvalidArgument("open host driver", errno.EINVAL, "",
                                     f"device_memory must be a positive number of bytes, got {device_memory}")
        if host_margin is not None and host_margin < 0:
            raise VmmInvalidArgument("open host driver", errno.EINVAL, "",
                                     f"host_margin must be >= 0 bytes, got {host_margin}")
        self._closed = True  # until the pool is open (the accounts read it)
        self._hb_bytes = 0
        self._read_host_memory = host_memory_reader or host_memory
        read_hugetlb = hugetlb_memory_reader or hugepages_mod.hugetlb_memory
        first = self._read_host_memory()
        self.host_margin = default_host_margin(first.total) if host_margin is None else host_margin
        try:
            mode, _where = hugepages_mod.requested_mode(hugepages)
            need = device_memory if device_memory is not None else max(0, first.free - self.host_margin)
            huge = read_hugetlb() if mode in ("auto", "hugetlb") else MemInfo(0, 0)
            backing, reason = hugepages_mod.resolve(mode, need, hugetlb=huge)
        except ValueError as exc:
            raise VmmInvalidArgument("open host driver", errno.EINVAL, "", str(exc)) from None
        if backing == "hugetlb" and granularity % hugepages_mod.HUGE_PAGE:
            raise VmmInvalidArgument("open host driver", errno.EINVAL, "",
                                     f"hugepages=hugetlb needs a granularity that is a multiple of "
                                     f"2 MiB, got {granularity}")
        self.device_index = device_index
        self.device_memory = device_memory
        self._lib = native.host_library()
        pool = C.c_void_p()
        self._check("open host pool", self._lib.hv_pool_open_backed(
            C.byref(pool), granularity, device_memory or 0, BACKING_CODES[backing]))
        self._pool = pool.value
        # the prepared-batch calls: own function objects without argtypes, called with the
        # batch's prebuilt pointer (no conversion runs; ctypes still releases the GIL)
        self._map_prepared = self._lib["hv_map_prepared"]
        self._unmap_prepared = self._lib["hv_unmap_prepared"]
        self._map_prepared.restype = self._unmap_prepared.restype = C.c_int
        self._prepared: "weakref.WeakSet[RunBatch]" = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, _close_pool, self._lib, self._pool,
                                           self._prepared)
        #: the backing in use: "hugetlb", "thp" or "off" (4 KiB pages)
        self.hugepages = backing
        #: why this backing (what auto found, or the explicit choice)
        self.hugepages_reason = reason
        if max_mappings:
            self._lib.hv_set_max_mappings(self._pool, max_mappings)
        self._populate = bool(populate)
        self._lib.hv_set_populate(self._pool, int(self._populate))
        self._granularity = granularity
        self._host_buffers: dict[int, int] = {}
        self._hb_lock = threading.Lock()
        self._closed = False
        # host buffers always come from ordinary memory; hugetlb handles from the huge pages
        # (not in MemAvailable: they count against the free huge pages, with no margin)
        if backing == "hugetlb":
            self._buffer_account = _Account(self, self._read_host_memory, self.host_margin,
                                            "buffers", "host memory", first)
            self._handle_account = _Account(self, read_hugetlb, 0, "handles", "hugetlb pages",
                                            huge)
        else:
            self._buffer_account = self._handle_account = _Account(
                self, self._read_host_memory, self.host_margin, "all", "host memory", first)
        self._ledger = self._buffer_account.ledger
        self._mem_lock = self._handle_account.ledger.lock  # handle capacity check + commit
        self._buf_lock = self._buffer_account.ledger.lock  # host-buffer check + commit
        self._worker = CopyWorker(f"xllm-vmm-host{device_index}-copy")
        self.views = ViewRegistry()

    # ---- errors -------------------------------------------------------------------------------

    def _check(self, op: str, rc: int, detail: str = "") -> None:
        if rc == 0:
            return
        msg = (self._lib.hv_last_error() or b"").decode(errors="replace")
        cls = ERRNO_ERRORS.get(rc, VmmError)
        raise cls(op, rc, msg, detail)

    def _live(self) -> int:
        if self._closed:
            raise VmmInvalidArgument("host driver", errno.EBADF, "", "the driver is closed")
        return self._pool

    # ---- options ------------------------------------------------------------------------------

    @property
    def populate(self) -> bool:
        """Whether new mappings get their page tables filled at map time (see the module)."""
        return self._populate

    @populate.setter
    def populate(self, on: bool) -> None:
        self._lib.hv_set_populate(self._live(), 1 if on else 0)
        self._populate = bool(on)

    # ---- info ---------------------------------------------------------------------------------

    @property
    def granularity(self) -> int:
        """Physical page size in bytes (2 MiB)."""
        return self._granularity

    def mem_info(self) -> MemInfo:
        """``free``: the bytes a new handle may take now — the headroom of the handles' source
        (host memory, or the free hugetlb pages; see the module), and with ``device_memory``
        the smaller of that and device_memory − live handle bytes. ``total``: device_memory,
        else the source's total (cgroup limit or MemTotal; the hugetlb pool)."""
        acc = self._handle_account
        with self._mem_lock:
            room = max(0, acc.headroom(fresh=False))
            if self.device_memory is not None:
                committed = self.stats()["committed_bytes"]
                return MemInfo(free=min(room, max(0, self.device_memory - committed)),
                               total=self.device_memory)
            return MemInfo(free=room, total=acc.reading.total)

    # ---- host capacity ------------------------------------------------------------------------

    def _own_held(self) -> int:
        """Bytes this driver holds: live handles + host buffers (0 once closed)."""
        if self._closed:
            return 0
        return self.stats()["committed_bytes"] + self._hb_bytes

    def stats(self) -> dict[str, int]:
        """Counters of the native pool: committed/reserved/mapped bytes, handles, mappings;
        ``backing`` is the pool's :data:`BACKING_CODES` value (:attr:`hugepages` names it)."""
        out = (C.c_uint64 * len(_STAT_NAMES))()
        self._lib.hv_stats(self._live(), C.addressof(out))
        return dict(zip(_STAT_NAMES, out))

    # ---- virtual ranges -----------------------------------------------------------------------

    def reserve(self, size: int) -> int:
        """Reserves ``size`` bytes (a positive multiple of the granularity) of address space,
        aligned to the granularity; returns its start."""
        check_size("reserve", size, granularity=self._granularity)
        va = C.c_uint64()
        self._check("reserve", self._lib.hv_reserve(self._live(), size, C.byref(va)),
                    f"size={size}")
        return va.value

    def release(self, va: int, size: int) -> None:
        """Releases a whole reservation; refused while it has mappings or live tensor views."""
        self.views.check_release(va, size)
        self._check("release", self._lib.hv_release(self._live(), va, size),
                    f"va={va:#x} size={size}")

    # ---- handles ------------------------------------------------------------------------------

    def create_handle(self, size: int) -> int:
        """Commits ``size`` bytes (a multiple of the granularity); returns the handle (> 0).
        :class:`VmmOutOfMemory` beyond ``device_memory`` or the host capacity (see the
        module)."""
        check_size("create_handle", size, granularity=self._granularity)
        h = C.c_uint64()
        pool = self._live()
        with self._mem_lock:
            self._handle_account.check_room("create_handle", size)
            self._check("create_handle", self._lib.hv_create(pool, size, C.byref(h)),
                        f"size={size}")
        return h.value

    def free_handle(self, handle: int) -> None:
        """Frees an unmapped handle; its memory goes back to the host at once."""
        self._check("free_handle", self._lib.hv_free(self._live(), handle), f"handle={handle:#x}")

    def handle_size(self, handle: int) -> int:
        size = C.c_uint64()
        self._check("handle_size", self._lib.hv_handle_info(self._live(), handle, C.byref(size), None))
        return size.value

    # ---- mappings -----------------------------------------------------------------------------

    def map(self, va: int, handle: int) -> None:
        self._check("map", self._lib.hv_map(self._live(), va, handle),
                    f"va={va:#x} handle={handle:#x}")

    def unmap(self, va: int) -> None:
        self._check("unmap", self._lib.hv_unmap(self._live(), va, None), f"va={va:#x}")

    def map_batch(self, vas: Sequence[int], handles: Sequence[int]) -> None:
        """Maps ``handles[i]`` at ``vas[i]`` in one native call, all or nothing. The native
        side finds the runs contiguous in address and memfd offset (one ``mmap`` each, runs of
        one-granule handles checked and recorded in one pass), so nothing per page runs in
        Python; ``array('Q')`` arguments are passed as they are (no conversion), other
        sequences are converted once."""
        if len(vas) != len(handles):
            raise VmmInvalidArgument("map_batch", errno.EINVAL, "",
                                     f"{len(vas)} addresses but {len(handles)} handles")
        if not vas:
            return
        if self._closed:
            self._live()
        a, h = _u64s(vas), _u64s(handles)
        # the failing entry is named in the native message; no out-parameter is needed
        rc = self._lib.hv_map_batch(self._pool, a.buffer_info()[0], h.buffer_info()[0],
                                    len(a), None)
        if rc:
            self._check("map_batch", rc)

    def unmap_batch(self, vas: Sequence[int]) -> None:
        """Unmaps every mapping starting at ``vas[i]`` in one native call, all or nothing
        (``vas`` as for :meth:`map_batch`)."""
        if not vas:
            return
        if self._closed:
            self._live()
        a = _u64s(vas)
        rc = self._lib.hv_unmap_batch(self._pool, a.buffer_info()[0], len(a), None)
        if rc:
            self._check("unmap_batch", rc)

    def prepare_runs(self, vas: Sequence[int], handles: Sequence[int],
                     sizes: Sequence[int] | int | None = None) -> "RunBatch":
        """The run records of mapping ``handles[i]`` (``sizes[i]`` bytes; default one
        granule each) at ``vas[i]``, prepared once for :meth:`map_runs` / :meth:`unmap_runs`
        (see :class:`RunBatch`)."""
        maps, unmaps = runs_of(vas, handles, self._granularity if sizes is None else sizes)
        batch = RunBatch(maps, unmaps)
        batch._call.pool = self._live()
        batch._pool = self._pool
        self._prepared.add(batch)
        return batch

    def map_runs(self, runs: "RunBatch | array.array | Sequence[int]") -> None:
        """Maps run records in one native call, all or nothing: a :class:`RunBatch`, or a flat
        ``array('Q')`` (or sequence) of ``(va, handle, nbytes)`` triples, each run the handles
        that tile ``[handle, handle + nbytes)`` of the memfd (contiguous handles) mapped at
        ``va`` onward with one ``mmap``. Each handle stays its own mapping (unmap it alone
        later, or with :meth:`unmap_batch`). A prepared batch costs no per-page work in Python
        and no argument conversion."""
        if runs.__class__ is RunBatch and runs._pool == self._pool:
            rc = self._map_prepared(runs._ptr)  # a closed driver's blocks answer EBADF
        else:
            a = runs.maps if isinstance(runs, RunBatch) else _u64s(runs)
            n, rest = divmod(len(a), 3)
            if rest:
                raise VmmInvalidArgument("map_runs", errno.EINVAL, "",
                                         f"{len(a)} values are not (va, handle, nbytes) triples")
            rc = self._lib.hv_map_runs(self._live(), a.buffer_info()[0], n, None) if n else 0
        if rc:
            self._live()  # a closed driver says so
            self._check("map_runs", rc)

    def unmap_runs(self, runs: "RunBatch | array.array | Sequence[int]") -> None:
        """Unmaps run records in one native call, all or nothing: a :class:`RunBatch`, or a
        flat ``array('Q')`` (or sequence) of ``(va, nbytes)`` pairs, each range tiled exactly
        by mappings (any handles, mapped any way), unmapped with one system call per run."""
        if runs.__class__ is RunBatch and runs._pool == self._pool:
            rc = self._unmap_prepared(runs._ptr)
        else:
            a = runs.unmaps if isinstance(runs, RunBatch) else _u64s(runs)
            n, rest = divmod(len(a), 2)
            if rest:
                raise VmmInvalidArgument("unmap_runs", errno.EINVAL, "",
                                         f"{len(a)} values are not (va, nbytes) pairs")
            rc = self._lib.hv_unmap_runs(self._live(), a.buffer_info()[0], n, None) if n else 0
        if rc:
            self._live()  # a closed driver says so
            self._check("unmap_runs", rc)

    def is_mapped(self, va: int, nbytes: int) -> bool:
        """True when every byte of ``[va, va+nbytes)`` lies in mapped pages of this driver."""
        return self._lib.hv_check_mapped(self._live(), va, nbytes) == 0

    # ---- copies -------------------------------------------------------------------------------

    @staticmethod
    def _sides(kind: CopyKind) -> tuple[int, int]:
        kind = CopyKind(kind)
        return int(kind in (CopyKind.H2D, CopyKind.D2D)), int(kind in (CopyKind.D2H, CopyKind.D2D))

    def _copy_arrays(self, dsts, srcs, sizes, kind: CopyKind):
        if not (len(dsts) == len(srcs) == len(sizes)):
            raise VmmInvalidArgument("copy_batch", errno.EINVAL, "",
                                     f"{len(dsts)} destinations, {len(srcs)} sources, {len(sizes)} sizes")
        return _u64s(dsts), _u64s(srcs), _u64s(sizes), self._sides(kind)

    def _run_copy(self, d: array.array, s: array.array, n: array.array, sides) -> None:
        failed = C.c_uint64()
        self._check("copy_batch", self._lib.hv_copy_batch_checked(
            self._live(), _addr(d), _addr(s), _addr(n), len(d), sides[0], sides[1], C.byref(failed)))

    def copy_batch(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                   kind: CopyKind) -> None:
        """Gathers/scatters ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` in one native
        call (no GIL held while copying). Every device-side range is checked first; nothing is
        copied if one is not mapped."""
        d, s, n, sides = self._copy_arrays(dsts, srcs, sizes, kind)
        if len(d):
            self._run_copy(d, s, n, sides)

    def copy_batch_async(self, dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int],
                         kind: CopyKind) -> Transfer:
        """Like :meth:`copy_batch` on the driver's copy thread; transfers run in order. The
        ranges must stay mapped (and host buffers alive) until the transfer is done."""
        d, s, n, sides = self._copy_arrays(dsts, srcs, sizes, kind)
        self._live()
        return self._worker.submit(lambda: self._run_copy(d, s, n, sides))

    def synchronize(self) -> None:
        """Waits for every asynchronous transfer submitted so far."""
        self._worker.drain()

    # ---- host buffers -------------------------------------------------------------------------

    def alloc_host(self, size: int) -> int:
        """Allocates a page-aligned host buffer of ``size`` bytes (the host "pinned" buffer),
        committed at once; :class:`VmmOutOfMemory` beyond the host capacity (see the module)."""
        check_size("alloc_host", size)
        ptr = C.c_uint64()
        with self._buf_lock:
            self._buffer_account.check_room("alloc_host", size)
            self._check("alloc_host", self._lib.hv_host_alloc(size, C.byref(ptr)), f"size={size}")
            with self._hb_lock:
                self._host_buffers[ptr.value] = size
                self._hb_bytes += size
        return ptr.value

    def free_host(self, ptr: int) -> None:
        with self._buf_lock, self._hb_lock:
            size = self._host_buffers.pop(ptr, None)
            if size is None:
                raise VmmInvalidArgument("free_host", errno.EINVAL, "",
                                         f"{ptr:#x} is not a host buffer of this driver")
            self._hb_bytes -= size
            self._check("free_host", self._lib.hv_host_free(ptr, size))

    # ---- lifetime -----------------------------------------------------------------------------

    @property
    def memfd(self) -> int:
        """The pool's memfd (for diagnostics and the raw benchmark baseline)."""
        return self._lib.hv_pool_fd(self._live())

    def close(self) -> None:
        """Waits for transfers, then unmaps and releases everything and closes the memfd.
        Idempotent. Tensor views over the arena must be dropped first."""
        if not self._begin_close():
            return
        # memory freed and the driver leaves the ledgers in one step (buffer lock first, as
        # everywhere)
        with self._buf_lock, self._mem_lock:
            with self._hb_lock:
                buffers, self._host_buffers = self._host_buffers, {}
                self._hb_bytes = 0
            for ptr, size in buffers.items():
                self._lib.hv_host_free(ptr, size)
            self._closed = True
            self._finalizer()
            for acc in {self._handle_account, self._buffer_account}:
                acc.ledger.accounts.discard(acc)

    def __repr__(self) -> str:
        mem = f", device_memory={self.device_memory}" if self.device_memory else ""
        pop = ", populate=True" if self._populate else ""
        mem += f", hugepages={self.hugepages!r}" if self.hugepages != "off" else ""
        return f"HostDriver(device_index={self.device_index}{mem}{pop}{', closed' if self._closed else ''})"
