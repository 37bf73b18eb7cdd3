"""Compaction of the allocator's groups: live and cached blocks move out of the sparsest
active slots into free blocks of the densest ones, and the emptied slots are released.

Placement is decided before lifetimes are known: a long-running sequence's decode blocks land
in slots shared with short sequences, and when those finish their slots stay mapped for one or
two blocks. :meth:`~xllm_vmm.kvcache.allocator.BlockAllocator.compact` (this module's
:func:`compact`) undoes that when the caller chooses (idle or lightly loaded, between engine
steps). It never activates a slot (the budget cannot be exceeded), never moves a pinned block
or one the caller excludes, and returns the old → new mapping per group: the caller (the
manager) rewrites its block tables and the prefix cache's index with it. The data is copied by
the backing's ``move(moves) -> bool`` (the virtual KV cache: one batched device-to-device copy
across every tensor of the group); ``False`` (a copy failed) changes nothing.

It works on any :class:`~xllm_vmm.kvcache.block_state.BlockState`: the plan reads the views and
the flags, the moves write the per-block arrays, and the stacks change through
``drop_top`` / ``release_slot``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from xllm_vmm.kvcache.block_state import BlockState

__all__ = ["Compaction", "compact"]


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


# one group's plan: (source slots, old -> new block, destination slot -> blocks taken)
_Plan = tuple[list[int], dict[int, int], dict[int, int]]


def compact(states: Mapping[str, BlockState], backing: Any, names: list[str],
            max_blocks: int | None, exclude: Mapping[str, Iterable[int]] | None) -> Compaction:
    """Compact groups ``names`` of ``states`` over ``backing`` (see
    :meth:`~xllm_vmm.kvcache.allocator.BlockAllocator.compact` for the contract)."""
    if max_blocks is not None and max_blocks < 0:
        raise ValueError(f"compact: max_blocks must be >= 0, got {max_blocks}")
    move = getattr(backing, "move", None)
    if move is None:
        raise TypeError(f"compact: the slot backing {type(backing).__name__} has no "
                        "move(moves) to copy block contents")
    budget = max_blocks
    plans: dict[str, _Plan] = {}
    for name in names:
        g = states[name]
        if g.free_active // g.bps == 0 or (budget is not None and budget <= 0):
            continue
        excl = set(exclude.get(name, ())) if exclude else set()
        excl.update(g.pins)  # a transfer reads or writes them (invariant 4)
        plan, budget = _plan(g, excl, budget)
        if plan is not None:
            plans[name] = plan
    if not plans:
        return Compaction({n: {} for n in names}, {n: () for n in names})
    if not move({name: list(p[1].items()) for name, p in plans.items()}):
        return Compaction({n: {} for n in names}, {n: () for n in names},
                          error=getattr(backing, "last_move_error", "") or
                          "the backing could not copy the blocks; nothing moved")
    emptied = {name: _apply(states[name], plan) for name, plan in plans.items()}
    backing.deactivate(emptied)
    return Compaction({n: (plans[n][1] if n in plans else {}) for n in names},
                      {n: tuple(emptied.get(n, ())) for n in names})


def _plan(g: BlockState, excl: set[int], budget: int | None) -> tuple[_Plan | None, int | None]:
    """Group ``g``'s plan and the budget left: ``⌊free blocks in active slots / B⌋`` sources,
    the sparsest slots with no block in ``excl`` (fewest blocks copied; among equals the
    highest slot id) within ``budget`` blocks (whole slots only); their used blocks go, lowest
    first, to the free blocks of the fullest remaining slots, each stack from its top."""
    ref = g.ref
    cached = g.cached
    bps = g.bps
    stacks = g.stacks  # (a native state's: a copy, read once)
    cands: list[tuple[int, int]] = []
    for s, stack in enumerate(stacks):
        if stack is None or len(stack) == 0:
            continue
        if not any((ref[b] or cached[b]) and b in excl for b in range(s * bps, (s + 1) * bps)):
            cands.append((bps - len(stack), -s))
    cands.sort()
    sources: list[int] = []
    for used, neg in cands[:g.free_active // bps]:
        if budget is not None:
            if used > budget:
                break
            budget -= used
        sources.append(-neg)
    if not sources:
        return None, budget
    src_set = set(sources)
    n_moves = sum(g.used(s) for s in sources)
    dests: list[int] = []
    taken: dict[int, int] = {}  # dest slot -> blocks taken from its stack
    buckets = g.buckets
    for kk in range(1, bps):
        for s in buckets[kk]:
            if s in src_set:
                continue
            t = min(kk, n_moves - len(dests))
            dests.extend(stacks[s][-1:-t - 1:-1])  # type: ignore[index]
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
    return (sources, mapping, taken), budget


def _apply(g: BlockState, plan: _Plan) -> list[int]:
    """Move ``g``'s state as ``plan`` says (the data is copied already): destination stacks
    give up the blocks taken, ref counts and flags move, the sources become inactive. Returns
    the sources, sorted (the caller releases them)."""
    sources, mapping, taken = plan
    for s, t in taken.items():
        g.drop_top(s, t)
    ref = g.ref
    cached = g.cached
    keep = g.keep
    for old, new in mapping.items():
        ref[new] = ref[old]
        ref[old] = 0
        keep[new] = keep[old]
        keep[old] = 0
        if cached[old]:
            cached[old] = 0
            cached[new] = 1
    for s in sources:  # every block of a source is free now
        g.release_slot(s)
    return sorted(sources)
