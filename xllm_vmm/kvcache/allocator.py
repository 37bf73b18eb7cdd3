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

:class:`BlockAllocator` is a façade over one
:class:`~xllm_vmm.kvcache.block_state.BlockState` per group, the state and its passes (free
stacks, buckets of partial slots, the heap of inactive slots; O(1) amortised per block). Two
backends implement it: with ``libxllm_kvtable.so`` built (the default) the flat arrays and C
passes of :class:`~xllm_vmm.kvcache.kvtable.NativeBlockState`, one C call per allocation and
per free; without it, or with ``XLLM_VMM_KVTABLE=python`` / ``BlockAllocator(native=False)``,
the pure-Python :class:`~xllm_vmm.kvcache.pytable.PyBlockState`. Both hand out the same block
ids in the same order, make the same slot choices and refuse the same frees with the same
messages (``tests/kvcache/test_kvtable.py`` runs them in lockstep through the protocol; every
other kvcache test runs on both). This module holds what is the same for both: the verbs over
several groups (all or nothing, one backing call), references, retained flags, pins, eviction's
release, introspection and the invariant check. Compaction is :mod:`xllm_vmm.kvcache.compaction`.

Invariants (:meth:`BlockAllocator.check_invariants`, run by the tests after every step):

- every block is free, live or cached; a cached block is retained or pinned;
- every live or cached block lies in an active slot; every active slot holds ≥ 1 of them;
- all groups of one :meth:`BlockAllocator.allocate` call succeed or none do (SD-01: target and
  draft are allocated and released together); a refused call changes nothing;
- a pinned block is never released by :meth:`release_cached` nor moved by :meth:`compact`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from xllm_vmm.kvcache import compaction
from xllm_vmm.kvcache.block_state import (
    BlockState,
    GroupShape,
    SlotBacking,
    check_free,
    check_shape,
)
from xllm_vmm.kvcache.compaction import Compaction
from xllm_vmm.kvcache.kvtable import (
    MAX_BLOCKS,
    NativeBlockState,
    native_available,
    native_requested,
)
from xllm_vmm.kvcache.pytable import PyBlockState

__all__ = [
    "BlockAllocator",
    "BlockInfo",
    "BlockState",
    "Compaction",
    "GroupShape",
    "SlotBacking",
    "SlotInfo",
]


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


_NOTHING_CACHED: Mapping[str, list[int]] = {}  # free() kept no block (never written)


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
        backend = NativeBlockState if native else PyBlockState
        self._groups: dict[str, BlockState] = {}
        for s in shapes:
            if s.name in self._groups:
                raise ValueError(f"duplicate group name {s.name!r}")
            check_shape(s)
            self._groups[s.name] = backend(s, backing)
        self._backing = backing

    @property
    def backing(self) -> SlotBacking:
        """Maps and releases slots (every group's state calls it; replacing it here replaces
        it there: a worker set's fan-out)."""
        return self._backing

    @backing.setter
    def backing(self, backing: SlotBacking) -> None:
        self._backing = backing
        for g in self._groups.values():
            g.backing = backing

    # -- configuration / shape -----------------------------------------------------------
    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def shape(self, group: str) -> GroupShape:
        g = self._g(group)
        return GroupShape(g.name, g.num_slots, g.bps)

    def state(self, group: str) -> BlockState:
        """The block state of ``group`` (its arrays and counters; its one-group verbs, which
        the manager's and the prefix cache's hot paths bind once)."""
        return self._g(group)

    def _g(self, group: str) -> BlockState:
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
        new_slots: Mapping[str, list[int]] | None = {}
        for name, n in counts.items():
            g = groups.get(name) or self._g(name)
            if n > g.free_active:
                new_slots = None
            elif n < 0:
                raise ValueError(f"negative block count {n} for group {name!r}")
        if new_slots is None:  # new slots (a prompt): planned and activated in one call
            new_slots = self._activate_for(counts)
            if new_slots is None:
                return None
        out: dict[str, list[int]] = {}
        for name, n in counts.items():
            hint = near.get(name, -1) if near else -1
            slots = new_slots.get(name)
            if slots is None:  # fits in its active slots: the one-group path
                out[name] = groups[name].allocate(n, hint)  # type: ignore[assignment]
            else:
                out[name] = groups[name].take(n, hint, slots)
        return out

    def allocate_group(self, group: str, n: int, hint: int = -1) -> list[int] | None:
        """:meth:`allocate` for one group without the dicts: ``n`` new blocks of ``group``
        (ref count 1 each) as a list, ``hint`` the ``near`` block (``-1``: none), or ``None``
        ("not now": nothing changed) — :meth:`BlockState.allocate` of the group's state, the
        one allocation path (:meth:`allocate` calls it for every group that fits in its active
        slots; the manager's hot path binds the state's method directly)."""
        try:
            g = self._groups[group]
        except KeyError:
            g = self._g(group)
        return g.allocate(n, hint)

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
        chosen = {name: self._groups[name].pop_inactive(k) for name, k in need.items()}
        if self._backing.activate(chosen):  # type: ignore[arg-type]
            return chosen  # type: ignore[return-value]
        for name, slots in chosen.items():
            self._groups[name].push_inactive(slots)  # type: ignore[arg-type]
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
            check_free(groups.get(name) or self._g(name), blks)
        kept: Mapping[str, list[int]] = _NOTHING_CACHED
        emptied: dict[str, Sequence[int]] | None = None
        for name, blks in blocks.items():
            k, released = groups[name].release(blks)
            if k:
                if kept is _NOTHING_CACHED:
                    kept = {}
                kept[name] = k  # type: ignore[index]
            if released:
                if emptied is None:
                    emptied = {}
                emptied[name] = released
        if emptied:
            self._backing.deactivate(emptied)
        return kept

    def free_group(self, group: str, blocks: Sequence[int]) -> list[int] | None:
        """:meth:`free` for one group without the dicts: drop one reference from each of
        ``blocks`` in the order given (checked in the same pass; a refusal undoes it and
        raises ``ValueError``), release the slots this empties in one backing call, and return
        the blocks that became cached (``None`` when none did)."""
        try:
            g = self._groups[group]
        except KeyError:
            g = self._g(group)
        return g.free(blocks)

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
        try:
            g = self._groups[group]
        except KeyError:
            g = self._g(group)
        return g.free_lru(blocks, lru)

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
        g.pin(block)

    def unpin(self, group: str, block: int) -> bool:
        """Drop one transfer pin; a cached block left neither pinned nor retained is freed
        (returns ``True``)."""
        g = self._g(group)
        if g.pins.get(block, 0) <= 0:
            raise ValueError(f"unpin of block {block} in group {group!r}, which is not pinned")
        if not g.unpin(block):
            return False
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
        push = g.push_free
        for b in blocks:
            g.cached[b] = 0
            g.keep[b] = 0
            g.n_cached -= 1
            if push(b):
                released.append(b // bps)
        if released:
            self._backing.deactivate({group: released})

    # -- compaction ----------------------------------------------------------------------
    def compact(self, groups: Iterable[str] | None = None, *, max_blocks: int | None = None,
                exclude: Mapping[str, Iterable[int]] | None = None) -> Compaction:
        """Move live and cached blocks out of the sparsest active slots into free blocks of
        the densest ones, and release the slots this empties at once
        (:mod:`xllm_vmm.kvcache.compaction`).

        Per group, ``⌊free blocks in active slots / B⌋`` slots can be emptied; the sparsest
        slots whose every used block may move are chosen (fewest blocks copied; among equals
        the highest slot id), their blocks go to the free blocks of the fullest remaining
        slots, lowest source block first. Nothing new is mapped. A block does not move when
        it is pinned by a transfer or is in ``exclude[group]``; its slot is then kept.
        ``max_blocks`` caps the blocks moved over all groups (whole slots only). ``groups``:
        the groups to compact (default: all).

        The backing copies the data first (``backing.move``); then the allocator moves ref
        counts and cached / retained flags and releases the emptied slots in one call. Returns
        the :class:`Compaction` (old → new per group: the caller rewrites its block tables and
        the prefix index with it). A failed copy changes nothing (``error`` says why). The
        caller must not touch the moved blocks' old ids afterwards, and must not compact while
        a kernel reads or writes blocks that may move.
        """
        names = list(self._groups) if groups is None else list(groups)
        for name in names:
            self._g(name)
        return compaction.compact(self._groups, self._backing, names, max_blocks, exclude)

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
            g.check()
            _check_group(g)


def _check_group(g: BlockState) -> None:
    """One group's state recounted from its arrays and views (see
    :meth:`BlockAllocator.check_invariants`)."""
    n_live = n_cached = n_active = free_active = 0
    heap = g.inactive
    inactive = set(heap)
    assert len(inactive) == len(heap) == g.n_inactive, \
        f"{g.name}: inactive heap has duplicates or a wrong size"
    assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), \
        f"{g.name}: the inactive slots are not a min-heap"
    stacks = g.stacks  # (a native state's: copies, read once)
    buckets = g.buckets
    ref, cached, keep, pins, bps = g.ref, g.cached, g.keep, g.pins, g.bps
    for s in range(g.num_slots):
        blocks = range(s * bps, (s + 1) * bps)
        live = sum(1 for b in blocks if ref[b] > 0)
        n_c = sum(1 for b in blocks if cached[b])
        assert all(not (ref[b] and cached[b]) for b in blocks), \
            f"{g.name}: a block in slot {s} is both live and cached"
        assert all(ref[b] >= 0 for b in blocks)
        assert g.retains or not any(keep[s * bps:(s + 1) * bps]), \
            f"{g.name}: a block of slot {s} is retained before will_retain/retain"
        for b in blocks:
            if cached[b]:
                assert keep[b] or pins.get(b), \
                    f"{g.name}: cached block {b} neither retained nor pinned"
            if keep[b] or pins.get(b):
                assert ref[b] or cached[b], f"{g.name}: free block {b} still retained or pinned"
        stack = stacks[s]
        assert g.ncached_of(s) == n_c
        if stack is None:
            assert live == n_c == 0, f"{g.name}: slot {s} inactive but holds blocks"
            assert s in inactive, f"{g.name}: slot {s} neither active nor inactive"
            continue
        assert s not in inactive, f"{g.name}: active slot {s} is in the inactive heap"
        assert live + n_c >= 1, f"{g.name}: active slot {s} holds no block"
        free = [b for b in blocks if not ref[b] and not cached[b]]
        assert sorted(stack) == free, f"{g.name}: slot {s} free list {stack} != {free}"
        k = len(stack)
        for kk in range(1, bps):
            assert (s in buckets[kk]) == (kk == k), \
                f"{g.name}: slot {s} with {k} free blocks in bucket {kk}"
        n_live += live
        n_cached += n_c
        n_active += 1
        free_active += k
    assert (n_live, n_cached, n_active, free_active) == (
        g.n_live, g.n_cached, g.n_active, g.free_active), f"{g.name}: counters drifted"
