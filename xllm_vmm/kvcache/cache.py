"""``VirtualKVCache``: the cache groups of a :class:`~xllm_vmm.models.spec.CacheLayout` laid
over a tenant region of a :class:`~xllm_vmm.pool.VmmPool`, with slot-level mapping.

Geometry (units: bytes unless named; ``P`` = page bytes)::

    KV region of the arena (pages)
    | group "attn": tensor 0 (S pages) | tensor 1 (S pages) | ... | group "draft": tensor 0 | ...
                    ^ slot s = page s of every tensor of the group

- Tensor ``t`` of a group with ``S`` slots is ``S`` consecutive pages: a view over its part of
  the arena, at a virtual address that never moves.
- Slot ``s`` = page ``s`` of every tensor of the group; mapping a slot maps one page per tensor,
  and a call that activates several slots (of several groups) maps all their pages in one
  batched driver call.
- A group's blocks per slot ``B = P // tensor_block_bytes`` (a block never straddles a page);
  block ``b`` lives in slot ``b // B`` at byte ``(b % B) × tensor_block_bytes`` of each tensor's
  page.
- Conv / recurrent state of hybrid models (HY-01) is not here: it is resident, per sequence
  slot, reserved outside the page pool (see :mod:`xllm_vmm.kvcache.resident`).

Invariant 1 (docs/architecture.md): a block's memory is read or written only while its slot is active,
and an active slot has every page under it mapped (:meth:`VirtualKVCache.check_mapped`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from xllm_vmm.kvcache.allocator import BlockAllocator, Compaction, GroupShape
from xllm_vmm.models.search import largest
from xllm_vmm.models.spec import CacheGroup, CacheLayout
from xllm_vmm.pool.pool import Region, VmmPool

__all__ = [
    "CacheCapacity",
    "CacheLayoutError",
    "GroupCapacity",
    "GroupGeometry",
    "VirtualKVCache",
    "blocks_for_tokens",
    "fit_tokens",
    "slots_for_tokens",
]


class CacheLayoutError(ValueError):
    """The cache layout cannot be laid over pages as given; the message says what to change."""


def _blocks_per_page(group: CacheGroup, page_bytes: int) -> int:
    if group.tensor_block_bytes <= 0 or not group.tensors:
        raise CacheLayoutError(f"cache group {group.name!r} has no tensors or zero-width blocks")
    bpp = group.blocks_per_page(page_bytes)
    if bpp < 1:
        raise CacheLayoutError(
            f"cache group {group.name!r}: one block is {group.tensor_block_bytes} bytes per "
            f"tensor, larger than a {page_bytes}-byte page (a block never straddles a page); "
            "lower block_size")
    return bpp


def blocks_for_tokens(group: CacheGroup, tokens: int) -> int:
    """Blocks one sequence of ``tokens`` tokens needs in ``group`` (a sliding-window group is
    capped at its window, plus one block for a window that does not start on a boundary)."""
    n = -(-tokens // group.block_size)
    if group.max_tokens_per_seq is not None:
        n = min(n, -(-group.max_tokens_per_seq // group.block_size) + 1)
    return n


def slots_for_tokens(layout: CacheLayout, page_bytes: int, max_tokens: int) -> dict[str, int]:
    """Slots per group for a capacity of ``max_tokens`` tokens in every group."""
    out = {}
    for g in layout.groups:
        bpp = _blocks_per_page(g, page_bytes)
        out[g.name] = -(-(-(-max_tokens // g.block_size)) // bpp)
    return out


def _slot_bytes_for(layout: CacheLayout, page_bytes: int, slots: Mapping[str, int]) -> int:
    return sum(g.slot_bytes(page_bytes) * slots[g.name] for g in layout.groups)


def fit_tokens(layout: CacheLayout, page_bytes: int, capacity_bytes: int) -> int:
    """The largest token capacity whose slots fit in ``capacity_bytes`` (0 if none does).
    Used to size the cache of a physical or fixed pool from its budget."""
    def fits(t: int) -> bool:
        return _slot_bytes_for(layout, page_bytes, slots_for_tokens(layout, page_bytes, t)) \
            <= capacity_bytes
    return largest_tokens(fits)


#: the most tokens a capacity search reports (a budget larger than this is "unbounded")
MAX_SEARCH_TOKENS = 1 << 40


def largest_tokens(fits) -> int:
    """The largest token count ``t >= 0`` with ``fits(t)`` (monotone: true up to some point),
    by the project's one search (:func:`xllm_vmm.models.search.largest`); 0 when none fits,
    :data:`MAX_SEARCH_TOKENS` when every count up to it does."""
    t = largest(fits, 0, limit=MAX_SEARCH_TOKENS)
    return MAX_SEARCH_TOKENS if t is None else max(0, t)


@dataclass(frozen=True)
class GroupGeometry:
    """Where one group lives. ``first_page`` is relative to the KV region."""

    group: CacheGroup
    num_slots: int
    blocks_per_slot: int
    first_page: int
    base_va: int
    page_bytes: int

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def num_tensors(self) -> int:
        return len(self.group.tensors)

    @property
    def pages(self) -> int:
        return self.num_slots * self.num_tensors

    @property
    def slot_bytes(self) -> int:
        return self.page_bytes * self.num_tensors

    @property
    def num_blocks(self) -> int:
        return self.num_slots * self.blocks_per_slot

    def tensor_va(self, tensor: int) -> int:
        """Virtual address of tensor ``tensor`` (index into ``group.tensors``)."""
        return self.base_va + tensor * self.num_slots * self.page_bytes

    def slot_pages(self, slot: int) -> list[int]:
        """Region pages of ``slot``: one per tensor."""
        s = self.num_slots
        return [self.first_page + t * s + slot for t in range(self.num_tensors)]

    def block_va(self, tensor: int, block: int) -> int:
        slot, i = divmod(block, self.blocks_per_slot)
        return (self.tensor_va(tensor) + slot * self.page_bytes
                + i * self.group.tensor_block_bytes)


@dataclass(frozen=True)
class GroupCapacity:
    """What one group could still take now, for admission (blocks, slots, bytes)."""

    name: str
    free_blocks: int  # free blocks in active slots
    evictable_blocks: int  # cached blocks the prefix cache could give up (0 without one)
    inactive_slots: int
    blocks_per_slot: int
    slot_bytes: int


@dataclass(frozen=True)
class CacheCapacity:
    """A worker's capacity snapshot. ``mappable_bytes``: bytes of slots the pool could map now
    (shared by every group: they draw on one budget)."""

    groups: Mapping[str, GroupCapacity]
    mappable_bytes: int

    def new_bytes_for(self, demand: Mapping[str, int]) -> int | None:
        """Bytes of new slots ``demand`` (blocks per group) needs beyond free and evictable
        blocks; ``None`` when some group has too few slots left in its virtual range."""
        total = 0
        for name, n in demand.items():
            g = self.groups[name]
            short = n - g.free_blocks - g.evictable_blocks
            if short > 0:
                k = -(-short // g.blocks_per_slot)
                if k > g.inactive_slots:
                    return None
                total += k * g.slot_bytes
        return total

    def fits(self, demand: Mapping[str, int]) -> bool:
        need = self.new_bytes_for(demand)
        return need is not None and need <= self.mappable_bytes


class VirtualKVCache:
    """The virtual KV cache of one worker: groups over the pool's ``tenant`` region, slots,
    and the :class:`~xllm_vmm.kvcache.allocator.BlockAllocator` over them (:attr:`allocator`,
    the one owner of block state; the engine goes through
    :class:`~xllm_vmm.kvcache.manager.KVCacheManager`). The cache is the allocator's slot
    backing: :meth:`activate` / :meth:`deactivate` map and unmap a slot's pages, :meth:`move`
    copies blocks for compaction.

    ``slots`` gives the slots per group (the device KV tensor capacity); see
    :meth:`for_tokens` and :meth:`for_budget` to derive it.
    """

    def __init__(self, pool: VmmPool, layout: CacheLayout, slots: Mapping[str, int], *,
                 tenant: str = "kv") -> None:
        page = pool.page_bytes
        self.pool = pool
        self.layout = layout
        missing = [g.name for g in layout.groups if g.name not in slots]
        if missing:
            raise CacheLayoutError(f"no slot count for cache group(s) {', '.join(missing)}")
        names = [g.name for g in layout.groups]
        if len(set(names)) != len(names):
            raise CacheLayoutError(f"cache layout {layout.model!r} repeats a group name: {names}")
        pages = 0
        specs = []
        for g in layout.groups:
            bps = _blocks_per_page(g, page)
            n = slots[g.name]
            if n < 1:
                raise CacheLayoutError(f"cache group {g.name!r} needs at least one slot, got {n}")
            specs.append((g, n, bps, pages))
            pages += n * len(g.tensors)
        self.region: Region = pool.add_tenant(tenant, pages * page, end="low")
        self.geometry: dict[str, GroupGeometry] = {
            g.name: GroupGeometry(g, n, bps, first, self.region.page_va(first), page)
            for g, n, bps, first in specs
        }
        self.last_move_error = ""
        # per group, the region page of slot 0 in each tensor (slot s: these + s, ascending)
        self._tensor_pages = {n: tuple(geo.slot_pages(0)) for n, geo in self.geometry.items()}
        self.allocator = BlockAllocator(
            [GroupShape(name, geo.num_slots, geo.blocks_per_slot)
             for name, geo in self.geometry.items()], backing=self)

    # -- construction helpers ------------------------------------------------------------
    @classmethod
    def for_tokens(cls, pool: VmmPool, layout: CacheLayout, max_tokens: int,
                   **kw: object) -> "VirtualKVCache":
        """A cache whose every group holds ``max_tokens`` tokens (elastic: the virtual size)."""
        if max_tokens < 1:
            raise CacheLayoutError(f"max_tokens must be >= 1, got {max_tokens}")
        return cls(pool, layout, slots_for_tokens(layout, pool.page_bytes, max_tokens), **kw)

    @classmethod
    def for_budget(cls, pool: VmmPool, layout: CacheLayout, **kw: object) -> "VirtualKVCache":
        """A cache as large as a physical or fixed pool's budget allows."""
        cap = pool.static_capacity_bytes()
        tokens = fit_tokens(layout, pool.page_bytes, cap)
        if tokens < 1:
            raise CacheLayoutError(
                f"the {pool.mode.value} budget leaves {cap} bytes, less than one slot of every "
                f"cache group ({_slot_bytes_for(layout, pool.page_bytes, slots_for_tokens(layout, pool.page_bytes, 1))} bytes); "
                "raise max_memory_utilization or max_cache_size")
        return cls.for_tokens(pool, layout, tokens, **kw)

    @staticmethod
    def arena_bytes(layout: CacheLayout, page_bytes: int, max_tokens: int) -> int:
        """Bytes of arena a cache of ``max_tokens`` tokens per group needs."""
        return _slot_bytes_for(layout, page_bytes, slots_for_tokens(layout, page_bytes,
                                                                     max_tokens))

    # -- SlotBacking ---------------------------------------------------------------------
    def activate(self, slots: Mapping[str, Sequence[int]]) -> bool:
        """Map every page of ``slots`` in one pool call, in address order (so that the pages
        of consecutive slots of one tensor form runs the host driver maps with one call)."""
        return self.pool.map_pages(self.region, self._slot_pages(slots))

    def deactivate(self, slots: Mapping[str, Sequence[int]]) -> None:
        """Unmap every page of ``slots`` in one pool call, in address order."""
        self.pool.unmap_pages(self.region, self._slot_pages(slots))

    def _slot_pages(self, slots: Mapping[str, Sequence[int]]) -> list[int]:
        """Every page of ``slots`` (every tensor of their group), in address order."""
        if len(slots) == 1:  # one slot of one group (most activations): its pages ascend
            for name, ss in slots.items():
                if len(ss) == 1:
                    s = ss[0]
                    return [o + s for o in self._tensor_pages[name]]
        pages: list[int] = []
        for name, ss in slots.items():
            geo = self.geometry[name]
            for s in ss:
                pages.extend(geo.slot_pages(s))
        pages.sort()
        return pages

    def move(self, moves: Mapping[str, Sequence[tuple[int, int]]]) -> bool:
        """Copy block ``old`` to block ``new`` for every pair, in every tensor of its group, in
        one batched device-to-device copy (runs of consecutive blocks are merged into one
        segment per tensor). Both blocks' slots are active (mapped). ``False`` when the driver
        refused the copy (its message is in :attr:`last_move_error`); nothing was freed."""
        from xllm_vmm.vmm.driver import CopyKind, VmmError

        dsts: list[int] = []
        srcs: list[int] = []
        sizes: list[int] = []
        for name, pairs in moves.items():
            geo = self.geometry[name]
            bps = geo.blocks_per_slot
            nb = geo.group.tensor_block_bytes
            runs: list[tuple[int, int, int]] = []  # (old, new, blocks)
            for old, new in pairs:
                if runs:
                    o, n, c = runs[-1]
                    if (old == o + c and new == n + c and old // bps == o // bps
                            and new // bps == n // bps):
                        runs[-1] = (o, n, c + 1)
                        continue
                runs.append((old, new, 1))
            for t in range(geo.num_tensors):
                for old, new, c in runs:
                    dsts.append(geo.block_va(t, new))
                    srcs.append(geo.block_va(t, old))
                    sizes.append(c * nb)
        self.last_move_error = ""
        if not sizes:
            return True
        try:
            self.pool.driver.copy_batch(dsts, srcs, sizes, CopyKind.D2D)
            self.pool.driver.synchronize()
        except VmmError as e:
            self.last_move_error = f"device-to-device copy failed: {e}"
            return False
        return True

    def compact(self, groups: Iterable[str] | None = None, *, max_blocks: int | None = None,
                exclude: Mapping[str, Iterable[int]] | None = None) -> Compaction:
        """Move live and cached blocks out of sparsely used slots into free blocks of denser
        ones and release the emptied slots at once (see
        :meth:`~xllm_vmm.kvcache.allocator.BlockAllocator.compact` for the choice of slots,
        pins, ``max_blocks`` and ``exclude``). Call it when the cache is idle or lightly
        loaded, between engine steps; the returned ``moves[group]`` (old → new) must be
        applied to every block table and the prefix index (the manager's
        :meth:`~xllm_vmm.kvcache.manager.KVCacheManager.compact` does). Never maps a slot. ``bytes_copied``: device-to-device
        bytes (every tensor of a group); ``bytes_released``: bytes unmapped."""
        c = self.allocator.compact(groups, max_blocks=max_blocks, exclude=exclude)
        copied = sum(len(m) * self.geometry[n].group.tensor_block_bytes
                     * self.geometry[n].num_tensors for n, m in c.moves.items())
        released = sum(len(s) * self.geometry[n].slot_bytes
                       for n, s in c.released_slots.items())
        return dataclasses.replace(c, bytes_copied=copied, bytes_released=released)

    # -- blocks --------------------------------------------------------------------------
    def allocate(self, counts: Mapping[str, int],
                 near: Mapping[str, int] | None = None) -> dict[str, list[int]] | None:
        """:meth:`BlockAllocator.allocate` (blocks per group, all or none; ``None`` = "not
        now", nothing evicted), for tools and tests that place blocks without requests. The
        engine allocates through :class:`~xllm_vmm.kvcache.manager.KVCacheManager`."""
        return self.allocator.allocate(counts, near)

    def free(self, blocks: Mapping[str, Sequence[int]]) -> Mapping[str, list[int]]:
        """:meth:`BlockAllocator.free` (every group together, SD-01), for the same callers
        as :meth:`allocate`."""
        return self.allocator.free(blocks)

    def demand(self, tokens: int) -> dict[str, int]:
        """Blocks one sequence of ``tokens`` tokens needs in every group (AD-01)."""
        return {name: blocks_for_tokens(geo.group, tokens) for name, geo in self.geometry.items()}

    def block_address(self, group: str, tensor: int, block: int) -> int:
        """Virtual address of ``block`` in tensor ``tensor`` of ``group``."""
        return self.geometry[group].block_va(tensor, block)

    def check_mapped(self, group: str, block: int) -> bool:
        """True when every page under ``block`` (one per tensor) is mapped now."""
        geo = self.geometry[group]
        slot = block // geo.blocks_per_slot
        return all(self.pool.is_mapped(self.region, p) for p in geo.slot_pages(slot))

    # -- capacity and statistics ---------------------------------------------------------
    def capacity(self, evictable: Mapping[str, int] | None = None) -> CacheCapacity:
        """What the cache could take now; ``evictable``: cached blocks per group the prefix
        cache could give up (the manager passes them; none without a prefix cache)."""
        a = self.allocator
        ev = evictable or {}
        groups = {
            name: GroupCapacity(name, a.num_free_blocks(name), ev.get(name, 0),
                                a.num_inactive_slots(name), geo.blocks_per_slot,
                                geo.slot_bytes)
            for name, geo in self.geometry.items()
        }
        mappable = self.pool.mappable_pages(self.region) * self.pool.page_bytes
        return CacheCapacity(groups, mappable)

    def active_bytes(self) -> int:
        """Bytes of active slots (live or cached blocks under them)."""
        return sum(self.allocator.num_active_slots(n) * geo.slot_bytes
                   for n, geo in self.geometry.items())

    def packed_floor_bytes(self) -> int:
        """Live + cached bytes rounded up to whole slots, per group: the least any page-based
        allocator could hold for the same blocks."""
        a = self.allocator
        total = 0
        for n, geo in self.geometry.items():
            used = a.num_live_blocks(n) + a.num_cached_blocks(n)
            total += -(-used // geo.blocks_per_slot) * geo.slot_bytes
        return total

    def stats(self) -> dict[str, object]:
        a = self.allocator
        return {
            "groups": {
                n: {
                    "slots": geo.num_slots,
                    "blocks_per_slot": geo.blocks_per_slot,
                    "slot_bytes": geo.slot_bytes,
                    "active_slots": a.num_active_slots(n),
                    "mapped_bytes": a.num_active_slots(n) * geo.slot_bytes,
                    "live_blocks": a.num_live_blocks(n),
                    "cached_blocks": a.num_cached_blocks(n),
                    "free_blocks": a.num_free_blocks(n),
                }
                for n, geo in self.geometry.items()
            },
            "active_bytes": self.active_bytes(),
            "packed_floor_bytes": self.packed_floor_bytes(),
        }
