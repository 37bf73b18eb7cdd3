"""Page-aware block allocation over slots: the one owner of block state (reference counts,
cached / retained flags, transfer pins), with compaction.

Terms (per cache group): a *slot* is one page offset across every tensor of the group; slot
``s`` holds blocks ``[s × B, (s + 1) × B)`` where ``B`` is the group's blocks per slot (a block
never straddles a page). Block ids are dense per group: ``0 … num_slots × B − 1``. A slot is
*active* while it holds at least one live or cached block; only active slots have memory
under them (the :class:`SlotBacking` maps a slot when it becomes active and releases it the
moment it empties — EL-01).

Block states (every block is in exactly one):

- *free* — no memory claim; in its slot's free stack (or its slot is inactive);
- *live* — ``ref ≥ 1`` (requests, held prefix hits);
- *cached* — ``ref == 0`` but kept: it is *retained* (it holds a published prefix; the prefix
  cache set the flag with :meth:`BlockAllocator.retain`) or *pinned* (a transfer reads or
  writes it, :meth:`BlockAllocator.pin`). A cached block that is neither any more is freed at
  once (:meth:`BlockAllocator.unretain`, :meth:`BlockAllocator.unpin`).

The allocator never calls up: it does not evict. When memory is short, :meth:`allocate` answers
``None`` and changes nothing; the caller (the :class:`~xllm_vmm.kvcache.manager.KVCacheManager`)
asks the prefix cache to give up cached blocks (:meth:`release_cached`) and tries again.

Allocation is page-aware: a new block comes from the *fullest* partially used active slot
(fewest free blocks; among equals, the one that entered that state first), then from newly
activated slots (lowest slot id first); inside a slot the lowest free block id comes first for
a fresh slot, and the most recently freed block is reused first after that. Decode growth, one
block at a time for many sequences, therefore packs into few slots instead of scattering.
A ``near`` hint (the sequence's last block) puts a sequence's blocks in its own slot first;
when that slot is full, one-block decode growth goes to the *roomiest* partial slot instead
(most free blocks; among equals, the one that entered that state first), so that the
sequence's next blocks follow it there rather than each landing in a different one-block hole.
One-block holes are still filled first by allocations without a hint (a new prompt), and a
prompt that needs new slots takes every free block of the active slots first, so live blocks
stay packed.

Bookkeeping (O(1) amortised per block, no per-block objects): every active slot has a free
*stack* (a list of its free block ids, top = next one handed out); ``buckets[k]`` is an
insertion-ordered set of the active slots with exactly ``k`` free blocks (``1 ≤ k < B``), so
"fullest partial slot" is the first slot of the first non-empty bucket (at most ``B − 1``
probes; the roomiest is the first slot of the last non-empty one). A call moves a slot between
buckets once per run of blocks it takes from or returns to that slot, not once per block.
Occupancy and the live count are derived (``B − len(stack)``, ``active × B − free − cached``),
not stored. A fresh slot's stack is one slice of a per-group list of every block id, highest
first. :meth:`BlockAllocator.free` checks its input first (a refused free changes nothing), then
makes one pass: drop the reference; at 0 a retained or pinned block becomes cached, any other is
pushed on its slot's stack; then one bucket move per run of one slot.

Two implementations of the same passes: with ``libxllm_kvtable.so`` built (the default), a
group's state lives in flat arrays (:class:`~xllm_vmm.kvcache.kvtable.NativeGroup`) and
allocation and free are one C call each (compaction's stack moves and a slot push too);
without it, or with ``XLLM_VMM_KVTABLE=python`` / ``BlockAllocator(native=False)``, the
pure-Python ``_Group`` below (lists, ordered dicts, a heap). Both hand out the same block ids in
the same order, make the same slot choices and refuse the same frees with the same messages
(``tests/kvcache/test_kvtable.py`` runs them in lockstep; every other kvcache test runs on
both). Readers outside this module see only the per-block arrays (``ref``, ``cached``,
``keep``) and the counters, which mean the same in both.

Invariants (:meth:`BlockAllocator.check_invariants`, run by the tests after every step):

- every block is free, live or cached; a cached block is retained or pinned;
- every live or cached block lies in an active slot; every active slot holds ≥ 1 of them;
- all groups of one :meth:`BlockAllocator.allocate` call succeed or none do (SD-01: target and
  draft are allocated and released together); a refused call changes nothing;
- a pinned block is never released by :meth:`release_cached` nor moved by :meth:`compact`.

Compaction
----------

Placement is decided before lifetimes are known: a long-running sequence's decode blocks land
in slots shared with short sequences, and when those finish their slots stay mapped for one or
two blocks. :meth:`BlockAllocator.compact` undoes that when the caller chooses (idle or lightly
loaded, between engine steps): it moves every live and cached block out of the sparsest slots
into free blocks of the densest ones and releases the emptied slots at once. It never activates
a slot (the budget cannot be exceeded), never moves a pinned block or one the caller excludes,
and returns the old → new mapping per group: the caller (the manager) rewrites its block tables
and the prefix cache's index with it. The data is copied by the backing's ``move(moves) ->
bool`` (the virtual KV cache: one batched device-to-device copy across every tensor of the
group); ``False`` (a copy failed) changes nothing.
"""

from __future__ import annotations

import ctypes as C
import heapq
import operator
from collections import Counter
from dataclasses import dataclass, field
from heapq import heappop, heappush
from itertools import islice
from typing import Any, Iterable, Mapping, Protocol, Sequence

from xllm_vmm.kvcache.kvtable import MAX_BLOCKS, NativeGroup, native_available, native_requested

__all__ = [
    "BlockAllocator",
    "BlockInfo",
    "Compaction",
    "GroupShape",
    "SlotBacking",
    "SlotInfo",
]


class SlotBacking(Protocol):
    """Puts memory under slots. ``activate`` is all-or-nothing over every group it is given
    (one batched map) and returns ``False`` for "not now"; ``deactivate`` releases at once.
    Optional, for :meth:`BlockAllocator.compact`: ``move(moves) -> bool`` copies the contents
    of every ``(old, new)`` block pair per group (all or nothing; ``False`` = nothing moved).
    One object of this shape per worker set (a fan-out to several workers)."""

    def activate(self, slots: Mapping[str, Sequence[int]]) -> bool: ...

    def deactivate(self, slots: Mapping[str, Sequence[int]]) -> None: ...


@dataclass(frozen=True)
class GroupShape:
    """A group as the allocator sees it: ``num_slots`` slots of ``blocks_per_slot`` blocks."""

    name: str
    num_slots: int
    blocks_per_slot: int

    @property
    def num_blocks(self) -> int:
        return self.num_slots * self.blocks_per_slot


@dataclass(frozen=True)
class BlockInfo:
    group: str
    block: int
    slot: int
    ref_count: int
    cached: bool
    retained: bool = False
    pins: int = 0


@dataclass(frozen=True)
class SlotInfo:
    group: str
    slot: int
    active: bool
    live: int  # blocks with ref >= 1
    cached: int  # blocks with ref 0 kept (retained or pinned)
    free: int  # free blocks (0 for an inactive slot: it has no memory)


@dataclass(frozen=True)
class Compaction:
    """What one compaction did. ``moves[g]``: old block → new block in group ``g`` (rewrite
    block tables with it); ``released_slots[g]``: slots emptied and released; bytes are filled
    in by :meth:`VirtualKVCache.compact` (every tensor of the group: ``bytes_copied`` moved by
    device-to-device copies, ``bytes_released`` unmapped). ``error``: why nothing moved (a
    failed copy), else empty."""

    moves: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    released_slots: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    bytes_copied: int = 0
    bytes_released: int = 0
    error: str = ""

    @property
    def blocks_moved(self) -> int:
        return sum(len(m) for m in self.moves.values())

    @property
    def slots_released(self) -> int:
        return sum(len(s) for s in self.released_slots.values())


_NO_SLOTS: Mapping[str, list[int]] = {}  # no new slots (never written)
_NOTHING_CACHED: Mapping[str, list[int]] = {}  # free() kept no block (never written)


def _check_shape(shape: GroupShape) -> None:
    if shape.num_slots < 0 or shape.blocks_per_slot < 1:
        raise ValueError(f"group {shape.name!r}: needs num_slots >= 0 and "
                         f"blocks_per_slot >= 1, got {shape}")


class _Group:
    """Mutable state of one group (internal). ``stacks[s]`` is slot ``s``'s free stack, or
    ``None`` while the slot is inactive."""

    __slots__ = ("name", "num_slots", "bps", "nblocks", "ref", "cached", "keep", "retains",
                 "pins", "stacks", "buckets", "rbuckets", "inactive", "free_active",
                 "n_cached", "n_active", "desc", "asc")

    native = False  # the pure-Python passes (NativeGroup: the C ones)

    def __init__(self, shape: GroupShape) -> None:
        _check_shape(shape)
        self.name = shape.name
        self.num_slots = shape.num_slots
        self.bps = shape.blocks_per_slot
        n = shape.num_blocks
        self.nblocks = n
        self.ref = [0] * n
        self.cached = bytearray(n)  # ref 0 and kept
        self.keep = bytearray(n)  # retained: kept at ref 0 (holds a published prefix)
        # False until a block of the group may be retained (BlockAllocator.will_retain /
        # retain): while False every keep flag is 0 and a free skips reading them
        self.retains = False
        self.pins: dict[int, int] = {}  # block -> transfer pins (few at a time)
        # every block id, highest first: a fresh slot's free stack is one slice of it
        self.desc = list(range(n - 1, -1, -1))
        self.asc = self.desc[::-1]  # lowest first (the same int objects)
        self.stacks: list[list[int] | None] = [None] * shape.num_slots
        # buckets[k]: active slots with exactly k free blocks, 1 <= k < bps (ordered sets)
        self.buckets: list[dict[int, None]] = [{} for _ in range(self.bps)]
        self.rbuckets = self.buckets[::-1]  # the same dicts, emptiest slots first
        self.inactive = list(range(shape.num_slots))  # a heap (sorted list is a valid heap)
        self.free_active = 0
        self.n_cached = 0
        self.n_active = 0

    @property
    def n_live(self) -> int:
        return self.n_active * self.bps - self.free_active - self.n_cached

    def ncached_of(self, slot: int) -> int:
        """Cached blocks of ``slot``, counted from the flags (not kept per slot: the hot paths
        that cache and revive blocks do not pay for a count only introspection, eviction's
        slot scan and compaction read)."""
        bps = self.bps
        return self.cached[slot * bps:(slot + 1) * bps].count(1)

    @property
    def ncached(self) -> list[int]:
        """Cached blocks per slot (derived, see :meth:`ncached_of`)."""
        return [self.ncached_of(s) for s in range(self.num_slots)]

    def used(self, slot: int) -> int:
        """Live + cached blocks of ``slot``."""
        stack = self.stacks[slot]
        return 0 if stack is None else self.bps - len(stack)

    def stack_len(self, slot: int) -> int:
        """Free blocks of ``slot``; -1 while it is inactive."""
        stack = self.stacks[slot]
        return -1 if stack is None else len(stack)

    @property
    def n_inactive(self) -> int:
        return len(self.inactive)


class BlockAllocator:
    """Reference-counted, page-aware block allocator over the slots of several groups; the one
    owner of block state (see the module docstring). ``backing`` maps and releases slots."""

    def __init__(self, shapes: Iterable[GroupShape], backing: SlotBacking,
                 native: bool | None = None) -> None:
        """``native``: keep the block state in flat arrays changed by the C passes of
        ``libxllm_kvtable.so`` (:mod:`~xllm_vmm.kvcache.kvtable`) — the same ids, order and
        refusals as the pure-Python passes (``False``). ``None`` (default): the C passes when
        the library is built, unless ``XLLM_VMM_KVTABLE=python``."""
        shapes = list(shapes)
        if native is None:  # the C passes when built and every group's ids fit in int32
            native = native_requested() and all(s.num_blocks <= MAX_BLOCKS for s in shapes)
        elif native and not native_available():
            raise RuntimeError("BlockAllocator(native=True): libxllm_kvtable.so is not built; "
                               "rebuild with `pip install -e .` (or `python setup.py "
                               "build_ext --inplace`), or pass native=False")
        self.native = bool(native)
        self._groups: dict[str, _Group] = {}
        for s in shapes:
            if s.name in self._groups:
                raise ValueError(f"duplicate group name {s.name!r}")
            _check_shape(s)
            self._groups[s.name] = (NativeGroup(s.name, s.num_slots,  # type: ignore[assignment]
                                                s.blocks_per_slot) if native else _Group(s))
        self.backing = backing

    # -- configuration / shape -----------------------------------------------------------
    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def shape(self, group: str) -> GroupShape:
        g = self._g(group)
        return GroupShape(g.name, g.num_slots, g.bps)

    def _g(self, group: str) -> _Group:
        try:
            return self._groups[group]
        except KeyError:
            raise KeyError(f"unknown cache group {group!r}; groups: "
                           f"{', '.join(self._groups)}") from None

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, counts: Mapping[str, int],
                 near: Mapping[str, int] | None = None) -> dict[str, list[int]] | None:
        """Allocate ``counts[group]`` blocks in every group, all or nothing.

        ``near`` (optional): per group, a block the caller already holds for the same sequence
        (its last one). Free blocks in that block's slot are taken first, so that one
        sequence's blocks stay together and a finished sequence empties whole slots; when that
        slot is full, a one-block request (decode growth) takes the roomiest partial slot,
        where the sequence's next blocks can follow it. A hint outside the group is no hint.

        Returns the new block ids per group (each with ref count 1), or ``None`` ("not now")
        when a group's virtual range or the backing's budget cannot take them; then nothing
        changed. Nothing is evicted here (see the module docstring)."""
        groups = self._groups
        if len(counts) == 1:  # most models: one group (and each group of several, below)
            for name, n in counts.items():
                pass
            got = self.allocate_group(name, n, near.get(name, -1) if near else -1)
            return None if got is None else {name: got}
        new_slots: Mapping[str, list[int]] = _NO_SLOTS
        for name, n in counts.items():
            g = groups.get(name) or self._g(name)
            if n > g.free_active:
                new_slots = None  # type: ignore[assignment]
            elif n < 0:
                raise ValueError(f"negative block count {n} for group {name!r}")
        if new_slots is None:  # new slots (a prompt): planned and activated in one call
            new_slots = self._activate_for(counts)  # type: ignore[assignment]
            if new_slots is None:
                return None
        out: dict[str, list[int]] = {}
        for name, n in counts.items():
            slots = new_slots.get(name)
            if slots is None:  # fits in its active slots: the one-group path
                out[name] = self.allocate_group(  # type: ignore[assignment]
                    name, n, near.get(name, -1) if near else -1)
            else:
                out[name] = self._take(groups[name], n, near.get(name, -1) if near else -1,
                                       slots)
        return out

    def allocate_group(self, group: str, n: int, hint: int = -1) -> list[int] | None:
        """:meth:`allocate` for one group without the dicts: ``n`` new blocks of ``group``
        (ref count 1 each) as a list, ``hint`` the ``near`` block (``-1``: none), or ``None``
        ("not now": nothing changed). The one allocation path: :meth:`allocate` calls it for
        every group that fits in its active slots (the manager's hot path calls it directly)."""
        g = self._groups.get(group) or self._g(group)
        if g.native:  # the C passes (kvtable): one call, two when new slots are mapped
            if n == 1:
                try:
                    b = g._alloc1(g.p, hint)  # type: ignore[attr-defined]
                except C.ArgumentError:  # a hint that is no Python int32: converted below
                    b = -1
                if b >= 0:
                    return [b]
            return self._allocate_native(g, n, hint)
        if n == 1 and g.free_active:
            # decode growth, the one place it is written: one block from an active
            # slot — the hint's slot, else (hinted slot full) the roomiest partial slot,
            # else (no hint) the fullest
            stacks = g.stacks
            buckets = g.buckets
            if 0 <= hint < g.nblocks:
                slot = hint // g.bps
                stack = stacks[slot]
                roomiest = True
            else:
                stack = roomiest = None
            if stack:
                bucket = buckets[len(stack)]
            else:
                for bucket in (g.rbuckets if roomiest else buckets):
                    if bucket:
                        break
                for slot in bucket:
                    break
                stack = stacks[slot]
            k = len(stack)  # type: ignore[arg-type]
            b = stack.pop()  # type: ignore[union-attr]
            g.ref[b] = 1
            del bucket[slot]
            if k > 1:
                buckets[k - 1][slot] = None
            g.free_active -= 1
            return [b]
        fa = g.free_active
        if n <= fa:  # _take without new slots: the hint's slot, then partial, fullest first
            if n < 0:
                raise ValueError(f"negative block count {n} for group {group!r}")
            out: list[int] = []
            if n:
                if 0 <= hint < g.nblocks:
                    n = self._take_near(g, hint, n, out)
                if n:
                    self._take_partial(g, n, out)
            return out
        # new slots (a prompt, or growth with every active slot full): the lowest inactive
        # ones, activated in one backing call
        k = -(-(n - fa) // g.bps)
        inactive = g.inactive
        if k > len(inactive):
            return None
        chosen = [heappop(inactive)] if k == 1 else [heappop(inactive) for _ in range(k)]
        if not self.backing.activate({group: chosen}):
            for s in chosen:
                heappush(inactive, s)
            return None
        out = []
        if fa:  # _take: the hint's slot, partial slots, then the new ones
            if 0 <= hint < g.nblocks:
                n = self._take_near(g, hint, n, out)
            if n:
                n = self._take_partial(g, n, out)
        for slot in chosen:
            n = self._take_new_slot(g, slot, n, out)
        return out

    def _allocate_native(self, g: NativeGroup, n: int, hint: int) -> list[int] | None:
        """:meth:`allocate_group` on the C passes (see there)."""
        if type(n) is not int:
            n = operator.index(n)
        if n < 0:
            raise ValueError(f"negative block count {n} for group {g.name!r}")
        if n > g.nblocks:
            return None
        if type(hint) is not int:
            try:
                hint = operator.index(hint)
            except TypeError:
                raise TypeError(f"allocate_group({g.name!r}): the hint must be a block id (an "
                                f"int) or -1, got {hint!r}") from None
        if not 0 <= hint < g.nblocks:  # a hint outside the group is no hint
            hint = -1
        r = g._alloc(g.p, n, hint)  # NativeGroup.alloc, inlined: n blocks, or -(slots) - 1
        if r >= 0:
            return g._out[:r].tolist()
        chosen = g.pop_inactive(-r - 1)
        if chosen is None:
            return None
        if not self.backing.activate({g.name: chosen}):
            g.push_inactive(chosen)
            return None
        return g.take(n, hint, chosen)

    def _take(self, g: _Group, n: int, hint: int, new: list[int] | None) -> list[int]:
        """Hand out ``n`` blocks of ``g`` (not the one-block growth of :meth:`allocate`): the
        hint's slot, then partial slots (fullest first), then the ``new`` slots (just
        activated: all full but the last, lowest ids first)."""
        out: list[int] = []
        if n == 0:
            return out
        if g.native:
            return g.take(n, hint if 0 <= hint < g.nblocks else -1, new or [])  # type: ignore
        if 0 <= hint < g.nblocks:
            n = self._take_near(g, hint, n, out)
        if n:
            n = self._take_partial(g, n, out)
        if new:
            for slot in new:
                n = self._take_new_slot(g, slot, n, out)
        assert n == 0, "allocator planned fewer blocks than it hands out"
        return out

    def _take_near(self, g: _Group, block: int, n: int, out: list[int]) -> int:
        """Take up to ``n`` free blocks from the slot of ``block``; returns what is left."""
        slot = block // g.bps
        stack = g.stacks[slot]
        if not stack:
            return n
        k = len(stack)
        take = k if n >= k else n
        got = stack[-take:]
        del stack[-take:]
        got.reverse()
        ref = g.ref
        for b in got:
            ref[b] = 1
        out.extend(got)
        del g.buckets[k][slot]
        if k - take:
            g.buckets[k - take][slot] = None
        g.free_active -= take
        return n - take

    def _take_partial(self, g: _Group, n: int, out: list[int]) -> int:
        """Take up to ``n`` blocks from active slots, fullest first (each slot's stack from
        its top); returns what is left. One pass up the buckets: a slot taken whole leaves
        them, so the next fullest is the next slot of the same bucket or of a later one; only
        the last slot can be taken in part (it moves to a lower bucket and the pass ends)."""
        buckets = g.buckets
        stacks = g.stacks
        ref = g.ref
        want = n
        k = -1
        for bucket in buckets:  # bucket 0 stays empty
            k += 1
            if not bucket:
                continue
            if k == 1:  # one free block per slot: the first n slots, in order
                if n >= len(bucket):
                    slots = list(bucket)
                    bucket.clear()
                else:
                    slots = list(islice(bucket, n))
                    for slot in slots:
                        del bucket[slot]
                for slot in slots:
                    b = stacks[slot].pop()  # type: ignore[union-attr]
                    ref[b] = 1
                    out.append(b)
                n -= len(slots)
                if not n:
                    break
                continue
            while bucket:
                for slot in bucket:
                    break
                stack = stacks[slot]
                take = k if n >= k else n
                got = stack[-take:]  # type: ignore[index]
                del stack[-take:]  # type: ignore[index]
                got.reverse()
                for b in got:
                    ref[b] = 1
                out.extend(got)
                del bucket[slot]
                n -= take
                if not n:
                    if take < k:
                        buckets[k - take][slot] = None
                    break
            if not n:
                break
        g.free_active -= want - n
        return n

    def _take_new_slot(self, g: _Group, slot: int, n: int, out: list[int]) -> int:
        bps = g.bps
        base = slot * bps
        take = n if n < bps else bps
        g.ref[base:base + take] = [1] * take
        out += g.asc[base:base + take]
        top = g.nblocks - base  # desc[top - bps] is block base + bps - 1
        g.stacks[slot] = g.desc[top - bps:top - take]
        g.n_active += 1
        left = bps - take
        g.free_active += left
        if left:
            g.buckets[left][slot] = None
        return n - take

    def _activate_for(self, counts: Mapping[str, int]) -> dict[str, list[int]] | None:
        """Activate, in one backing call, the slots ``counts`` needs beyond the free blocks of
        active slots (lowest inactive slots first). ``None`` (nothing changed) when a group
        lacks inactive slots or the backing refuses."""
        need: dict[str, int] = {}
        for name, n in counts.items():
            if n < 0:
                raise ValueError(f"negative block count {n} for group {name!r}")
            g = self._groups[name]
            short = n - g.free_active
            if short > 0:
                k = -(-short // g.bps)
                if k > g.n_inactive:
                    return None
                need[name] = k
        chosen = {}
        for name, k in need.items():
            g = self._groups[name]
            chosen[name] = (g.pop_inactive(k) if g.native  # type: ignore[attr-defined]
                            else [heappop(g.inactive) for _ in range(k)])
        if self.backing.activate(chosen):
            return chosen
        for name, slots in chosen.items():
            g = self._groups[name]
            if g.native:
                g.push_inactive(slots)  # type: ignore[attr-defined]
                continue
            inactive = g.inactive
            for s in slots:
                heappush(inactive, s)
        return None

    # -- references ----------------------------------------------------------------------
    def free(self, blocks: Mapping[str, Sequence[int]]) -> Mapping[str, list[int]]:
        """Drop one reference from each block, every group together (SD-01), in the order
        given. At 0 a retained or pinned block becomes *cached*; any other is freed, and every
        slot this empties is released in one backing call. Returns the blocks that became
        cached, per group (only groups with some; the prefix cache puts them in its LRU).
        Freeing a block that holds no reference raises ``ValueError`` and changes nothing."""
        groups = self._groups
        if len(blocks) == 1:  # one group: checked during its one pass (undone on a refusal)
            for name, blks in blocks.items():
                pass
            k = self.free_group(name, blks)
            return {name: k} if k else _NOTHING_CACHED
        for name, blks in blocks.items():  # several: every group checked before any changes
            self._check_free(groups.get(name) or self._g(name), blks)
        kept: Mapping[str, list[int]] = _NOTHING_CACHED
        emptied: dict[str, list[int]] | None = None
        for name, blks in blocks.items():
            k, released = self._free_group(groups[name], blks, False)
            if k:
                if kept is _NOTHING_CACHED:
                    kept = {}
                kept[name] = k  # type: ignore[index]
            if released:
                if emptied is None:
                    emptied = {}
                emptied[name] = released
        if emptied:
            self.backing.deactivate(emptied)
        return kept

    def free_group(self, group: str, blocks: Sequence[int]) -> list[int] | None:
        """:meth:`free` for one group without the dicts: drop one reference from each of
        ``blocks`` in the order given (checked in the same pass; a refusal undoes it and
        raises ``ValueError``), release the slots this empties in one backing call, and return
        the blocks that became cached (``None`` when none did)."""
        g = self._groups.get(group) or self._g(group)
        if g.native:
            kept, released = self._free_native(g, blocks, 0)
            if released:
                self.backing.deactivate({group: released})
            return kept
        if g.retains or g.pins:  # a block may become cached: the general pass
            k, released = self._free_group(g, blocks, True)
            if released:
                self.backing.deactivate({group: released})
            return k
        # no block can be kept (no prefix cache, no transfer): _free_group's pass without
        # the flags, inlined (a free is one call here, not two)
        ref = g.ref
        stacks = g.stacks
        bps = g.bps
        runs: list[tuple[int, int, int]] = []  # (slot, free before the run, free after it)
        cur = -1
        lo = hi = k0 = 0
        stack: list[int] = []
        it = iter(blocks)
        try:
            for b in it:
                r = ref[b] - 1
                ref[b] = r
                if r:
                    if r > 0 and b >= 0:
                        continue
                    raise IndexError  # a double free or a negative id: refused below
                if lo <= b < hi:  # the run's slot
                    stack.append(b)
                    continue
                if b < 0:
                    raise IndexError
                if cur >= 0:
                    runs.append((cur, k0, len(stack)))
                cur = b // bps
                lo = cur * bps
                hi = lo + bps
                stack = stacks[cur]  # type: ignore[assignment]
                k0 = len(stack)
                stack.append(b)
        except (IndexError, TypeError):
            done = len(blocks) - it.__length_hint__()  # entries consumed, the refused one too
            self._undo_free(g, blocks, done, runs, cur, k0, None)
        if cur < 0:
            return None
        runs.append((cur, k0, len(stack)))
        buckets = g.buckets
        released: list[int] | None = None
        fa = 0  # change of free blocks in active slots
        for s, k0, k in runs:
            if k0:
                del buckets[k0][s]
            if k == bps:  # emptied
                stacks[s] = None
                fa -= k0
                if released is None:
                    released = [s]
                else:
                    released.append(s)
            else:
                buckets[k][s] = None
                fa += k - k0
        g.free_active += fa
        if released:
            g.n_active -= len(released)
            inactive = g.inactive
            for s in released:
                heappush(inactive, s)
            self.backing.deactivate({group: released})
        return None

    def free_group_lru(self, group: str, blocks: Sequence[int], lru: dict[int, None]
                       ) -> list[int] | None:
        """:meth:`free_group` for the prefix cache's one-group release of a request's blocks,
        in one pass, *tail first*: ``blocks[-1]`` first, ``blocks[0]`` last (the order a
        request's release wants for the LRU; passing the request's own table needs no
        reversed copy). A block reaching ref 0 that is retained and not pinned becomes cached
        and is appended to ``lru`` (the caller's ordered dict of evictable blocks, oldest
        first) — the caller owns that order, the allocator only appends; one that is pinned
        becomes cached and is returned (``None`` when none); any other is freed as
        :meth:`free_group` frees it (its slot released when it empties). A block without a
        reference, or not a block of the group, raises ``ValueError`` and nothing changes
        (``lru`` included)."""
        g = self._groups.get(group) or self._g(group)
        if g.native:
            try:
                r, bad = g.free(blocks, 1, True)  # type: ignore[attr-defined]
            except (TypeError, OverflowError):  # an entry that is no int64
                r, bad = -1, -1
            if r < 0:
                self._refuse_free(g, blocks[::-1], bad, False)
            if r:
                # appended one by one from the output buffer: no list and no dict of them
                # (dict.update(dict.fromkeys(...)) of a few blocks costs ~2x more, measured)
                for b in g._out[:r]:  # type: ignore[attr-defined]
                    lru[b] = None
            if g.ctr[4]:  # type: ignore[attr-defined]
                self.backing.deactivate({group: g.released()})  # type: ignore[attr-defined]
            return g.pinned_out()  # type: ignore[attr-defined]
        ref = g.ref
        keep = g.keep
        pins = g.pins
        cached = g.cached
        bps = g.bps
        gone: list[int] | None = None
        pinned: list[int] | None = None
        n_lru = 0
        blocks = blocks[::-1]  # tail first
        it = iter(blocks)
        try:
            for b in it:
                r = ref[b] - 1
                if r:
                    if r > 0 and b >= 0:
                        ref[b] = r
                        continue
                    raise IndexError  # a double free or a negative id: refused below
                if b < 0:
                    raise IndexError
                ref[b] = 0
                if keep[b] and not (pins and b in pins):
                    cached[b] = 1
                    lru[b] = None
                    n_lru += 1
                elif pins and b in pins:
                    cached[b] = 1
                    if pinned is None:
                        pinned = [b]
                    else:
                        pinned.append(b)
                elif gone is None:
                    gone = [b]
                else:
                    gone.append(b)
        except (IndexError, TypeError):
            done = len(blocks) - it.__length_hint__() - 1  # entries fully processed
            for b in reversed(list(blocks)[:done]):  # before this call each had ref >= 1
                if cached[b] and not ref[b]:
                    cached[b] = 0
                    lru.pop(b, None)
                ref[b] += 1
            bad = list(blocks)[done]
            if not isinstance(bad, int) or not 0 <= bad < g.nblocks:
                raise ValueError(f"free of block {bad!r}: not a block of group {g.name!r} "
                                 f"(0..{g.nblocks - 1})") from None
            raise ValueError(f"free of block {bad} in group {g.name!r} that holds no "
                             "reference (double free)") from None
        if n_lru or pinned:
            g.n_cached += n_lru + (len(pinned) if pinned else 0)
        if gone:  # unretained, unpinned: freed
            if len(gone) == 1:  # usually the request's last, partial block
                if self._push_free(g, gone[0]):
                    self.backing.deactivate({group: [gone[0] // bps]})
            else:  # the one freeing pass (its stack runs, its slots)
                for b in gone:
                    ref[b] = 1
                _, released = self._free_group(g, gone, False)
                if released:
                    self.backing.deactivate({group: released})
        return pinned

    def _free_native(self, g: NativeGroup, blocks: Sequence[int], lru: int
                     ) -> tuple[list[int] | None, list[int]]:
        """The C free pass (kvt_free) of ``blocks``: (blocks that became cached or ``None``,
        slots released); a refused entry raises ``ValueError`` and nothing changed."""
        try:
            r, bad = g.free(blocks, lru)
        except (TypeError, OverflowError):  # an entry that is no int64: find the first refusal
            self._refuse_free(g, blocks, -1, True)
        if r < 0:
            self._refuse_free(g, blocks, bad, True)
        return (g.kept(r) if r else None), (g.released() if g.ctr[4] else [])

    def _refuse_free(self, g: Any, blocks: Sequence[int], bad: int, check: bool) -> None:
        """Raise the ``ValueError`` of a refused free on the C passes (nothing changed):
        entry ``bad`` (-1: find it, the first entry that is no block of the group or has no
        reference left after the entries before it) — the messages of the Python passes
        (``check``: :meth:`free_group`'s, else :meth:`free_group_lru`'s)."""
        items = list(blocks)
        if bad < 0:
            seen: Counter[int] = Counter()
            for i, b in enumerate(items):
                if not isinstance(b, int) or not 0 <= b < g.nblocks:
                    bad = i
                    break
                seen[b] += 1
                if g.ref[b] < seen[b]:
                    bad = i
                    break
        b = items[bad]
        if not isinstance(b, int) or not 0 <= b < g.nblocks:
            raise ValueError(f"free of block {b!r}: not a block of group {g.name!r} "
                             f"(0..{g.nblocks - 1})") from None
        if check:
            self._check_free(g, items)
        raise ValueError(f"free of block {b} in group {g.name!r} that holds no reference "
                         "(double free)") from None

    @staticmethod
    def _push_free(g: _Group, b: int) -> bool:
        """Block ``b`` (ref 0, not cached) goes on its slot's free stack: one bucket move, or
        the slot leaves the active set when it empties (returns ``True``: the caller releases
        it)."""
        bps = g.bps
        s = b // bps
        stack = g.stacks[s]
        k0 = len(stack)  # type: ignore[arg-type]
        stack.append(b)  # type: ignore[union-attr]
        buckets = g.buckets
        if k0:
            del buckets[k0][s]
        if k0 + 1 == bps:
            g.stacks[s] = None
            g.free_active -= k0
            g.n_active -= 1
            heappush(g.inactive, s)
            return True
        buckets[k0 + 1][s] = None
        g.free_active += 1
        return False

    def _free_group(self, g: _Group, blks: Sequence[int], check: bool
                    ) -> tuple[list[int] | None, list[int]]:
        """One pass over ``blks``: drop references; a retained or pinned block reaching 0 is
        cached, any other is pushed on its slot's stack, noting each run of one slot; then one
        bucket move (or release) per run. With ``check``, a reference going below 0 (or a block
        outside the group) undoes the pass and raises ``ValueError``; without, ``blks`` were
        checked already. Returns (blocks that became cached, slots released)."""
        if g.native:
            return self._free_native(g, blks, 0)
        ref = g.ref
        keep = g.keep
        pins = g.pins
        stacks = g.stacks
        bps = g.bps
        nb = g.nblocks
        cached = g.cached
        kept: list[int] | None = None
        # no block can be retained or pinned (no prefix cache, no transfer): skip the flags
        keepable = g.retains or bool(pins)
        runs: list[tuple[int, int, int]] = []  # (slot, free before the run, free after it)
        cur = -1
        k0 = 0
        lo = hi = 0  # the blocks of slot cur
        stack: list[int] = []
        it = iter(blks)
        try:
            for b in it:
                r = ref[b] - 1
                ref[b] = r
                if r:
                    if r > 0:
                        continue
                    raise IndexError  # a double free: refused below
                if keepable and (keep[b] or (pins and b in pins)):  # retained or pinned
                    if b < 0:
                        raise IndexError
                    cached[b] = 1
                    if kept is None:
                        kept = [b]
                    else:
                        kept.append(b)
                    continue
                if lo <= b < hi:  # the run's slot
                    stack.append(b)
                    continue
                if not 0 <= b < nb:
                    raise IndexError
                if cur >= 0:
                    runs.append((cur, k0, len(stack)))
                cur = b // bps
                lo = cur * bps
                hi = lo + bps
                stack = stacks[cur]  # type: ignore[assignment]
                k0 = len(stack)
                stack.append(b)
        except (IndexError, TypeError):
            done = len(blks) - it.__length_hint__()  # entries consumed, the refused one too
            if kept:
                g.n_cached += len(kept)  # _undo_free takes them back one by one
            self._undo_free(g, blks, done, runs, cur, k0, kept)
            raise AssertionError("unreachable: _undo_free raises")  # pragma: no cover
        if kept:
            g.n_cached += len(kept)
        if cur < 0:
            return kept, []
        runs.append((cur, k0, len(stack)))
        buckets = g.buckets
        released: list[int] = []
        fa = 0  # change of free blocks in active slots
        for s, k0, k in runs:
            if k0:
                del buckets[k0][s]
            if k == bps:  # emptied
                stacks[s] = None
                fa -= k0
                released.append(s)
            else:
                buckets[k][s] = None
                fa += k - k0
        g.free_active += fa
        if released:
            g.n_active -= len(released)
            inactive = g.inactive
            for s in released:
                heappush(inactive, s)
        return kept, released

    def _undo_free(self, g: _Group, blks: Sequence[int], done: int,
                   runs: list[tuple[int, int, int]], cur: int, k0: int,
                   kept: list[int] | None) -> None:
        """Entry ``done - 1`` of a checked free was refused: give back the references the
        first ``done`` entries dropped, cut the stacks back, un-cache what was cached, and
        raise ``ValueError`` naming the block."""
        ref = g.ref
        items = list(blks)[:done]
        bad = items[-1] if items else None
        for b in items:  # every entry that got past ``ref[b] - 1`` dropped a reference
            try:
                ref[b] += 1
            except (IndexError, TypeError):
                pass
        first: dict[int, int] = {}
        for s, k, _ in runs:
            first.setdefault(s, k)
        if cur >= 0:
            first.setdefault(cur, k0)
        for s, k in first.items():
            del g.stacks[s][k:]  # type: ignore[index]
        for b in kept or ():
            g.cached[b] = 0
            g.n_cached -= 1
        if not isinstance(bad, int) or not 0 <= bad < g.nblocks:
            raise ValueError(f"free of block {bad!r}: not a block of group {g.name!r} "
                             f"(0..{g.nblocks - 1})")
        self._check_free(g, blks)
        raise ValueError(f"free of block {bad} in group {g.name!r} that holds no reference "
                         "(double free)")  # pragma: no cover - _check_free names it

    @staticmethod
    def _check_free(g: _Group, blks: Sequence[int]) -> None:
        """Refuse (``ValueError``, nothing changed) a free of a block without a reference."""
        if not blks:
            return
        ref = g.ref
        try:
            low = min(map(ref.__getitem__, blks))
        except (IndexError, TypeError):
            bad = next(b for b in blks if not isinstance(b, int) or not 0 <= b < g.nblocks)
            raise ValueError(f"free of block {bad!r}: not a block of group {g.name!r} "
                             f"(0..{g.nblocks - 1})") from None
        if low <= 0:
            b = next(b for b in blks if ref[b] <= 0)
            raise ValueError(f"free of block {b} in group {g.name!r} that holds no "
                             "reference (double free)")
        if len(blks) > 1 and len(set(blks)) != len(blks):
            for b, c in Counter(blks).items():
                if ref[b] < c:
                    raise ValueError(f"free of block {b} in group {g.name!r}: {c} frees, "
                                     f"{ref[b]} references (double free)")

    def touch(self, group: str, block: int) -> bool:
        """Add a reference to ``block``: a cached block is revived (ref 0 → 1; returns
        ``True``: the prefix cache takes it out of its LRU); a live block gets one more
        reference (``False``). Touching a free block raises ``ValueError``."""
        g = self._g(group)
        if g.ref[block] > 0:
            g.ref[block] += 1
            return False
        if not g.cached[block]:
            raise ValueError(f"touch of free block {block} in group {group!r}: only live or "
                             "cached blocks can be referenced")
        g.cached[block] = 0
        g.n_cached -= 1
        g.ref[block] = 1
        return True

    def touch_many(self, group: str, blocks: Sequence[int]) -> list[int] | None:
        """:meth:`touch` of every block in one call; returns the blocks revived from cached
        (``None`` when none was)."""
        g = self._groups.get(group) or self._g(group)
        ref = g.ref
        cached = g.cached
        revived = None
        for b in blocks:
            r = ref[b]
            if r > 0:
                ref[b] = r + 1
                continue
            if not cached[b]:
                if revived:
                    g.n_cached -= len(revived)
                raise ValueError(f"touch of free block {b} in group {group!r}: only live or "
                                 "cached blocks can be referenced")
            cached[b] = 0
            ref[b] = 1
            if revived is None:
                revived = [b]
            else:
                revived.append(b)
        if revived:
            g.n_cached -= len(revived)
        return revived

    def will_retain(self, group: str) -> None:
        """Blocks of ``group`` may be retained from now on, also by a caller that sets the
        retained flags itself on its hot path (the prefix cache calls this for each of its
        groups when it is built). Until then (no prefix caching) a free does not read the
        flags. Idempotent."""
        self._g(group).retains = True

    def retain(self, group: str, blocks: Sequence[int]) -> None:
        """Keep ``blocks`` (live or cached) when their last reference goes: they hold a
        published prefix (the prefix cache calls this on publish)."""
        g = self._groups.get(group) or self._g(group)
        g.retains = True
        ref, cached, keep = g.ref, g.cached, g.keep
        for b in blocks:
            if not (ref[b] or cached[b]):
                raise ValueError(f"retain of free block {b} in group {group!r}")
            keep[b] = 1

    def unretain(self, group: str, blocks: Sequence[int]) -> int:
        """Stop keeping ``blocks`` (their prefix was withdrawn): a live one is freed when its
        last reference goes, a cached unpinned one is freed now, a pinned one when its
        transfer ends. Returns the blocks freed now."""
        g = self._g(group)
        now = []
        for b in blocks:
            g.keep[b] = 0
            if g.cached[b] and not g.pins.get(b):
                now.append(b)
        if now:
            self.release_cached(group, now)
        return len(now)

    def pin(self, group: str, block: int) -> None:
        """Hold ``block`` (live or cached) for a transfer: never freed, evicted or moved until
        :meth:`unpin` (invariant 4)."""
        g = self._g(group)
        if not (g.ref[block] or g.cached[block]):
            raise ValueError(f"pin of free block {block} in group {group!r}")
        g.pins[block] = g.pins.get(block, 0) + 1
        if g.native:
            g.pinned[block] = 1  # type: ignore[attr-defined]

    def unpin(self, group: str, block: int) -> bool:
        """Drop one transfer pin; a cached block left neither pinned nor retained is freed
        (returns ``True``)."""
        g = self._g(group)
        c = g.pins.get(block, 0)
        if c <= 0:
            raise ValueError(f"unpin of block {block} in group {group!r}, which is not pinned")
        if c > 1:
            g.pins[block] = c - 1
            return False
        del g.pins[block]
        if g.native:
            g.pinned[block] = 0  # type: ignore[attr-defined]
        if g.cached[block] and not g.keep[block]:
            self.release_cached(group, [block])
            return True
        return False

    def release_cached(self, group: str, blocks: Sequence[int]) -> None:
        """Free cached, unpinned blocks (eviction, a withdrawn prefix); their retained flag
        goes with them and emptied slots are released at once, in one call. A block that is
        not cached or is pinned raises ``ValueError`` and nothing changes."""
        g = self._g(group)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"release_cached: duplicate blocks in group {group!r}")
        for b in blocks:
            if not g.cached[b]:
                state = "live" if g.ref[b] else "free"
                raise ValueError(f"release_cached: block {b} in group {group!r} is {state}, "
                                 "not cached (a referenced block is never evicted)")
            if g.pins.get(b):
                raise ValueError(f"release_cached: block {b} in group {group!r} is pinned by "
                                 "a transfer (invariant 4: never evicted while it runs)")
        bps = g.bps
        released: list[int] = []
        push = (lambda _g, b: g.push_free(b)) if g.native else self._push_free  # type: ignore
        for b in blocks:
            g.cached[b] = 0
            g.keep[b] = 0
            g.n_cached -= 1
            if push(g, b):
                released.append(b // bps)
        if released:
            self.backing.deactivate({group: released})
    # -- compaction ----------------------------------------------------------------------
    def compact(self, groups: Iterable[str] | None = None, *, max_blocks: int | None = None,
                exclude: Mapping[str, Iterable[int]] | None = None) -> Compaction:
        """Move live and cached blocks out of the sparsest active slots into free blocks of
        the densest ones, and release the slots this empties at once.

        Per group, ``⌊free blocks in active slots / B⌋`` slots can be emptied; the sparsest
        slots whose every used block may move are chosen (fewest blocks copied; among equals
        the highest slot id), their blocks go to the free blocks of the fullest remaining
        slots, lowest source block first. Nothing new is mapped. A block does not move when
        it is pinned by a transfer or is in ``exclude[group]``; its slot is then kept. ``max_blocks`` caps the blocks moved over
        all groups (whole slots only). ``groups``: the groups to compact (default: all).

        The backing copies the data first (``backing.move``); then the allocator moves ref
        counts and cached / retained flags and releases the emptied slots in one call. Returns
        the :class:`Compaction` (old → new per group: the caller rewrites its block tables and
        the prefix index with it). A failed copy changes nothing (``error`` says
        why). The caller must not touch the moved blocks' old ids afterwards, and must not
        compact while a kernel reads or writes blocks that may move.
        """
        names = list(self._groups) if groups is None else list(groups)
        for name in names:
            self._g(name)
        if max_blocks is not None and max_blocks < 0:
            raise ValueError(f"compact: max_blocks must be >= 0, got {max_blocks}")
        move = getattr(self.backing, "move", None)
        if move is None:
            raise TypeError(f"compact: the slot backing {type(self.backing).__name__} has no "
                            "move(moves) to copy block contents")
        budget = max_blocks
        plans: dict[str, tuple[list[int], dict[int, int], dict[int, int]]] = {}
        for name in names:
            g = self._groups[name]
            k_max = g.free_active // g.bps
            if k_max == 0 or (budget is not None and budget <= 0):
                continue
            excl = set(exclude.get(name, ())) if exclude else set()
            excl.update(g.pins)  # a transfer reads or writes them (invariant 4)
            ref = g.ref
            cached = g.cached
            bps = g.bps
            stacks = g.stacks  # (a NativeGroup's: a copy, read once)
            buckets = g.buckets
            cands: list[tuple[int, int]] = []
            for s, stack in enumerate(stacks):
                if stack is None or len(stack) == 0:
                    continue
                ok = True
                for b in range(s * bps, (s + 1) * bps):
                    if ref[b] or cached[b]:
                        if b in excl:
                            ok = False
                            break
                if ok:
                    cands.append((bps - len(stack), -s))
            cands.sort()
            sources: list[int] = []
            for used, neg in cands[:k_max]:
                if budget is not None:
                    if used > budget:
                        break
                    budget -= used
                sources.append(-neg)
            if not sources:
                continue
            src_set = set(sources)
            n_moves = sum(g.used(s) for s in sources)
            # destinations: fullest remaining slots first, each stack from its top
            dests: list[int] = []
            taken: dict[int, int] = {}  # dest slot -> blocks taken from its stack
            for kk in range(1, bps):
                for s in buckets[kk]:
                    if s in src_set:
                        continue
                    stack = stacks[s]
                    t = min(kk, n_moves - len(dests))
                    dests.extend(stack[-1:-t - 1:-1])  # type: ignore[index]
                    taken[s] = t
                    if len(dests) == n_moves:
                        break
                if len(dests) == n_moves:
                    break
            assert len(dests) == n_moves, "compaction planned more moves than free blocks"
            mapping: dict[int, int] = {}
            it = iter(dests)
            for s in sources:
                for b in range(s * bps, (s + 1) * bps):
                    if ref[b] or cached[b]:
                        mapping[b] = next(it)
            plans[name] = (sources, mapping, taken)
        if not plans:
            return Compaction({n: {} for n in names}, {n: () for n in names})
        ok = move({name: list(p[1].items()) for name, p in plans.items()})
        if not ok:
            return Compaction({n: {} for n in names}, {n: () for n in names},
                              error=getattr(self.backing, "last_move_error", "") or
                              "the backing could not copy the blocks; nothing moved")
        emptied: dict[str, list[int]] = {}
        for name, (sources, mapping, taken) in plans.items():
            g = self._groups[name]
            ref = g.ref
            cached = g.cached
            keep = g.keep
            bps = g.bps
            native = g.native
            for s, t in taken.items():  # destination stacks give up their top t blocks
                if native:
                    g.drop_top(s, t)  # type: ignore[attr-defined]
                    continue
                stack = g.stacks[s]
                k = len(stack)  # type: ignore[arg-type]
                del stack[k - t:]  # type: ignore[index]
                del g.buckets[k][s]
                if k - t:
                    g.buckets[k - t][s] = None
                g.free_active -= t
            for old, new in mapping.items():
                ref[new] = ref[old]
                ref[old] = 0
                keep[new] = keep[old]
                keep[old] = 0
                if cached[old]:
                    cached[old] = 0
                    cached[new] = 1
            for s in sources:  # every block of a source is free now: release it
                if native:
                    g.release_slot(s)  # type: ignore[attr-defined]
                    continue
                k = len(g.stacks[s])  # type: ignore[arg-type]
                del g.buckets[k][s]
                g.stacks[s] = None
                g.free_active -= k
                g.n_active -= 1
                heapq.heappush(g.inactive, s)
            emptied[name] = sorted(sources)
        self.backing.deactivate(emptied)
        return Compaction({n: (plans[n][1] if n in plans else {}) for n in names},
                          {n: tuple(emptied.get(n, ())) for n in names})

    # -- introspection -------------------------------------------------------------------
    def ref_count(self, group: str, block: int) -> int:
        return self._g(group).ref[block]

    def is_cached(self, group: str, block: int) -> bool:
        return bool(self._g(group).cached[block])

    def slot_of(self, group: str, block: int) -> int:
        return block // self._g(group).bps

    def blocks_of_slot(self, group: str, slot: int) -> range:
        bps = self._g(group).bps
        return range(slot * bps, (slot + 1) * bps)

    def slot_live(self, group: str, slot: int) -> int:
        """Blocks of ``slot`` with ref ≥ 1."""
        g = self._g(group)
        return g.used(slot) - g.ncached_of(slot)

    def slot_cached(self, group: str, slot: int) -> int:
        """Cached (ref 0, retained) blocks of ``slot``."""
        return self._g(group).ncached_of(slot)

    def is_retained(self, group: str, block: int) -> bool:
        return bool(self._g(group).keep[block])

    def pin_count(self, group: str, block: int) -> int:
        return self._g(group).pins.get(block, 0)

    def pinned_blocks(self, group: str) -> Mapping[int, int]:
        """Blocks pinned by transfers now -> pin count (read only)."""
        return (self._groups.get(group) or self._g(group)).pins

    def slot_evictable(self, group: str, slot: int) -> bool:
        """True when every used block of active ``slot`` is cached and unpinned: giving them
        up releases the slot's pages."""
        g = self._g(group)
        k = g.stack_len(slot)
        if k < 0 or g.bps - k != g.ncached_of(slot):
            return False
        bps = g.bps
        return not any(p // bps == slot for p in g.pins)

    def block_info(self, group: str, block: int) -> BlockInfo:
        g = self._g(group)
        if not 0 <= block < len(g.ref):
            raise IndexError(f"block {block} outside group {group!r} ({len(g.ref)} blocks)")
        return BlockInfo(group, block, block // g.bps, g.ref[block], bool(g.cached[block]),
                         bool(g.keep[block]), g.pins.get(block, 0))

    def slot_info(self, group: str, slot: int) -> SlotInfo:
        g = self._g(group)
        k = g.stack_len(slot)
        active = k >= 0
        nc = g.ncached_of(slot)
        return SlotInfo(group, slot, active, g.used(slot) - nc, nc, k if active else 0)

    def active_slots(self, group: str) -> list[int]:
        g = self._g(group)
        return [s for s in range(g.num_slots) if g.stack_len(s) >= 0]

    def num_active_slots(self, group: str) -> int:
        return self._g(group).n_active

    def num_inactive_slots(self, group: str) -> int:
        return self._g(group).n_inactive

    def num_free_blocks(self, group: str) -> int:
        """Free blocks in active slots (usable without mapping anything)."""
        return self._g(group).free_active

    def num_live_blocks(self, group: str) -> int:
        return self._g(group).n_live

    def num_cached_blocks(self, group: str) -> int:
        return self._g(group).n_cached

    def check_invariants(self) -> None:
        """Recount everything from scratch and raise ``AssertionError`` on any mismatch."""
        for g in self._groups.values():
            n_live = n_cached = n_active = free_active = 0
            inactive = set(g.inactive)
            assert len(inactive) == len(g.inactive) == g.n_inactive, \
                f"{g.name}: inactive heap has duplicates or a wrong size"
            stacks = g.stacks  # (a NativeGroup's: copies, read once)
            buckets = g.buckets
            if g.native:
                g.check_links()  # type: ignore[attr-defined]
                heap = g.inactive
                assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), \
                    f"{g.name}: the inactive slots are not a min-heap"
            for s in range(g.num_slots):
                blocks = range(s * g.bps, (s + 1) * g.bps)
                live = sum(1 for b in blocks if g.ref[b] > 0)
                cached = sum(1 for b in blocks if g.cached[b])
                assert all(not (g.ref[b] and g.cached[b]) for b in blocks), \
                    f"{g.name}: a block in slot {s} is both live and cached"
                assert all(g.ref[b] >= 0 for b in blocks)
                assert g.retains or not any(g.keep[s * g.bps:(s + 1) * g.bps]), \
                    f"{g.name}: a block of slot {s} is retained before will_retain/retain"
                for b in blocks:
                    if g.cached[b]:
                        assert g.keep[b] or g.pins.get(b), \
                            f"{g.name}: cached block {b} neither retained nor pinned"
                    if g.keep[b] or g.pins.get(b):
                        assert g.ref[b] or g.cached[b], \
                            f"{g.name}: free block {b} still retained or pinned"
                stack = stacks[s]
                if stack is None:
                    assert live == cached == 0, f"{g.name}: slot {s} inactive but holds blocks"
                    assert s in inactive, f"{g.name}: slot {s} neither active nor inactive"
                    assert g.ncached_of(s) == 0
                    continue
                assert s not in inactive, f"{g.name}: active slot {s} is in the inactive heap"
                assert live + cached >= 1, f"{g.name}: active slot {s} holds no block"
                assert g.ncached_of(s) == cached
                free = [b for b in blocks if not g.ref[b] and not g.cached[b]]
                assert sorted(stack) == free, f"{g.name}: slot {s} free list {stack} != {free}"
                k = len(stack)
                for kk in range(1, g.bps):
                    assert (s in buckets[kk]) == (kk == k), \
                        f"{g.name}: slot {s} with {k} free blocks in bucket {kk}"
                n_live += live
                n_cached += cached
                n_active += 1
                free_active += k
            assert (n_live, n_cached, n_active, free_active) == (
                g.n_live, g.n_cached, g.n_active, g.free_active), f"{g.name}: counters drifted"
