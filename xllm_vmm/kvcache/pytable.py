"""The pure-Python block state of one cache group: :class:`PyBlockState`, the
:class:`~xllm_vmm.kvcache.block_state.BlockState` that runs when ``libxllm_kvtable.so`` is not
built, with ``XLLM_VMM_KVTABLE=python`` or ``BlockAllocator(native=False)``.

Bookkeeping (O(1) amortised per block, no per-block objects): every active slot has a free
*stack* (a list of its free block ids, top = next one handed out); ``buckets[k]`` is an
insertion-ordered set (a dict) of the active slots with exactly ``k`` free blocks
(``1 ≤ k < B``), so "fullest partial slot" is the first slot of the first non-empty bucket (at
most ``B − 1`` probes; the roomiest is the first slot of the last non-empty one). A call moves a
slot between buckets once per run of blocks it takes from or returns to that slot, not once per
block. Occupancy and the live count are derived (``B − len(stack)``,
``active × B − free − cached``), not stored. A fresh slot's stack is one slice of a per-group
list of every block id, highest first. The inactive slots are a heap (lowest id first).

A free is one pass (:meth:`PyBlockState.release`): drop the reference; at 0 a retained or
pinned block becomes cached, any other is pushed on its slot's stack, noting each run of one
slot; then one bucket move (or release) per run. A refused entry undoes the pass before any
bucket moved, so a refused free changes nothing.
"""

from __future__ import annotations

from heapq import heappop, heappush
from itertools import islice
from typing import Sequence

from xllm_vmm.kvcache.block_state import (
    BlockStateBase,
    GroupShape,
    SlotBacking,
    check_free,
    check_shape,
    double_free,
    not_a_block,
)

__all__ = ["PyBlockState"]

_NOTHING: tuple[int, ...] = ()  # no slot released


class PyBlockState(BlockStateBase):
    """Mutable state of one group over lists, dicts and a heap (see the module docstring).
    ``stacks[s]`` is slot ``s``'s free stack, or ``None`` while the slot is inactive."""

    __slots__ = ("name", "num_slots", "bps", "nblocks", "ref", "cached", "keep", "retains",
                 "pins", "stacks", "buckets", "rbuckets", "inactive", "free_active",
                 "n_cached", "n_active", "desc", "asc", "backing")

    native = False

    def __init__(self, shape: GroupShape, backing: SlotBacking) -> None:
        check_shape(shape)
        self.name = shape.name
        self.num_slots = shape.num_slots
        self.bps = shape.blocks_per_slot
        n = shape.num_blocks
        self.nblocks = n
        self.backing = backing
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

    # -- derived counts --------------------------------------------------------------------
    @property
    def n_live(self) -> int:
        return self.n_active * self.bps - self.free_active - self.n_cached

    @property
    def n_inactive(self) -> int:
        return len(self.inactive)

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

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, n: int, hint: int = -1) -> list[int] | None:
        """``n`` new blocks (see :meth:`BlockState.allocate`). The one allocation path of the
        Python passes: one-block decode growth, blocks of active slots, new slots."""
        if n == 1 and self.free_active:
            # decode growth, the one place it is written: one block from an active
            # slot — the hint's slot, else (hinted slot full) the roomiest partial slot,
            # else (no hint) the fullest
            stacks = self.stacks
            buckets = self.buckets
            if 0 <= hint < self.nblocks:
                slot = hint // self.bps
                stack = stacks[slot]
                roomiest = True
            else:
                stack = roomiest = None
            if stack:
                bucket = buckets[len(stack)]
            else:
                for bucket in (self.rbuckets if roomiest else buckets):
                    if bucket:
                        break
                for slot in bucket:
                    break
                stack = stacks[slot]
            k = len(stack)  # type: ignore[arg-type]
            b = stack.pop()  # type: ignore[union-attr]
            self.ref[b] = 1
            del bucket[slot]
            if k > 1:
                buckets[k - 1][slot] = None
            self.free_active -= 1
            return [b]
        fa = self.free_active
        if n <= fa:  # take without new slots: the hint's slot, then partial, fullest first
            if n < 0:
                raise ValueError(f"negative block count {n} for group {self.name!r}")
            out: list[int] = []
            if n:
                if 0 <= hint < self.nblocks:
                    n = self._take_near(hint, n, out)
                if n:
                    self._take_partial(n, out)
            return out
        # new slots (a prompt, or growth with every active slot full): the lowest inactive
        # ones, activated in one backing call
        k = -(-(n - fa) // self.bps)
        inactive = self.inactive
        if k > len(inactive):
            return None
        chosen = [heappop(inactive)] if k == 1 else [heappop(inactive) for _ in range(k)]
        return self._activate_and_take(n, hint, chosen)

    def pop_inactive(self, k: int) -> list[int] | None:
        inactive = self.inactive
        if k > len(inactive):
            return None
        return [heappop(inactive) for _ in range(k)]

    def push_inactive(self, slots: list[int]) -> None:
        inactive = self.inactive
        for s in slots:
            heappush(inactive, s)

    def take(self, n: int, hint: int, new_slots: list[int]) -> list[int]:
        """Hand out ``n`` blocks: the hint's slot, then partial slots (fullest first), then
        ``new_slots`` (just activated: all full but the last, lowest ids first)."""
        out: list[int] = []
        if n == 0:
            return out
        if 0 <= hint < self.nblocks:
            n = self._take_near(hint, n, out)
        if n and self.free_active:
            n = self._take_partial(n, out)
        for slot in new_slots:
            n = self._take_new_slot(slot, n, out)
        assert n == 0, "allocator planned fewer blocks than it hands out"
        return out

    def _take_near(self, block: int, n: int, out: list[int]) -> int:
        """Take up to ``n`` free blocks from the slot of ``block``; returns what is left."""
        slot = block // self.bps
        stack = self.stacks[slot]
        if not stack:
            return n
        k = len(stack)
        take = k if n >= k else n
        got = stack[-take:]
        del stack[-take:]
        got.reverse()
        ref = self.ref
        for b in got:
            ref[b] = 1
        out.extend(got)
        del self.buckets[k][slot]
        if k - take:
            self.buckets[k - take][slot] = None
        self.free_active -= take
        return n - take

    def _take_partial(self, n: int, out: list[int]) -> int:
        """Take up to ``n`` blocks from active slots, fullest first (each slot's stack from
        its top); returns what is left. One pass up the buckets: a slot taken whole leaves
        them, so the next fullest is the next slot of the same bucket or of a later one; only
        the last slot can be taken in part (it moves to a lower bucket and the pass ends)."""
        buckets = self.buckets
        stacks = self.stacks
        ref = self.ref
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
        self.free_active -= want - n
        return n

    def _take_new_slot(self, slot: int, n: int, out: list[int]) -> int:
        bps = self.bps
        base = slot * bps
        take = n if n < bps else bps
        self.ref[base:base + take] = [1] * take
        out += self.asc[base:base + take]
        top = self.nblocks - base  # desc[top - bps] is block base + bps - 1
        self.stacks[slot] = self.desc[top - bps:top - take]
        self.n_active += 1
        left = bps - take
        self.free_active += left
        if left:
            self.buckets[left][slot] = None
        return n - take

    # -- free ------------------------------------------------------------------------------
    def free_lru(self, blocks: Sequence[int], lru: dict[int, None]) -> list[int] | None:
        kept, released = self.release(blocks[::-1], lru)
        if released:
            self.backing.deactivate({self.name: released})
        return kept

    def release(self, blocks: Sequence[int], lru: dict[int, None] | None = None
                ) -> tuple[list[int] | None, Sequence[int]]:
        """The one freeing pass over ``blocks`` (see the module docstring): (blocks that
        became cached and are not in ``lru`` or ``None``, slots emptied — the caller releases
        them). With ``lru``, a retained, unpinned block reaching ref 0 is appended to it
        instead (pinned ones are returned). A refused entry undoes the pass and raises
        ``ValueError`` (see :meth:`_refuse`)."""
        ref = self.ref
        keep = self.keep
        pins = self.pins
        cached = self.cached
        stacks = self.stacks
        bps = self.bps
        # no block can be retained or pinned (no prefix cache, no transfer): skip the flags
        keepable = self.retains or bool(pins)
        kept: list[int] | None = None
        n_lru = 0
        runs: list[tuple[int, int, int]] = []  # (slot, free before the run, free after it)
        cur = -1
        lo = hi = k0 = 0  # the blocks of slot cur; its stack's length before the run
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
                if keepable and (keep[b] or (pins and b in pins)):  # retained or pinned
                    if b < 0:
                        raise IndexError
                    cached[b] = 1
                    if lru is not None and not (pins and b in pins):
                        lru[b] = None
                        n_lru += 1
                    elif kept is None:
                        kept = [b]
                    else:
                        kept.append(b)
                    continue
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
            runs.append((cur, k0, 0))
            self._refuse(blocks, len(blocks) - it.__length_hint__(), runs, lru)
        if kept or n_lru:
            self.n_cached += n_lru + (len(kept) if kept else 0)
        if cur < 0:
            return kept, _NOTHING
        runs.append((cur, k0, len(stack)))
        return kept, self._settle(runs)

    def _settle(self, runs: list[tuple[int, int, int]]) -> Sequence[int]:
        """The bucket move (or release) of each run of a free; returns the slots emptied."""
        buckets = self.buckets
        stacks = self.stacks
        bps = self.bps
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
        self.free_active += fa
        if released is None:
            return _NOTHING
        self.n_active -= len(released)
        inactive = self.inactive
        for s in released:
            heappush(inactive, s)
        return released

    def _refuse(self, blocks: Sequence[int], done: int, runs: list[tuple[int, int, int]],
                lru: dict[int, None] | None) -> None:
        """Entry ``done - 1`` of a free was refused: give back the references the first
        ``done`` entries dropped, un-cache what they cached (out of ``lru`` too), cut the
        stacks back (``runs``: each run's slot and its stack length before it; a slot of
        ``-1`` is none), and raise ``ValueError`` naming the block — with ``lru``, the
        refused entry; else the first refusal :func:`check_free` finds."""
        ref = self.ref
        cached = self.cached
        items = list(blocks)[:done]
        bad = items.pop() if items else None
        try:
            ref[bad] += 1  # type: ignore[index]  # its reference dropped before the refusal
        except (IndexError, TypeError):
            pass
        for b in reversed(items):  # each was accepted: it held a reference before this call
            if cached[b] and not ref[b]:  # cached by this entry
                cached[b] = 0
                if lru is not None:
                    lru.pop(b, None)
            ref[b] += 1
        first: dict[int, int] = {}
        for s, k, _ in runs:
            if s >= 0:
                first.setdefault(s, k)
        for s, k in first.items():
            del self.stacks[s][k:]  # type: ignore[index]
        if not isinstance(bad, int) or not 0 <= bad < self.nblocks:
            raise not_a_block(self, bad) from None
        if lru is None:
            check_free(self, blocks)
        raise double_free(self, bad) from None

    def push_free(self, block: int) -> bool:
        """Block ``block`` (ref 0, not cached) goes on its slot's free stack: one bucket move,
        or the slot leaves the active set when it empties (returns ``True``: the caller
        releases it)."""
        bps = self.bps
        s = block // bps
        stack = self.stacks[s]
        k0 = len(stack)  # type: ignore[arg-type]
        stack.append(block)  # type: ignore[union-attr]
        buckets = self.buckets
        if k0:
            del buckets[k0][s]
        if k0 + 1 == bps:
            self.stacks[s] = None
            self.free_active -= k0
            self.n_active -= 1
            heappush(self.inactive, s)
            return True
        buckets[k0 + 1][s] = None
        self.free_active += 1
        return False

    # -- compaction ------------------------------------------------------------------------
    def drop_top(self, slot: int, take: int) -> None:
        stack = self.stacks[slot]
        k = len(stack)  # type: ignore[arg-type]
        del stack[k - take:]  # type: ignore[index]
        del self.buckets[k][slot]
        if k - take:
            self.buckets[k - take][slot] = None
        self.free_active -= take

    def release_slot(self, slot: int) -> None:
        k = len(self.stacks[slot])  # type: ignore[arg-type]
        del self.buckets[k][slot]
        self.stacks[slot] = None
        self.free_active -= k
        self.n_active -= 1
        heappush(self.inactive, slot)

    def check(self) -> None:
        """Nothing beyond the allocator's recount: the stacks, buckets and heap are the state
        it reads."""
