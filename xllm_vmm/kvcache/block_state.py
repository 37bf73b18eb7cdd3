"""The block-state protocol: what :class:`~xllm_vmm.kvcache.allocator.BlockAllocator` asks of
the state of one cache group, and what its two backends implement the same way.

A :class:`BlockState` holds one group's block state (reference counts, cached / retained /
pinned flags, per-slot free stacks, the buckets of partial slots, the inactive slots, the
counters; the terms are the allocator's, see :mod:`xllm_vmm.kvcache.allocator`) and runs the
passes that change it:

- :class:`~xllm_vmm.kvcache.pytable.PyBlockState` — lists, ordered dicts and a heap, changed
  by Python passes (:mod:`xllm_vmm.kvcache.pytable`);
- :class:`~xllm_vmm.kvcache.kvtable.NativeBlockState` — flat arrays changed by the C passes of
  ``libxllm_kvtable.so`` (:mod:`xllm_vmm.kvcache.kvtable`), one ctypes call per verb.

Both hand out the same block ids in the same order, make the same slot choices and refuse the
same frees with the same messages (``tests/kvcache/test_kvtable.py`` runs them in lockstep
through this protocol). The allocator reads the per-block arrays (``ref``, ``cached``,
``keep``) and the counters, which mean the same in both, and writes the arrays only where
no slot changes (a reference added, a flag set or moved).

The one-group verbs (:meth:`BlockState.allocate`, :meth:`BlockState.free`,
:meth:`BlockState.free_lru`) map and release slots through the state's ``backing`` themselves
(the allocator's hot paths call them directly); the passes of a verb over several groups
(:meth:`BlockState.take`, :meth:`BlockState.release`, :meth:`BlockState.push_free`) leave the
backing call to the caller, which makes one for every group together.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, MutableSequence, Protocol, Sequence, runtime_checkable

__all__ = ["BlockState", "BlockStateBase", "GroupShape", "SlotBacking", "check_free",
           "check_shape", "double_free", "first_refused", "not_a_block"]


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


def check_shape(shape: GroupShape) -> None:
    if shape.num_slots < 0 or shape.blocks_per_slot < 1:
        raise ValueError(f"group {shape.name!r}: needs num_slots >= 0 and "
                         f"blocks_per_slot >= 1, got {shape}")


@runtime_checkable
class BlockState(Protocol):
    """The state of one group and its passes (see the module docstring).

    Read by the allocator: ``ref`` (references per block), ``cached`` (ref 0 and kept),
    ``keep`` (retained), ``pins`` (block → transfer pins), ``retains`` (``False`` until a
    block of the group may be retained: while ``False`` a free skips the flags), the counters
    and the views ``stacks`` (each slot's free stack, bottom first, ``None`` while inactive),
    ``buckets`` (``buckets[k]``: the active slots with ``k`` free blocks, oldest entry first)
    and ``inactive`` (the inactive slots, heap order). The views of the native state are
    copies: change the state only through the methods."""

    name: str
    num_slots: int
    bps: int
    nblocks: int
    ref: MutableSequence[int]
    cached: bytearray
    keep: bytearray
    pins: dict[int, int]
    retains: bool
    backing: SlotBacking
    n_cached: int

    @property
    def free_active(self) -> int:
        """Free blocks in active slots."""

    @property
    def n_active(self) -> int: ...

    @property
    def n_inactive(self) -> int: ...

    @property
    def n_live(self) -> int: ...

    @property
    def stacks(self) -> Sequence[Sequence[int] | None]: ...

    @property
    def buckets(self) -> Sequence[Mapping[int, None]]: ...

    @property
    def inactive(self) -> Sequence[int]: ...

    @property
    def ncached(self) -> list[int]:
        """Cached blocks per slot."""

    def used(self, slot: int) -> int:
        """Live + cached blocks of ``slot`` (0 while inactive)."""

    def stack_len(self, slot: int) -> int:
        """Free blocks of ``slot``; -1 while it is inactive."""

    def ncached_of(self, slot: int) -> int:
        """Cached blocks of ``slot``, counted from the flags."""

    # -- one-group verbs (the backing is called here) --------------------------------------
    def allocate(self, n: int, hint: int = -1) -> list[int] | None:
        """``n`` new blocks (ref 1 each): the slot of ``hint`` first (a block the sequence
        holds; ``-1`` or a block outside the group: no hint), then partial slots, then the
        lowest inactive slots, activated in one backing call; ``None`` ("not now": nothing
        changed) when the group or the backing cannot take them."""

    def free(self, blocks: Sequence[int]) -> list[int] | None:
        """Drop one reference from each of ``blocks`` in the order given; at 0 a retained or
        pinned block becomes cached (returned; ``None`` when none did), any other is freed and
        the slots this empties are released in one backing call. A block without a reference,
        or not a block of the group, raises ``ValueError`` and nothing changes."""

    def free_lru(self, blocks: Sequence[int], lru: dict[int, None]) -> list[int] | None:
        """:meth:`free` tail first (``blocks[-1]`` first); a retained, unpinned block reaching
        ref 0 becomes cached and is appended to ``lru``; a pinned one becomes cached and is
        returned (``None`` when none). Refused as :meth:`free` (``lru`` unchanged)."""

    # -- passes of verbs over several groups (the caller calls the backing) ----------------
    def pop_inactive(self, k: int) -> list[int] | None:
        """The ``k`` lowest inactive slots (taken off the heap), or ``None`` when fewer."""

    def push_inactive(self, slots: list[int]) -> None:
        """Give back slots :meth:`pop_inactive` took (their activation was refused)."""

    def take(self, n: int, hint: int, new_slots: list[int]) -> list[int]:
        """``n`` blocks: the hint's slot, partial slots (fullest first), then ``new_slots``
        (just activated: all full but the last, lowest ids first)."""

    def release(self, blocks: Sequence[int]) -> tuple[list[int] | None, list[int]]:
        """:meth:`free`'s pass over ``blocks`` already checked by :func:`check_free`: (blocks
        that became cached or ``None``, slots emptied — the caller releases them)."""

    def push_free(self, block: int) -> bool:
        """``block`` (ref 0, no longer cached) onto its slot's stack; ``True`` when the slot
        emptied (now inactive: the caller releases it)."""

    # -- compaction ------------------------------------------------------------------------
    def drop_top(self, slot: int, take: int) -> None:
        """``slot``'s stack gives up its top ``take`` blocks (compaction moved blocks in)."""

    def release_slot(self, slot: int) -> None:
        """Every block of active ``slot`` is free now: it becomes inactive."""

    # -- transfer pins ---------------------------------------------------------------------
    def pin(self, block: int) -> None:
        """One more transfer pin on ``block``."""

    def unpin(self, block: int) -> bool:
        """One pin fewer on pinned ``block``; ``True`` when that was its last."""

    def check(self) -> None:
        """The backend's own structure is consistent (``AssertionError`` otherwise)."""


class BlockStateBase:
    """What both backends write the same way over their own passes (a base of each; its
    methods use the protocol's members only)."""

    __slots__ = ()

    name: str
    backing: SlotBacking
    pins: dict[int, int]

    def free(self, blocks: Sequence[int]) -> list[int] | None:
        """:meth:`BlockState.free`: the backend's :meth:`BlockState.release` pass, then the
        slots it emptied released in one backing call."""
        kept, released = self.release(blocks)  # type: ignore[attr-defined]
        if released:
            self.backing.deactivate({self.name: released})
        return kept

    def _activate_and_take(self, n: int, hint: int, chosen: list[int]) -> list[int] | None:
        """``chosen`` (just taken off the inactive heap) activated in one backing call and the
        ``n`` blocks taken; refused, the slots go back and the answer is ``None``."""
        if not self.backing.activate({self.name: chosen}):
            self.push_inactive(chosen)  # type: ignore[attr-defined]
            return None
        return self.take(n, hint, chosen)  # type: ignore[attr-defined]

    def pin(self, block: int) -> None:
        self.pins[block] = self.pins.get(block, 0) + 1
        self._flag_pinned(block, 1)

    def unpin(self, block: int) -> bool:
        c = self.pins[block]
        if c > 1:
            self.pins[block] = c - 1
            return False
        del self.pins[block]
        self._flag_pinned(block, 0)
        return True

    def _flag_pinned(self, block: int, pinned: int) -> None:
        """A backend that keeps a per-block pinned flag besides ``pins`` sets it here."""


# -- refusals: the one wording of both backends ---------------------------------------------
def not_a_block(g: BlockState, b: object) -> ValueError:
    return ValueError(f"free of block {b!r}: not a block of group {g.name!r} "
                      f"(0..{g.nblocks - 1})")


def double_free(g: BlockState, b: int) -> ValueError:
    return ValueError(f"free of block {b} in group {g.name!r} that holds no reference "
                      "(double free)")


def _is_block(g: BlockState, b: object) -> bool:
    return isinstance(b, int) and 0 <= b < g.nblocks


def check_free(g: BlockState, blocks: Sequence[int]) -> None:
    """Refuse (``ValueError``, nothing changed) a free of ``blocks`` that names a block outside
    the group or drops a reference a block does not hold."""
    if not blocks:
        return
    ref = g.ref
    try:
        low = min(map(ref.__getitem__, blocks))
        negative = min(blocks) < 0  # (a negative index would read another block)
    except (IndexError, TypeError):
        raise not_a_block(g, next(b for b in blocks if not _is_block(g, b))) from None
    if negative:
        raise not_a_block(g, next(b for b in blocks if b < 0))
    if low <= 0:
        raise double_free(g, next(b for b in blocks if ref[b] <= 0))
    if len(blocks) > 1 and len(set(blocks)) != len(blocks):
        for b, c in Counter(blocks).items():
            if ref[b] < c:
                raise ValueError(f"free of block {b} in group {g.name!r}: {c} frees, "
                                 f"{ref[b]} references (double free)")


def first_refused(g: BlockState, blocks: Iterable[object]) -> int:
    """Index of the first entry of a free that is refused: no block of the group, or a block
    with no reference left after the entries before it."""
    seen: Counter[int] = Counter()
    for i, b in enumerate(blocks):
        if not _is_block(g, b):
            return i
        seen[b] += 1  # type: ignore[index]
        if g.ref[b] < seen[b]:  # type: ignore[index]
            return i
    return -1
