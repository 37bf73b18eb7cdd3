"""Page-aware block allocation over slots, with reference counts and a retention hook.

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
- Introspection for page-aware eviction: :meth:`block_info` (group, slot, ref count, cached),
  :meth:`slot_info` (live / cached / free counts of a slot), :meth:`slot_live`,
  :meth:`slot_cached`, :meth:`slot_of`, :meth:`blocks_of_slot`.
- ``free`` also takes the one-group form ``free(group, blocks)``, so a
  :class:`BlockAllocator` is the prefix cache's ``BlockBackend`` as it is.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

__all__ = [
    "BlockAllocator",
    "BlockInfo",
    "GroupShape",
    "RetentionPolicy",
    "SlotBacking",
    "SlotInfo",
]


@runtime_checkable
class RetentionPolicy(Protocol):
    """What the prefix cache implements (see the module docstring)."""

    def on_zero_ref(self, group: str, block: int) -> bool: ...

    def on_revive(self, group: str, block: int) -> None: ...

    def evict(self, group: str, n_blocks: int, prefer_slot_emptying: bool = True) -> list[int]: ...

    def num_evictable(self, group: str) -> int: ...


class SlotBacking(Protocol):
    """Puts memory under slots. ``activate`` is all-or-nothing over every group it is given
    (one batched map) and returns ``False`` for "not now"; ``deactivate`` releases at once."""

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


class _Group:
    """Mutable state of one group (internal)."""

    __slots__ = ("name", "num_slots", "bps", "ref", "cached", "stacks", "occ", "ncached",
                 "buckets", "inactive", "free_active", "n_live", "n_cached", "n_active")

    def __init__(self, shape: GroupShape) -> None:
        if shape.num_slots < 0 or shape.blocks_per_slot < 1:
            raise ValueError(f"group {shape.name!r}: needs num_slots >= 0 and "
                             f"blocks_per_slot >= 1, got {shape}")
        self.name = shape.name
        self.num_slots = shape.num_slots
        self.bps = shape.blocks_per_slot
        n = shape.num_blocks
        self.ref = [0] * n
        self.cached = bytearray(n)
        self.stacks: list[list[int] | None] = [None] * shape.num_slots
        self.occ = [0] * shape.num_slots  # live + cached blocks per slot
        self.ncached = [0] * shape.num_slots
        # buckets[k]: active slots with exactly k free blocks, 1 <= k < bps (ordered sets)
        self.buckets: list[dict[int, None]] = [{} for _ in range(self.bps)]
        self.inactive = list(range(shape.num_slots))  # a heap (sorted list is a valid heap)
        self.free_active = 0
        self.n_live = 0
        self.n_cached = 0
        self.n_active = 0


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
        sequence's blocks stay together and a finished sequence empties whole slots.

        Returns the new block ids per group (each with ref count 1), or ``None`` when the
        memory is not there now (after evicting what the retention policy gave up).
        """
        groups = self._groups
        # fast path: one group, enough free blocks in active slots
        if len(counts) == 1:
            (name, n), = counts.items()
            g = groups.get(name) or self._g(name)
            if n <= g.free_active:
                if n < 0:
                    raise ValueError(f"negative block count {n} for group {name!r}")
                out: list[int] = []
                if near and name in near:
                    n = self._take_near(g, near[name], n, out)
                self._take_partial(g, n, out)
                return {name: out}
        for name, n in counts.items():
            if n < 0:
                raise ValueError(f"negative block count {n} for group {name!r}")
            self._g(name)
        new_slots = self._activate_for(counts)
        if new_slots is None:
            return None
        result: dict[str, list[int]] = {}
        for name, n in counts.items():
            g = groups[name]
            out = []
            if near and name in near:
                n = self._take_near(g, near[name], n, out)
            rest = self._take_partial(g, n, out)
            for slot in new_slots.get(name, ()):
                rest = self._take_new_slot(g, slot, rest, out)
            assert rest == 0
            result[name] = out
        return result

    def _take_near(self, g: _Group, block: int, n: int, out: list[int]) -> int:
        """Take up to ``n`` free blocks from the slot of ``block``; returns what is left."""
        if not n or not 0 <= block < len(g.ref):
            return n
        slot = block // g.bps
        stack = g.stacks[slot]
        if not stack:
            return n
        k = len(stack)
        take = k if n >= k else n
        ref = g.ref
        for _ in range(take):
            blk = stack.pop()
            ref[blk] = 1
            out.append(blk)
        del g.buckets[k][slot]
        if k - take:
            g.buckets[k - take][slot] = None
        g.occ[slot] += take
        g.free_active -= take
        g.n_live += take
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
        """Take up to ``n`` blocks from active slots, fullest first; returns what is left."""
        buckets = g.buckets
        bps = g.bps
        ref = g.ref
        while n:
            for k in range(1, bps):
                b = buckets[k]
                if b:
                    break
            else:
                return n
            slot = next(iter(b))
            take = k if n >= k else n
            stack = g.stacks[slot]
            for _ in range(take):
                blk = stack.pop()  # type: ignore[union-attr]
                ref[blk] = 1
                out.append(blk)
            del b[slot]
            if k - take:
                buckets[k - take][slot] = None
            g.occ[slot] += take
            g.free_active -= take
            g.n_live += take
            n -= take
        return 0

    def _take_new_slot(self, g: _Group, slot: int, n: int, out: list[int]) -> int:
        bps = g.bps
        base = slot * bps
        take = min(n, bps)
        ref = g.ref
        for blk in range(base, base + take):
            ref[blk] = 1
            out.append(blk)
        g.stacks[slot] = list(range(base + bps - 1, base + take - 1, -1))
        g.occ[slot] = take
        g.n_active += 1
        g.n_live += take
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
        if isinstance(blocks, str):
            blocks = {blocks: group_blocks if group_blocks is not None else ()}
        for name, blks in blocks.items():
            g = self._g(name)
            ref = g.ref
            if len(blks) == 1 or len(set(blks)) == len(blks):
                for b in blks:
                    if ref[b] <= 0:
                        raise ValueError(f"free of block {b} in group {name!r} that holds no "
                                         "reference (double free)")
            else:
                for b, c in Counter(blks).items():
                    if ref[b] < c:
                        raise ValueError(f"free of block {b} in group {name!r}: {c} frees, "
                                         f"{ref[b]} references (double free)")
        emptied: dict[str, list[int]] = {}
        policy = self.retention
        for name, blks in blocks.items():
            g = self._groups[name]
            ref = g.ref
            for b in blks:
                r = ref[b] - 1
                ref[b] = r
                if r:
                    continue
                g.n_live -= 1
                if policy is not None and policy.on_zero_ref(name, b):
                    g.cached[b] = 1
                    g.ncached[b // g.bps] += 1
                    g.n_cached += 1
                    continue
                self._put_free(g, b, emptied)
        if emptied:
            self.backing.deactivate(emptied)

    def _put_free(self, g: _Group, b: int, emptied: dict[str, list[int]]) -> None:
        slot = b // g.bps
        stack = g.stacks[slot]
        k = len(stack)  # type: ignore[arg-type]
        if k:
            del g.buckets[k][slot]
        occ = g.occ[slot] - 1
        g.occ[slot] = occ
        if occ == 0:  # the slot empties: release it at once (EL-01)
            g.stacks[slot] = None
            g.free_active -= k
            g.n_active -= 1
            heapq.heappush(g.inactive, slot)
            emptied.setdefault(g.name, []).append(slot)
            return
        stack.append(b)  # type: ignore[union-attr]
        g.buckets[k + 1][slot] = None
        g.free_active += 1

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
        g.n_live += 1
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
        for b in blocks:
            g.cached[b] = 0
            g.ncached[b // g.bps] -= 1
            g.n_cached -= 1
            self._put_free(g, b, emptied)
        if emptied:
            self.backing.deactivate(emptied)

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
        return g.occ[slot] - g.ncached[slot]

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
        return SlotInfo(group, slot, active, g.occ[slot] - g.ncached[slot], g.ncached[slot],
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
                    assert g.occ[s] == 0 and g.ncached[s] == 0
                    continue
                assert s not in inactive, f"{g.name}: active slot {s} is in the inactive heap"
                assert live + cached >= 1, f"{g.name}: active slot {s} holds no block"
                assert g.occ[s] == live + cached and g.ncached[s] == cached
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
