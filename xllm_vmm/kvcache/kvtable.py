"""The native block state of one cache group: :class:`NativeBlockState`, the
:class:`~xllm_vmm.kvcache.block_state.BlockState` over flat arrays whose allocation and free
passes are C (``native/kvtable.c``, ``libxllm_kvtable.so``, loaded through
:func:`xllm_vmm.vmm.native.optional_library`).

What :class:`~xllm_vmm.kvcache.allocator.BlockAllocator` keeps per group when the library is
built: the same state as the pure-Python :class:`~xllm_vmm.kvcache.pytable.PyBlockState`
(reference counts, cached / retained flags, per-slot free stacks, the buckets of partial
slots, the heap of inactive slots, the counters), held once, in arrays this object allocates;
the C passes write them through the pointers of a :class:`_Table`, and Python reads them
directly. ``stacks``, ``buckets`` and ``inactive`` are read-only views built from the arrays
(lists of lists / dicts / a list, for introspection, compaction's planning and the invariant
checks); every change goes through the methods below. One call per allocation and one per
free of a request's blocks: a ctypes call costs ~0.3-0.5 µs, so a verb's whole block work is
one call. ``kvt_free`` validates as it goes and undoes its own pass on a refused entry, so a
refused free changes nothing; the refusal is then worded as the Python passes word it
(:mod:`xllm_vmm.kvcache.block_state`).

Layout (``B`` = blocks per slot): ``slen[s]`` = free blocks of slot ``s`` (-1: inactive); its
free stack is ``stk[s·B : s·B + slen[s]]`` (top last); bucket ``k`` (1 ≤ k < B) is a doubly
linked list ``bhead[k] → bnext[…]`` of the active slots with ``k`` free blocks, oldest entry
first (the insertion order of the Python dicts); ``heap[:ctr[3]]`` is a min-heap of the
inactive slots; ``ctr`` = [free blocks in active slots, cached blocks, active slots, heap size,
and three outputs of the last free]. ``pinned[b]`` is 1 while ``pins`` (the transfer pin
counts, a dict as in the Python state) holds ``b``: the C free reads the flag.

``XLLM_VMM_KVTABLE=python`` selects the pure-Python passes even when the library is built
(the tests run both); :func:`native_available` says whether it is.
"""

from __future__ import annotations

import ctypes as C
import operator
import os
from array import array
from typing import Any, Sequence

from xllm_vmm.kvcache.block_state import (
    BlockStateBase,
    GroupShape,
    SlotBacking,
    check_free,
    double_free,
    first_refused,
    not_a_block,
)

__all__ = ["LIB_NAME", "MAX_BLOCKS", "NativeBlockState", "native_available", "native_requested"]

LIB_NAME = "libxllm_kvtable.so"
#: the most blocks a native group holds (block ids are int32 in C)
MAX_BLOCKS = (1 << 31) - 1

_I32 = C.c_int32
_VP = C.c_void_p

# hot functions are declared without argtypes (ints and the prebuilt table pointer convert
# on their own; declared argtypes cost ~0.4 µs more per call here)
_PROTOTYPES: dict[str, tuple[Any, Any]] = {
    "kvt_alloc1": (None, _I32),
    "kvt_alloc": (None, _I32),
    "kvt_take": (None, _I32),
    "kvt_free": (None, _I32),
    "kvt_push_free": (None, _I32),
    "kvt_pop_inactive": (None, _I32),
    "kvt_push_inactive": (None, None),
    "kvt_drop_top": (None, None),
    "kvt_release_slot": (None, None),
}

_FA, _NC, _NA, _HEAPN, _NREL, _NPIN, _ERRKIND = range(7)


class _Table(C.Structure):
    """``kvt`` of native/kvtable.c: the sizes and the addresses of the group's arrays."""

    _fields_ = [("nslots", _I32), ("bps", _I32), ("nblocks", _I32), ("in_cap", _I32),
                ("ref", _VP), ("cached", _VP), ("keep", _VP), ("pinned", _VP),
                ("stk", _VP), ("slen", _VP), ("bnext", _VP), ("bprev", _VP),
                ("bhead", _VP), ("btail", _VP), ("heap", _VP), ("ctr", _VP),
                ("out", _VP), ("out2", _VP), ("out3", _VP), ("inp", _VP), ("runs", _VP)]


_lib: Any = False  # not looked up yet


def _library() -> Any:
    global _lib
    if _lib is False:
        from xllm_vmm.vmm.native import optional_library

        # the calls hold the GIL: they are short, and Python reads the same arrays
        _lib = optional_library(LIB_NAME, _PROTOTYPES, keep_gil=True)
    return _lib


def native_available() -> bool:
    """True when ``libxllm_kvtable.so`` is built and loads."""
    return _library() is not None


def native_requested() -> bool:
    """Whether new allocators use the C passes: the library loads and ``XLLM_VMM_KVTABLE``
    is not ``python``."""
    mode = os.environ.get("XLLM_VMM_KVTABLE", "").strip().lower()
    if mode in ("", "native", "auto"):
        return native_available()
    if mode == "python":
        return False
    raise ValueError(f"XLLM_VMM_KVTABLE={mode!r}: use 'python' (pure-Python block tables) or "
                     "'native' (the C passes of libxllm_kvtable.so, the default when built)")


def _addr(buf: Any) -> int:
    if len(buf) == 0:
        return 0
    if isinstance(buf, array):
        return buf.buffer_info()[0]
    return C.addressof((C.c_char * len(buf)).from_buffer(buf))


def _i32(n: int, fill: int = 0) -> array:
    a = array("i", [fill]) * n if n else array("i")
    return a


class NativeBlockState(BlockStateBase):
    """Mutable state of one group over flat arrays, changed by the C passes (see the module
    docstring). Attribute names match :class:`~xllm_vmm.kvcache.pytable.PyBlockState` where
    they mean the same."""

    native = True

    def __init__(self, shape: GroupShape, backing: SlotBacking) -> None:
        name, num_slots, bps = shape.name, shape.num_slots, shape.blocks_per_slot
        lib = _library()
        if lib is None:
            raise RuntimeError(f"{LIB_NAME} is not built: rebuild with `pip install -e .` (or "
                               "`python setup.py build_ext --inplace`) or set "
                               "XLLM_VMM_KVTABLE=python")
        n = num_slots * bps
        if n > MAX_BLOCKS:
            raise ValueError(f"group {name!r}: {n} blocks exceed the native block tables' "
                             f"int32 ids (at most {MAX_BLOCKS}); use XLLM_VMM_KVTABLE=python")
        self.name = name
        self.num_slots = num_slots
        self.bps = bps
        self.nblocks = n
        self.backing = backing
        self.ref = _i32(n)
        self.cached = bytearray(n)
        self.keep = bytearray(n)
        self.pinned = bytearray(n)  # 1 while pins holds the block (read by the C free)
        self.retains = False
        self.pins: dict[int, int] = {}
        self.stk = _i32(n)
        self.slen = _i32(num_slots, -1)
        self.bnext = _i32(num_slots, -1)
        self.bprev = _i32(num_slots, -1)
        self.bhead = _i32(bps, -1)
        self.btail = _i32(bps, -1)
        self.heap = array("i", range(num_slots))  # sorted: a valid min-heap
        self.ctr = array("q", [0] * 8)
        self.ctr[_HEAPN] = num_slots
        self.out = _i32(max(n, 1))
        self.out2 = _i32(max(num_slots, 1))
        self.out3 = _i32(max(n, 1))
        self._out = memoryview(self.out)
        self._out2 = memoryview(self.out2)
        self._out3 = memoryview(self.out3)
        self.table = _Table()
        self._set_input(max(64, min(2 * n, 4096)))  # grown by free() when a list is longer
        t = self.table
        t.nslots, t.bps, t.nblocks = num_slots, bps, n
        for f in ("ref", "cached", "keep", "pinned", "stk", "slen", "bnext", "bprev", "bhead",
                  "btail", "heap", "ctr", "out", "out2", "out3"):
            setattr(t, f, _addr(getattr(self, f)))
        # exported buffers: none of the arrays can be resized while the table points at them
        self._exports = [memoryview(getattr(self, f)) for f in (
            "ref", "cached", "keep", "pinned", "stk", "slen", "bnext", "bprev", "bhead",
            "btail", "heap", "ctr")]
        self.p = C.pointer(t)
        self._alloc1 = lib.kvt_alloc1
        self._alloc = lib.kvt_alloc
        self._take = lib.kvt_take
        self._free = lib.kvt_free
        self._push_free = lib.kvt_push_free
        self._pop_inactive = lib.kvt_pop_inactive
        self._push_inactive = lib.kvt_push_inactive
        self._drop_top = lib.kvt_drop_top
        self._release_slot = lib.kvt_release_slot

    def _set_input(self, cap: int) -> None:
        """The free's input buffer (int64 block ids) and its run scratch, ``cap`` entries."""
        self.inp = (C.c_int64 * cap)()
        self.runs = _i32(3 * cap)
        self.table.in_cap = self._in_cap = cap
        self.table.inp = C.addressof(self.inp)
        self.table.runs = _addr(self.runs)

    # -- counters and derived views (read only) --------------------------------------------
    @property
    def free_active(self) -> int:
        return self.ctr[_FA]

    @property
    def n_cached(self) -> int:
        return self.ctr[_NC]

    @n_cached.setter
    def n_cached(self, value: int) -> None:
        self.ctr[_NC] = value

    @property
    def n_active(self) -> int:
        return self.ctr[_NA]

    @property
    def n_inactive(self) -> int:
        return self.ctr[_HEAPN]

    @property
    def n_live(self) -> int:
        return self.ctr[_NA] * self.bps - self.ctr[_FA] - self.ctr[_NC]

    def stack_len(self, slot: int) -> int:
        """Free blocks of ``slot``; -1 while it is inactive."""
        return self.slen[slot]

    def used(self, slot: int) -> int:
        k = self.slen[slot]
        return 0 if k < 0 else self.bps - k

    def ncached_of(self, slot: int) -> int:
        bps = self.bps
        return self.cached[slot * bps:(slot + 1) * bps].count(1)

    @property
    def ncached(self) -> list[int]:
        return [self.ncached_of(s) for s in range(self.num_slots)]

    @property
    def stacks(self) -> list[list[int] | None]:
        """Each slot's free stack (bottom first), ``None`` while inactive (a copy)."""
        bps, stk = self.bps, self.stk
        return [None if k < 0 else stk[s * bps:s * bps + k].tolist()
                for s, k in enumerate(self.slen)]

    @property
    def buckets(self) -> list[dict[int, None]]:
        """``buckets[k]``: the active slots with ``k`` free blocks, oldest entry first (a
        copy; the walk stops after ``num_slots`` steps, so a broken list cannot hang it)."""
        out: list[dict[int, None]] = [{}]
        nxt = self.bnext
        for k in range(1, self.bps):
            d: dict[int, None] = {}
            s = self.bhead[k]
            steps = 0
            while s >= 0 and steps <= self.num_slots:
                d[s] = None
                s = nxt[s]
                steps += 1
            out.append(d)
        return out

    @property
    def rbuckets(self) -> list[dict[int, None]]:
        return self.buckets[::-1]

    @property
    def inactive(self) -> list[int]:
        """The inactive slots (heap order; a copy)."""
        return self.heap[:self.ctr[_HEAPN]].tolist()

    def check(self) -> None:
        """The bucket lists are consistent and the pinned flags agree with the pin counts
        (``AssertionError`` otherwise)."""
        seen: set[int] = set()
        for k in range(1, self.bps):
            prev = -1
            s = self.bhead[k]
            while s >= 0:
                assert s not in seen, f"{self.name}: slot {s} twice in the bucket lists"
                seen.add(s)
                assert self.bprev[s] == prev, f"{self.name}: bucket {k} back link of {s}"
                assert self.slen[s] == k, f"{self.name}: slot {s} in bucket {k}"
                prev = s
                s = self.bnext[s]
            assert self.btail[k] == prev, f"{self.name}: bucket {k} tail"
        for b in range(self.nblocks):
            assert bool(self.pinned[b]) == (b in self.pins), \
                f"{self.name}: pinned flag of block {b} disagrees with the pin counts"

    # -- one-group verbs -------------------------------------------------------------------
    def allocate(self, n: int, hint: int = -1) -> list[int] | None:
        if n == 1:  # decode growth: one call
            try:
                b = self._alloc1(self.p, hint)
            except C.ArgumentError:  # a hint that is no Python int32: converted below
                b = -1
            if b >= 0:
                return [b]
        if type(n) is not int:
            n = operator.index(n)
        if n < 0:
            raise ValueError(f"negative block count {n} for group {self.name!r}")
        if n > self.nblocks:
            return None
        if type(hint) is not int:
            try:
                hint = operator.index(hint)
            except TypeError:
                raise TypeError(f"allocate_group({self.name!r}): the hint must be a block id "
                                f"(an int) or -1, got {hint!r}") from None
        if not 0 <= hint < self.nblocks:  # a hint outside the group is no hint
            hint = -1
        r = self._alloc(self.p, n, hint)  # n blocks, or -(slots needed) - 1
        if r >= 0:
            return self._out[:r].tolist()
        chosen = self.pop_inactive(-r - 1)
        if chosen is None:
            return None
        return self._activate_and_take(n, hint, chosen)

    def free_lru(self, blocks: Sequence[int], lru: dict[int, None]) -> list[int] | None:
        try:
            r, bad = self._c_free(blocks, 1, True)
        except (TypeError, OverflowError):  # an entry that is no int64
            r, bad = -1, -1
        if r < 0:
            self._refuse(blocks[::-1], bad, False)
        if r:
            # appended one by one from the output buffer: no list and no dict of them
            # (dict.update(dict.fromkeys(...)) of a few blocks costs ~2x more, measured)
            for b in self._out[:r]:
                lru[b] = None
        if self.ctr[_NREL]:
            self.backing.deactivate({self.name: self.released()})
        return self.pinned_out()

    def release(self, blocks: Sequence[int]) -> tuple[list[int] | None, list[int]]:
        """The C free pass (kvt_free) of ``blocks``: (blocks that became cached or ``None``,
        slots emptied); a refused entry raises ``ValueError`` and nothing changed."""
        try:
            r, bad = self._c_free(blocks, 0)
        except (TypeError, OverflowError):  # an entry that is no int64: find the first refusal
            r, bad = -1, -1
        if r < 0:
            self._refuse(blocks, bad, True)
        return (self._out[:r].tolist() if r else None), (self.released() if self.ctr[_NREL]
                                                         else [])

    def _refuse(self, blocks: Sequence[int], bad: int, check: bool) -> None:
        """Raise the ``ValueError`` of a refused free (nothing changed): entry ``bad`` (-1: the
        first refusal, :func:`~xllm_vmm.kvcache.block_state.first_refused`), worded as the
        Python passes word it (``check``: :meth:`free`'s, else :meth:`free_lru`'s)."""
        items = list(blocks)
        if bad < 0:
            bad = first_refused(self, items)
        b = items[bad]
        if not isinstance(b, int) or not 0 <= b < self.nblocks:
            raise not_a_block(self, b) from None
        if check:
            check_free(self, items)
        raise double_free(self, b) from None

    # -- the C passes ----------------------------------------------------------------------
    def pop_inactive(self, k: int) -> list[int] | None:
        """The ``k`` lowest inactive slots (taken off the heap), or ``None`` when fewer."""
        if self._pop_inactive(self.p, k) < 0:
            return None
        return self._out2[:k].tolist()

    def push_inactive(self, slots: list[int]) -> None:
        """Give back slots :meth:`pop_inactive` took (their activation was refused)."""
        self._out2[:len(slots)] = array("i", slots)
        self._push_inactive(self.p, len(slots))

    def take(self, n: int, hint: int, new_slots: list[int]) -> list[int]:
        """``n`` blocks: the hint's slot, partial slots, then ``new_slots`` (just activated)."""
        if n == 0:
            return []
        if not 0 <= hint < self.nblocks:
            hint = -1
        self._out2[:len(new_slots)] = array("i", new_slots)
        r = self._take(self.p, n, hint, len(new_slots))
        return self._out[:r].tolist()

    def _c_free(self, blocks: Any, lru: int, reverse: bool = False) -> tuple[int, int]:
        """The C free of ``blocks`` (see kvt_free), or of ``blocks[::-1]`` with ``reverse``
        (written into the input buffer backwards: no reversed copy): returns (count in
        ``out``, -1) or, refused (nothing changed), (-1, index of the refused entry in the
        order freed). Raises ``TypeError`` / ``OverflowError`` for an entry that is not an
        int64 (nothing changed)."""
        n = len(blocks)
        if n > self._in_cap:
            self._set_input(2 * n)
        if reverse and n:
            self.inp[n - 1::-1] = blocks
        else:
            self.inp[:n] = blocks
        r = self._free(self.p, n, lru)
        if r >= 0:
            return r, -1
        return -1, -r - 1

    def released(self) -> list[int]:
        return self._out2[:self.ctr[_NREL]].tolist()

    def pinned_out(self) -> list[int] | None:
        np_ = self.ctr[_NPIN]
        return self._out3[:np_].tolist() if np_ else None

    @property
    def err_kind(self) -> int:
        """Why the last free was refused: 1 not a block of the group, 2 no reference left."""
        return self.ctr[_ERRKIND]

    def push_free(self, block: int) -> bool:
        """Block ``block`` (ref 0, not cached) onto its slot's stack; ``True`` when the slot
        emptied (now inactive: the caller releases it)."""
        return bool(self._push_free(self.p, block))

    def drop_top(self, slot: int, take: int) -> None:
        self._drop_top(self.p, slot, take)

    def release_slot(self, slot: int) -> None:
        self._release_slot(self.p, slot)

    def _flag_pinned(self, block: int, pinned: int) -> None:
        self.pinned[block] = pinned  # read by the C free
