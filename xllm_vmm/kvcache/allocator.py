"""Page-aware block allocation over slots, with reference counts, a retention hook and
compaction.

Terms (per cache group): a *slot* is one page offset across every tensor of the group; slot
``s`` holds blocks ``[s × B, (s + 1) × B)`` where ``B`` is the group's blocks per slot (a block
never straddles a page). Block ids are dense per group: ``0 … num_slots × B − 1``. A slot is
*active* while it holds at least one live or cached block; only active slots have memory
under them (the :class:`SlotBacking` maps a slot when it becomes active and releases it the
moment it empties — EL-01).

Allocation is page-aware: a new block comes from the *fullest* partially used active slot
(fewest free blocks; among equals, the one that entered that state first), then from newly
activated slots (lowest slot id first); inside a slot the lowest free block id comes first for
a fresh slot, and the most recently freed block is reused first after that. Decode growth, one
block at a time for many sequences, therefore packs into few slots instead of scattering.
A ``near`` hint (the sequence's last block) puts a sequence's blocks in its own slot first;
when that slot is full, one-block decode growth goes to the *roomiest* partial slot instead
(most free blocks; among equals, the one that entered that state first), so that the
sequence's next blocks follow it there rather than each landing in a different one-block hole:
a sequence's blocks share fewer slots, and its free touches fewer (on the bench trace 1,426
slot updates for 3,877 blocks instead of 1,883). One-block holes are still filled first by
allocations without a hint (a new prompt), and a prompt that needs new slots takes every free
block of the active slots first, so live blocks stay packed.

Bookkeeping (what makes that O(1) amortised per block, with no per-block objects): every
active slot has a free *stack* (a list of its free block ids, top = next one handed out);
``buckets[k]`` is an insertion-ordered set of the active slots with exactly ``k`` free blocks
(``1 ≤ k < B``), so "fullest partial slot" is the first slot of the first non-empty bucket (at
most ``B − 1`` probes; the roomiest is the first slot of the last non-empty one). A call moves
a slot between buckets once per run of blocks it takes from or returns to that slot, not once
per block. Occupancy and the live count are derived (``B − len(stack)``,
``active × B − free − cached``), not stored. A fresh slot's stack is one slice of a per-group
list of every block id, highest first. Without a retention policy, :meth:`BlockAllocator.free`
is one pass over the blocks (drop the reference, push a block that reached 0, note where each
run of one slot starts), then one bucket move per run; a double free found during the pass
undoes the pass before any bucket moved, so a refused free changes nothing, bucket order
included. With a policy, blocks are checked first and ``on_zero_ref`` is asked block by
block, in order.

Invariants (checked by the tests after every step):

- a block is *free*, *live* (ref ≥ 1) or *cached* (ref 0, kept by the retention policy);
- every live or cached block lies in an active slot; every active slot holds ≥ 1 of them;
- all groups of one :meth:`BlockAllocator.allocate` call succeed or none do (SD-01: target and
  draft are allocated and released together); a failed call changes nothing except that it may
  have evicted cached blocks.

Extension point for the prefix cache (``xllm_vmm.kvcache.prefix`` implements it)
---------------------------------------------------------------------------------

Blocks are reference counted. :meth:`BlockAllocator.free` decrements; when a block's count
reaches 0 the allocator asks the optional retention policy (:class:`RetentionPolicy`, set with
:meth:`BlockAllocator.set_retention`):

- ``policy.on_zero_ref(group, block) -> bool``: ``True`` keeps the block as a *cached*
  (evictable) block: it stays allocated and its slot stays mapped; ``False`` frees it (and an
  emptied slot is released at once, EL-01).
- ``allocator.touch(group, block)`` revives a cached block (ref 0 → 1) on a cache hit and calls
  ``policy.on_revive(group, block)``; on a live block it just adds a reference.
- When an allocation cannot get memory (no free block in active slots and the backing refuses a
  new slot), the allocator calls ``policy.evict(group, n_blocks, prefer_slot_emptying=True) ->
  list[int]``: the cached blocks (ref 0) the policy gives up, in the order it chose. The
  allocator frees them (releasing emptied slots) and retries. It asks the short group first,
  then, if the budget still refuses, every group for one slot's worth at a time. Still short →
  ``None`` ("not now"), never an exception.
- ``policy.num_evictable(group) -> int`` is what admission counts as available beside free
  blocks.
- :meth:`BlockAllocator.release_cached` lets the policy drop cached blocks on its own (a cap,
  host offload finished): they are freed without another ``on_zero_ref``.
- Compaction hooks (needed only by a policy set on an allocator that is compacted):
  ``policy.can_move(group, block) -> bool`` (optional; ``False`` for a block a transfer has
  pinned) and ``policy.on_move(group, moves)`` with ``moves`` a dict old block → new block,
  called after the allocator moved them, so the policy's index follows (see
  :meth:`BlockAllocator.compact`).
- Introspection for page-aware eviction: :meth:`block_info` (group, slot, ref count, cached),
  :meth:`slot_info` (live / cached / free counts of a slot), :meth:`slot_live`,
  :meth:`slot_cached`, :meth:`slot_of`, :meth:`blocks_of_slot`.
- ``free`` also takes the one-group form ``free(group, blocks)``, so a
  :class:`BlockAllocator` is the prefix cache's ``BlockBackend`` as it is.

Compaction
----------

Placement is decided before lifetimes are known: a long-running sequence's decode blocks land
in slots shared with short sequences, and when those finish their slots stay mapped for one or
two blocks. :meth:`BlockAllocator.compact` undoes that when the caller chooses (idle or lightly
loaded, between engine steps): it moves every live and cached block out of the sparsest slots
into free blocks of the densest ones and releases the emptied slots at once. It never activates
a slot (the budget cannot be exceeded), never moves a block the policy says is pinned or the
caller excludes, and returns the old → new mapping per group: the caller rewrites its block
tables with it. The data is copied by the backing's ``move(moves) -> bool`` (the virtual KV
cache: one batched device-to-device copy across every tensor of the group); ``False`` (a copy
failed) changes nothing.
"""

from __future__ import annotations

import heapq
from heapq import heappop, heappush
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

__all__ = [
    "BlockAllocator",
    "BlockInfo",
    "Compaction",
    "GroupShape",
    "RetentionPolicy",
    "SlotBacking",
    "SlotInfo",
]


@runtime_checkable
class RetentionPolicy(Protocol):
    """What the prefix cache implements (see the module docstring; ``can_move`` and
    ``on_move`` are optional and only needed for :meth:`BlockAllocator.compact`)."""

    def on_zero_ref(self, group: str, block: int) -> bool: ...

    def on_revive(self, group: str, block: int) -> None: ...

    def evict(self, group: str, n_blocks: int, prefer_slot_emptying: bool = True) -> list[int]: ...

    def num_evictable(self, group: str) -> int: ...


class SlotBacking(Protocol):
    """Puts memory under slots. ``activate`` is all-or-nothing over every group it is given
    (one batched map) and returns ``False`` for "not now"; ``deactivate`` releases at once.
    Optional, for :meth:`BlockAllocator.compact`: ``move(moves) -> bool`` copies the contents
    of every ``(old, new)`` block pair per group (all or nothing; ``False`` = nothing moved)."""

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


@dataclass(frozen=True)
class SlotInfo:
    group: str
    slot: int
    active: bool
    live: int  # blocks with ref >= 1
    cached: int  # blocks with ref 0 kept by the retention policy
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


class _Group:
    """Mutable state of one group (internal). ``stacks[s]`` is slot ``s``'s free stack, or
    ``None`` while the slot is inactive."""

    __slots__ = ("name", "num_slots", "bps", "nblocks", "ref", "cached", "stacks", "ncached",
                 "buckets", "inactive", "free_active", "n_cached", "n_active", "desc", "asc", "rbuckets")

    def __init__(self, shape: GroupShape) -> None:
        if shape.num_slots < 0 or shape.blocks_per_slot < 1:
            raise ValueError(f"group {shape.name!r}: needs num_slots >= 0 and "
                             f"blocks_per_slot >= 1, got {shape}")
        self.name = shape.name
        self.num_slots = shape.num_slots
        self.bps = shape.blocks_per_slot
        n = shape.num_blocks
        self.nblocks = n
        self.ref = [0] * n
        # every block id, highest first: a fresh slot's free stack is one slice of it
        self.desc = list(range(n - 1, -1, -1))
        self.asc = self.desc[::-1]  # lowest first (the same int objects)
        self.cached = bytearray(n)
        self.stacks: list[list[int] | None] = [None] * shape.num_slots
        self.ncached = [0] * shape.num_slots
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

    def used(self, slot: int) -> int:
        """Live + cached blocks of ``slot``."""
        stack = self.stacks[slot]
        return 0 if stack is None else self.bps - len(stack)


class BlockAllocator:
    """Reference-counted, page-aware block allocator over the slots of several groups.

    ``backing`` maps and releases slots (see :class:`SlotBacking`); ``retention`` is the
    optional prefix-cache policy (see the module docstring).
    """

    def __init__(self, shapes: Iterable[GroupShape], backing: SlotBacking,
                 retention: RetentionPolicy | None = None) -> None:
        self._groups: dict[str, _Group] = {}
        for s in shapes:
            if s.name in self._groups:
                raise ValueError(f"duplicate group name {s.name!r}")
            self._groups[s.name] = _Group(s)
        # the only group when there is one (the fast paths of allocate and free use it)
        self._sole: _Group | None = (next(iter(self._groups.values()))
                                     if len(self._groups) == 1 else None)
        self.backing = backing
        self.retention = retention
        self.evictions = 0  # blocks given up by the policy under memory pressure

    # -- configuration / shape -----------------------------------------------------------
    def set_retention(self, policy: RetentionPolicy | None) -> None:
        self.retention = policy

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
        where the sequence's next blocks can follow it.

        Returns the new block ids per group (each with ref count 1), or ``None`` when the
        memory is not there now (after evicting what the retention policy gave up).
        """
        # An allocator of one group (most models; VirtualKVCache.allocate is this method):
        # decode growth runs here, with no call below; everything else is allocate_group's
        g = self._sole
        if g is not None and len(counts) == 1:
            name = g.name
            n = counts.get(name)
            if n is None:  # not this group's name
                return self._allocate_groups(counts, near)  # raises: unknown group
        elif len(counts) != 1:
            return self._allocate_groups(counts, near)
        else:
            for name, n in counts.items():
                pass
            return self._allocate_one(name, n, near)
        hint = near.get(name, -1) if near else -1
        if n == 1 and g.free_active:  # the same steps as allocate_group's
            stacks = g.stacks
            buckets = g.buckets
            stack = None
            if hint >= 0:
                slot = hint // g.bps
                try:
                    stack = stacks[slot]
                except IndexError:  # not a block of this group: no hint
                    hint = -1
            if stack:
                k = len(stack)
                bucket = buckets[k]
            else:
                for bucket in (g.rbuckets if hint >= 0 else buckets):
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
            return {name: [b]}
        got = self.allocate_group(name, n, hint)
        return None if got is None else {name: got}

    def _allocate_one(self, name: str, n: int,
                      near: Mapping[str, int] | None) -> dict[str, list[int]] | None:
        """One group of an allocator of several (e.g. the target group alone)."""
        got = self.allocate_group(name, n, near.get(name, -1) if near else -1)
        return None if got is None else {name: got}

    def allocate_group(self, group: str, n: int, near: int = -1) -> list[int] | None:
        """``allocate({group: n}, {group: near})`` for a model with one cache group (or a
        caller that allocates one group at a time): the new block ids, or ``None`` for "not
        now". ``near`` < 0: no hint. The same placement, eviction and errors."""
        g = self._groups.get(group)
        if g is None:
            return self._allocate_groups({group: n}, None)  # raises: unknown group
        fa = g.free_active
        if n == 1 and fa:  # decode growth: one block from an active slot, no call below
            stacks = g.stacks
            buckets = g.buckets
            stack = None
            if near >= 0:
                slot = near // g.bps
                try:
                    stack = stacks[slot]
                except IndexError:  # not a block of this group: no hint
                    near = -1
            if stack:
                k = len(stack)
                bucket = buckets[k]
            else:
                # the sequence's slot is full: the roomiest partial slot (the sequence's next
                # blocks follow it there); no hint: the fullest one (bucket 0 stays empty)
                for bucket in (g.rbuckets if near >= 0 else buckets):
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
            g.free_active = fa - 1
            return [b]
        if 0 <= n <= fa:
            out: list[int] = []
            if near >= 0:
                n = self._take_near(g, near, n, out)
            if n:
                self._take_partial(g, n, out)
            return out
        if n > 0:  # new slots needed (a prompt): first try without eviction
            bps = g.bps
            k = -(-(n - fa) // bps)
            inactive = g.inactive
            if k <= len(inactive):
                chosen = [heappop(inactive)]
                if k > 1:
                    for _ in range(k - 1):
                        chosen.append(heappop(inactive))
                if self.backing.activate({group: chosen}):
                    out = []
                    ref = g.ref
                    stacks = g.stacks
                    if fa:  # n > fa: every free block of the active slots goes first
                        if near >= 0:
                            n = self._take_near(g, near, n, out)
                        n -= g.free_active
                        g.free_active = 0
                        for bucket in g.buckets:  # fullest first, each stack from its top
                            if bucket:
                                for s in bucket:
                                    stack = stacks[s]
                                    stack.reverse()  # type: ignore[union-attr]
                                    out.extend(stack)  # type: ignore[arg-type]
                                    for b in stack:  # type: ignore[union-attr]
                                        ref[b] = 1
                                    stacks[s] = []
                                bucket.clear()
                    # then the new slots: all full but the last, lowest block ids first
                    asc = g.asc
                    for slot in chosen:
                        base = slot * bps
                        if n >= bps:
                            ref[base:base + bps] = [1] * bps
                            out += asc[base:base + bps]
                            stacks[slot] = []
                            n -= bps
                        else:
                            ref[base:base + n] = [1] * n
                            out += asc[base:base + n]
                            top = g.nblocks - base  # desc[top - bps] is block base + bps - 1
                            stacks[slot] = g.desc[top - bps:top - n]
                            left = bps - n
                            g.free_active += left
                            g.buckets[left][slot] = None
                    g.n_active += k
                    return out
                for slot in chosen:
                    heappush(inactive, slot)
        got = self._allocate_groups({group: n}, {group: near} if near >= 0 else None)
        return None if got is None else got[group]

    def _allocate_groups(self, counts: Mapping[str, int],
                         near: Mapping[str, int] | None) -> dict[str, list[int]] | None:
        groups = self._groups
        short = False
        for name, n in counts.items():
            if n < 0:
                raise ValueError(f"negative block count {n} for group {name!r}")
            g = groups.get(name) or self._g(name)
            if n > g.free_active:
                short = True
        if short:  # new slots (a prompt): planned, activated in one call, evicting if need be
            new_slots = self._activate_for(counts)
            if new_slots is None:
                return None
        else:  # every group fits in its active slots (decode growth): no plan to build
            new_slots = _NO_SLOTS
        result: dict[str, list[int]] = {}
        for name, n in counts.items():
            g = groups[name]
            out = []
            if near and name in near:
                hint = near[name]
                left = self._take_near(g, hint, n, out)
                if n == 1 and left and 0 <= hint < g.nblocks and g.free_active:
                    # decode growth out of a full slot: the roomiest partial slot, as in
                    # allocate_group
                    for bucket in g.rbuckets:
                        if bucket:
                            break
                    for slot in bucket:
                        break
                    stack = g.stacks[slot]
                    self._take_from(g, slot, stack, len(stack), 1, out)  # type: ignore[arg-type]
                    left = 0
                n = left
            rest = self._take_partial(g, n, out)
            for slot in new_slots.get(name, ()):
                rest = self._take_new_slot(g, slot, rest, out)
            assert rest == 0
            result[name] = out
        return result

    @staticmethod
    def _take_from(g: _Group, slot: int, stack: list[int], k: int, take: int,
                   out: list[int]) -> None:
        """Move the top ``take`` of the ``k`` free blocks of active ``slot`` to ``out`` (top
        first, ref 1) and move the slot to its new bucket."""
        got = stack[-take:]
        del stack[-take:]
        got.reverse()
        ref = g.ref
        for blk in got:
            ref[blk] = 1
        out.extend(got)
        del g.buckets[k][slot]
        if k - take:
            g.buckets[k - take][slot] = None
        g.free_active -= take

    def _take_near(self, g: _Group, block: int, n: int, out: list[int]) -> int:
        """Take up to ``n`` free blocks from the slot of ``block``; returns what is left."""
        if not n or not 0 <= block < g.nblocks:
            return n
        slot = block // g.bps
        stack = g.stacks[slot]
        if not stack:
            return n
        k = len(stack)
        take = k if n >= k else n
        self._take_from(g, slot, stack, k, take, out)
        return n - take

    def _plan(self, counts: Mapping[str, int]) -> dict[str, int] | None:
        """New slots needed per group; ``None`` when a group lacks inactive slots."""
        need: dict[str, int] = {}
        for name, n in counts.items():
            g = self._groups[name]
            short = n - g.free_active
            if short > 0:
                k = -(-short // g.bps)
                if k > len(g.inactive):
                    return None
                need[name] = k
        return need

    def _activate_for(self, counts: Mapping[str, int]) -> dict[str, list[int]] | None:
        """Activate the slots ``counts`` needs beyond free blocks, evicting cached blocks when
        the backing refuses. Returns the new slots per group, or ``None``."""
        stage_all = False
        while True:
            need = self._plan(counts)
            if need is not None:
                if not need:
                    return {}
                chosen = {name: [heapq.heappop(self._groups[name].inactive) for _ in range(k)]
                          for name, k in need.items()}
                if self.backing.activate(chosen):
                    return chosen
                for name, slots in chosen.items():
                    inactive = self._groups[name].inactive
                    for s in slots:
                        heapq.heappush(inactive, s)
            policy = self.retention
            if policy is None:
                return None
            evicted = 0
            if not stage_all:
                for name, n in counts.items():
                    g = self._groups[name]
                    short = n - g.free_active
                    if short > 0:
                        evicted += self._evict(name, short)
                if evicted == 0:
                    stage_all = True
            if stage_all:
                for name, g in self._groups.items():
                    evicted += self._evict(name, g.bps)
                if evicted == 0:
                    return None

    def _evict(self, name: str, n: int) -> int:
        g = self._groups[name]
        if g.n_cached == 0:
            return 0
        blocks = self.retention.evict(name, n, prefer_slot_emptying=True)  # type: ignore[union-attr]
        if not blocks:
            return 0
        self.release_cached(name, blocks)
        self.evictions += len(blocks)
        return len(blocks)

    def _take_partial(self, g: _Group, n: int, out: list[int]) -> int:
        """Take up to ``n`` blocks from active slots, fullest first (each slot's stack from
        its top); returns what is left."""
        buckets = g.buckets
        stacks = g.stacks
        ref = g.ref
        want = n
        while n:
            for bucket in buckets:  # bucket 0 stays empty
                if bucket:
                    break
            else:
                break
            for slot in bucket:
                break
            stack = stacks[slot]
            k = len(stack)  # type: ignore[arg-type]
            take = k if n >= k else n
            got = stack[-take:]  # type: ignore[index]
            del stack[-take:]  # type: ignore[index]
            got.reverse()
            for b in got:
                ref[b] = 1
            out.extend(got)
            del bucket[slot]
            if k - take:
                buckets[k - take][slot] = None
            n -= take
        g.free_active -= want - n
        return n

    def _take_new_slot(self, g: _Group, slot: int, n: int, out: list[int]) -> int:
        bps = g.bps
        base = slot * bps
        take = n if n < bps else bps
        g.ref[base:base + take] = [1] * take
        out += g.asc[base:base + take]
        top = g.nblocks - base
        g.stacks[slot] = g.desc[top - bps:top - take]
        g.n_active += 1
        left = bps - take
        g.free_active += left
        if left:
            g.buckets[left][slot] = None
        return n - take

    # -- references ----------------------------------------------------------------------
    def free(self, blocks: Mapping[str, Sequence[int]] | str,
             group_blocks: Sequence[int] | None = None) -> None:
        """Drop one reference from each block, in the order given. At 0 the retention policy
        may keep a block as cached; otherwise it is freed, and every slot this empties is
        released in one call. Freeing a block that holds no reference raises ``ValueError``
        and changes nothing.

        Two call forms: ``free({group: blocks, ...})`` (several groups together, SD-01) and
        ``free(group, blocks)`` (one group; the prefix cache's ``BlockBackend`` form)."""
        if blocks.__class__ is dict or (group_blocks is None and not isinstance(blocks, str)):
            # the dict form; one group without a policy (what VirtualKVCache.free is for most
            # models) runs the one-pass path below, with no call in between
            if self.retention is not None or len(blocks) != 1:
                self._free_groups(blocks)  # type: ignore[arg-type]
                return
            g = self._sole  # type: ignore[assignment]
            blks = blocks.get(g.name) if g is not None else None  # type: ignore[union-attr]
            if blks is None:
                for name, blks in blocks.items():  # type: ignore[union-attr]
                    pass
                g = self._groups.get(name) or self._g(name)
        else:
            g = self._groups.get(blocks) or self._g(blocks)  # type: ignore[arg-type]
            blks = group_blocks if group_blocks is not None else ()
            if self.retention is not None:
                emptied: dict[str, list[int]] = {}
                self._check_free(g, blks)
                self._free_blocks(g, blks, emptied)
                if emptied:
                    self.backing.deactivate(emptied)
                return
        # No retention policy: one pass drops the references; a block reaching 0 is pushed
        # on its slot's stack. Runs of blocks of one slot are recorded, then each moves its
        # slot to its new bucket once (or releases it, EL-01), in order: the same end state
        # as block by block. A double free is found in the pass, before any bucket moved:
        # what the pass did is undone (_undo_free), ValueError, nothing changed.
        if blks.__class__ is not list and blks.__class__ is not tuple:
            blks = list(blks)
        ref = g.ref
        stacks = g.stacks
        bps = g.bps
        runs: list[tuple[int, int, int]] = []  # (slot, free before the run, free after it)
        cur = -1
        k0 = 0
        stack: list[int] = []
        it = iter(blks)
        lo = hi = 0  # the blocks of slot cur
        for b in it:
            r = ref[b] - 1
            ref[b] = r
            if r:
                if r > 0:
                    continue
                self._undo_free(g, blks, len(blks) - it.__length_hint__(), runs, cur, k0)
            if lo <= b < hi:
                stack.append(b)
                continue
            if cur >= 0:
                runs.append((cur, k0, len(stack)))
            cur = b // bps
            lo = cur * bps
            hi = lo + bps
            stack = stacks[cur]  # type: ignore[assignment]
            k0 = len(stack)
            stack.append(b)
        if cur < 0:
            return
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
            self.backing.deactivate({g.name: released})

    def _free_groups(self, blocks: Mapping[str, Sequence[int]]) -> None:
        """``free({group: blocks, ...})`` with several groups or a retention policy: every
        group is checked before any changes (a refused free changes nothing), then freed."""
        groups = self._groups
        emptied: dict[str, list[int]] = {}
        for name, blks in blocks.items():
            self._check_free(groups.get(name) or self._g(name), blks)
        for name, blks in blocks.items():
            self._free_blocks(groups[name], blks, emptied)
        if emptied:
            self.backing.deactivate(emptied)

    def _undo_free(self, g: _Group, blks: Sequence[int], done: int,
                   runs: list[tuple[int, int, int]], cur: int, k0: int) -> None:
        """A double free found at entry ``done − 1`` (its count went below 0): give back
        the references the first ``done`` entries dropped, cut the stacks back to where they
        were and raise ``ValueError`` naming the block."""
        ref = g.ref
        for b in blks[:done]:
            ref[b] += 1
        first: dict[int, int] = {}
        for s, k, _ in runs:
            first.setdefault(s, k)
        if cur >= 0:
            first.setdefault(cur, k0)
        for s, k in first.items():
            del g.stacks[s][k:]  # type: ignore[index]
        self._check_free(g, blks)
        raise AssertionError("unreachable: _check_free accepted a double free")

    @staticmethod
    def _check_free(g: _Group, blks: Sequence[int]) -> None:
        """Refuse (``ValueError``, nothing changed) a free of a block without a reference."""
        ref = g.ref
        if len(blks) == 1 or len(set(blks)) == len(blks):
            if blks and min(map(ref.__getitem__, blks)) <= 0:
                b = next(b for b in blks if ref[b] <= 0)
                raise ValueError(f"free of block {b} in group {g.name!r} that holds no "
                                 "reference (double free)")
        else:
            for b, c in Counter(blks).items():
                if ref[b] < c:
                    raise ValueError(f"free of block {b} in group {g.name!r}: {c} frees, "
                                     f"{ref[b]} references (double free)")

    def _free_blocks(self, g: _Group, blks: Sequence[int],
                     emptied: dict[str, list[int]]) -> None:
        """Drop one reference from each of ``blks`` (checked) in order; at 0 ask the policy."""
        policy = self.retention
        ref = g.ref
        bps = g.bps
        stacks = g.stacks
        buckets = g.buckets
        name = g.name
        # blocks freed in a row from one slot are pushed on its stack one by one; the slot
        # changes bucket once per run (the same end state as block by block)
        cur = -1
        run = 0
        fa = 0  # change of free blocks in active slots, written back once
        stack: list[int] = []
        for b in blks:
            r = ref[b] - 1
            ref[b] = r
            if r:
                continue
            if policy is not None:
                if run:
                    g.free_active += fa
                    fa = 0
                    self._flush(g, cur, run, emptied)
                    run = 0
                    cur = -1
                if policy.on_zero_ref(name, b):
                    g.cached[b] = 1
                    g.ncached[b // bps] += 1
                    g.n_cached += 1
                    continue
            s = b // bps
            if s != cur:
                if run:  # inline _flush of the previous run
                    k = len(stack)
                    if k - run:
                        del buckets[k - run][cur]
                    if k == bps:
                        fa -= k - run
                        self._release(g, cur, 0, emptied)
                    else:
                        buckets[k][cur] = None
                        fa += run
                    run = 0
                cur = s
                stack = stacks[s]  # type: ignore[assignment]
            stack.append(b)
            run += 1
        g.free_active += fa
        if run:
            self._flush(g, cur, run, emptied)

    @staticmethod
    def _flush(g: _Group, slot: int, m: int, emptied: dict[str, list[int]]) -> None:
        """``m`` blocks of ``slot`` were just pushed on its free stack: move the slot to its
        bucket, or release it when it emptied (EL-01)."""
        k = len(g.stacks[slot])  # type: ignore[arg-type]
        old = k - m
        if old:
            del g.buckets[old][slot]
        if k == g.bps:
            BlockAllocator._release(g, slot, old, emptied)
            return
        g.buckets[k][slot] = None
        g.free_active += m

    @staticmethod
    def _release(g: _Group, slot: int, old_free: int, emptied: dict[str, list[int]]) -> None:
        """``slot`` (which had ``old_free`` free blocks before this call) emptied: it becomes
        inactive and is released with the rest of the call's emptied slots (EL-01)."""
        g.stacks[slot] = None
        g.free_active -= old_free
        g.n_active -= 1
        heapq.heappush(g.inactive, slot)
        emptied.setdefault(g.name, []).append(slot)

    def touch(self, group: str, block: int) -> None:
        """Add a reference to ``block``: a cached block is revived (ref 0 → 1,
        ``policy.on_revive`` is called); a live block gets one more reference. Touching a
        free block raises ``ValueError`` (its contents are gone)."""
        g = self._g(group)
        if g.ref[block] > 0:
            g.ref[block] += 1
            return
        if not g.cached[block]:
            raise ValueError(f"touch of free block {block} in group {group!r}: only live or "
                             "cached blocks can be referenced")
        g.cached[block] = 0
        g.ncached[block // g.bps] -= 1
        g.n_cached -= 1
        g.ref[block] = 1
        if self.retention is not None:
            self.retention.on_revive(group, block)

    def release_cached(self, group: str, blocks: Sequence[int]) -> None:
        """Free cached (ref 0) blocks that the retention policy gives up; emptied slots are
        released at once. A block that is not cached raises ``ValueError`` and nothing
        changes."""
        g = self._g(group)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"release_cached: duplicate blocks in group {group!r}")
        for b in blocks:
            if not g.cached[b]:
                state = "live" if g.ref[b] else "free"
                raise ValueError(f"release_cached: block {b} in group {group!r} is {state}, "
                                 "not cached (a pinned block is never evicted)")
        emptied: dict[str, list[int]] = {}
        bps = g.bps
        for b in blocks:
            g.cached[b] = 0
            s = b // bps
            g.ncached[s] -= 1
            g.n_cached -= 1
            g.stacks[s].append(b)  # type: ignore[union-attr]
            self._flush(g, s, 1, emptied)
        if emptied:
            self.backing.deactivate(emptied)

    # -- compaction ----------------------------------------------------------------------
    def compact(self, groups: Iterable[str] | None = None, *, max_blocks: int | None = None,
                exclude: Mapping[str, Iterable[int]] | None = None) -> Compaction:
        """Move live and cached blocks out of the sparsest active slots into free blocks of
        the densest ones, and release the slots this empties at once.

        Per group, ``⌊free blocks in active slots / B⌋`` slots can be emptied; the sparsest
        slots whose every used block may move are chosen (fewest blocks copied; among equals
        the highest slot id), their blocks go to the free blocks of the fullest remaining
        slots, lowest source block first. Nothing new is mapped. A block does not move when
        the retention policy's ``can_move`` says no (pinned by a transfer) or it is in
        ``exclude[group]``; its slot is then kept. ``max_blocks`` caps the blocks moved over
        all groups (whole slots only). ``groups``: the groups to compact (default: all).

        The backing copies the data first (``backing.move``); then the allocator moves ref
        counts and cached flags, the policy's ``on_move(group, {old: new})`` follows, and the
        emptied slots are released in one call. Returns the :class:`Compaction` (old → new per
        group: rewrite block tables with it). A failed copy changes nothing (``error`` says
        why). The caller must not touch the moved blocks' old ids afterwards, and must not
        compact while a kernel reads or writes blocks that may move.
        """
        names = list(self._groups) if groups is None else list(groups)
        for name in names:
            self._g(name)
        if max_blocks is not None and max_blocks < 0:
            raise ValueError(f"compact: max_blocks must be >= 0, got {max_blocks}")
        policy = self.retention
        on_move = getattr(policy, "on_move", None) if policy is not None else None
        if policy is not None and on_move is None:
            raise TypeError(f"compact: the retention policy {type(policy).__name__} has no "
                            "on_move(group, moves); moving blocks would leave its block index "
                            "stale. Implement on_move or compact without a policy")
        move = getattr(self.backing, "move", None)
        if move is None:
            raise TypeError(f"compact: the slot backing {type(self.backing).__name__} has no "
                            "move(moves) to copy block contents")
        can_move = getattr(policy, "can_move", None) if policy is not None else None
        budget = max_blocks
        plans: dict[str, tuple[list[int], dict[int, int], dict[int, int]]] = {}
        for name in names:
            g = self._groups[name]
            k_max = g.free_active // g.bps
            if k_max == 0 or (budget is not None and budget <= 0):
                continue
            excl = set(exclude.get(name, ())) if exclude else set()
            ref = g.ref
            cached = g.cached
            bps = g.bps
            cands: list[tuple[int, int]] = []
            for s, stack in enumerate(g.stacks):
                if stack is None or len(stack) == 0:
                    continue
                ok = True
                for b in range(s * bps, (s + 1) * bps):
                    if ref[b] or cached[b]:
                        if b in excl or (can_move is not None and not can_move(name, b)):
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
                for s in g.buckets[kk]:
                    if s in src_set:
                        continue
                    stack = g.stacks[s]
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
            ncached = g.ncached
            bps = g.bps
            for s, t in taken.items():  # destination stacks give up their top t blocks
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
                if cached[old]:
                    cached[old] = 0
                    cached[new] = 1
                    ncached[old // bps] -= 1
                    ncached[new // bps] += 1
            for s in sources:  # every block of a source is free now: release it
                k = len(g.stacks[s])  # type: ignore[arg-type]
                del g.buckets[k][s]
                g.stacks[s] = None
                g.free_active -= k
                g.n_active -= 1
                heapq.heappush(g.inactive, s)
            emptied[name] = sorted(sources)
        if on_move is not None:
            for name, p in plans.items():
                on_move(name, dict(p[1]))
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
        return g.used(slot) - g.ncached[slot]

    def slot_cached(self, group: str, slot: int) -> int:
        """Cached (ref 0, retained) blocks of ``slot``."""
        return self._g(group).ncached[slot]

    def block_info(self, group: str, block: int) -> BlockInfo:
        g = self._g(group)
        if not 0 <= block < len(g.ref):
            raise IndexError(f"block {block} outside group {group!r} ({len(g.ref)} blocks)")
        return BlockInfo(group, block, block // g.bps, g.ref[block], bool(g.cached[block]))

    def slot_info(self, group: str, slot: int) -> SlotInfo:
        g = self._g(group)
        stack = g.stacks[slot]
        active = stack is not None
        return SlotInfo(group, slot, active, g.used(slot) - g.ncached[slot], g.ncached[slot],
                        len(stack) if active else 0)  # type: ignore[arg-type]

    def active_slots(self, group: str) -> list[int]:
        g = self._g(group)
        return [s for s in range(g.num_slots) if g.stacks[s] is not None]

    def num_active_slots(self, group: str) -> int:
        return self._g(group).n_active

    def num_inactive_slots(self, group: str) -> int:
        return len(self._g(group).inactive)

    def num_free_blocks(self, group: str) -> int:
        """Free blocks in active slots (usable without mapping anything)."""
        return self._g(group).free_active

    def num_live_blocks(self, group: str) -> int:
        return self._g(group).n_live

    def num_cached_blocks(self, group: str) -> int:
        return self._g(group).n_cached

    def num_evictable(self, group: str) -> int:
        """Cached blocks the retention policy says it can give up (0 without a policy)."""
        if self.retention is None:
            return 0
        return self.retention.num_evictable(group)

    def check_invariants(self) -> None:
        """Recount everything from scratch and raise ``AssertionError`` on any mismatch."""
        for g in self._groups.values():
            n_live = n_cached = n_active = free_active = 0
            inactive = set(g.inactive)
            assert len(inactive) == len(g.inactive), f"{g.name}: inactive heap has duplicates"
            for s in range(g.num_slots):
                blocks = range(s * g.bps, (s + 1) * g.bps)
                live = sum(1 for b in blocks if g.ref[b] > 0)
                cached = sum(1 for b in blocks if g.cached[b])
                assert all(not (g.ref[b] and g.cached[b]) for b in blocks), \
                    f"{g.name}: a block in slot {s} is both live and cached"
                assert all(g.ref[b] >= 0 for b in blocks)
                stack = g.stacks[s]
                if stack is None:
                    assert live == cached == 0, f"{g.name}: slot {s} inactive but holds blocks"
                    assert s in inactive, f"{g.name}: slot {s} neither active nor inactive"
                    assert g.ncached[s] == 0
                    continue
                assert s not in inactive, f"{g.name}: active slot {s} is in the inactive heap"
                assert live + cached >= 1, f"{g.name}: active slot {s} holds no block"
                assert g.ncached[s] == cached
                free = [b for b in blocks if not g.ref[b] and not g.cached[b]]
                assert sorted(stack) == free, f"{g.name}: slot {s} free list {stack} != {free}"
                k = len(stack)
                for kk in range(1, g.bps):
                    assert (s in g.buckets[kk]) == (kk == k), \
                        f"{g.name}: slot {s} with {k} free blocks in bucket {kk}"
                n_live += live
                n_cached += cached
                n_active += 1
                free_active += k
            assert (n_live, n_cached, n_active, free_active) == (
                g.n_live, g.n_cached, g.n_active, g.free_active), f"{g.name}: counters drifted"
