"""The prefix cache's page-aware eviction choices over one group's LRU (pure: they choose
blocks, :class:`~xllm_vmm.kvcache.prefix.PrefixCache` gives them up). ``lru`` is the group's
ordered dict of evictable blocks, least recently released first; ``bps`` its blocks per slot.

- :func:`window_victims` (``PrefixCache.evict_pages``): whole slots completed inside a bounded
  window of the LRU tail, never past what exact LRU gives up to free the same pages;
- :func:`slots_first` (``evict(prefer_slot_emptying=True)``): whole evictable slots in the
  order of their least recently released block, whatever the recency of the rest;
- both top up with plain LRU (:func:`fill_from_lru`).
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Mapping

__all__ = ["fill_from_lru", "slots_first", "window_victims"]


def fill_from_lru(lru: Mapping[int, None], chosen: list[int], taken: set[int],
                  n_blocks: int) -> list[int]:
    """``chosen`` topped up to ``n_blocks`` with the least recently released blocks not in
    ``taken`` (the plain-LRU remainder of a page-aware choice)."""
    for b in lru:
        if b not in taken:
            chosen.append(b)
            if len(chosen) >= n_blocks:
                break
    return chosen


def slots_first(lru: Mapping[int, None], evictable: Callable[[int], bool], bps: int,
                n_blocks: int) -> list[int]:
    """Evictable slots (``evictable(slot)``: every used block cached and unpinned) in the
    order of their least recently released block, from the ``8 × (n_blocks + B)`` oldest,
    then LRU."""
    chosen: list[int] = []
    seen: set[int] = set()
    taken: set[int] = set()
    scan = 8 * (n_blocks + bps)  # the oldest entries only: eviction stays O(n_blocks)
    for b in lru:
        scan -= 1
        if scan < 0:
            break
        s = b // bps
        if s in seen:
            continue
        seen.add(s)
        if evictable(s):
            blocks = [x for x in range(s * bps, (s + 1) * bps) if x in lru]
            chosen.extend(blocks)
            taken.update(blocks)
            if len(chosen) >= n_blocks:
                return chosen
    return fill_from_lru(lru, chosen, taken, n_blocks)


def window_victims(lru: Mapping[int, None], used: Callable[[int], int], bps: int,
                   n_blocks: int, window_factor: int) -> list[int]:
    """The choice bounded to the window of the ``W = window_factor × (n_blocks + B)`` least
    recently released blocks (``B`` = blocks per slot; ``used(slot)``: its live, cached and
    pinned blocks). Walking the window oldest first, a slot *completes* when every used block
    of it has been seen: all of them are then evictable and inside the window. Completed slots
    are taken whole, in the order they complete (the slot whose most recently released block
    is least recent first: the first page exact LRU would empty); the rest of ``n_blocks``
    comes from plain LRU. A completed slot's blocks are all older than its newest one, so exact
    LRU, evicting oldest first until that page is empty, gives up every one of them (and more):
    nothing exact LRU keeps is lost. Every block chosen lies in the window or among the
    ``n_blocks`` oldest. Costs O(``W``)."""
    seen: dict[int, list[int]] = {}
    chosen: list[int] = []
    window = 0
    limit = window_factor * (n_blocks + bps)
    for b in lru:
        if window == limit:
            break
        window += 1
        s = b // bps
        run = seen.get(s)
        if run is None:
            run = seen[s] = []
        run.append(b)
        if len(run) == used(s):
            chosen.extend(run)
            if len(chosen) >= n_blocks:
                return chosen
    if not chosen:
        return list(islice(lru, n_blocks))
    return fill_from_lru(lru, chosen, set(chosen), n_blocks)
