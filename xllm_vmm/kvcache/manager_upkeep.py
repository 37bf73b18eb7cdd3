"""The KV cache manager's upkeep: :meth:`~UpkeepVerbs.step` between engine steps (host copies
progress, compaction when whole slots can be reclaimed, growth headroom), compaction applied
to every block table, the queries (capacity, usage, stats) and the operator verbs (reset,
sleep, wake, close), and the invariant check. A base class of
:class:`~xllm_vmm.kvcache.manager.KVCacheManager`, which holds every attribute these methods
read (see its ``__init__``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xllm_vmm.kvcache.compaction import Compaction
from xllm_vmm.kvcache.records import KVCacheManagerError, RequestRecord, check_records
from xllm_vmm.kvcache.stats import KVCacheStats, KVCapacity, capacity_of, usage_of

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.kvcache.cache import VirtualKVCache
    from xllm_vmm.kvcache.host_link import HostLink
    from xllm_vmm.kvcache.host_tier import HostTier
    from xllm_vmm.kvcache.prefix import PrefixCache

__all__ = ["UpkeepVerbs"]


class UpkeepVerbs:
    """:class:`~xllm_vmm.kvcache.manager.KVCacheManager`'s upkeep, queries and operator verbs
    (slotless: the manager's slots hold the state)."""

    __slots__ = ()

    # the manager's state these verbs use (KVCacheManager.__init__ sets it)
    _cache: VirtualKVCache
    _alloc: Any
    _reqs: dict[str, RequestRecord]
    _restoring: dict[str, RequestRecord]
    _host: HostLink | None
    prefix: PrefixCache | None
    host: HostTier | None
    block_size: int
    group_names: tuple[str, ...]
    _asleep: bool
    _closed: bool
    _compact: bool
    _compact_min_slots: int
    _compact_max_blocks: int | None
    _elastic: bool
    _ready_pages: int
    _ready_fill: int
    _pool_ready_pages: int
    compactions: int
    blocks_compacted: int
    bytes_compacted_released: int

    # -- between engine steps ------------------------------------------------------------
    def step(self) -> None:
        """Once per engine iteration, between model steps: host-tier copies progress (finished
        copies release their pins, queued offloads are submitted as one batch), finished
        restores are applied, and the cache is compacted when whole slots of idle backing can
        be reclaimed (elastic pools; at most ``compact_max_blocks`` blocks moved).

        Growth headroom (elastic pools, ``ready_slots`` ≥ 1): while requests run, up to
        ``ready_slots`` slots' worth of pages (the widest group's tensors per slot) are kept
        created but unmapped in the pool's ready set, at most an eighth of them created per
        call, so the step that activates a slot (many sequences crossing a block boundary
        together) maps ready pages instead of creating them all at once. Freed slots refill
        the ready set first. With no request left the ready set is freed (see :meth:`free`)."""
        if self._host is not None:
            self._host.step()
        if self._elastic and not self._asleep:
            if self._compact:
                self._maybe_compact()
            if self._ready_pages and self._reqs:
                self._cache.pool.fill_ready(self._ready_fill)

    def _maybe_compact(self) -> None:
        a = self._alloc
        worth = False
        for g in self.group_names:
            if a.num_free_blocks(g) // a.shape(g).blocks_per_slot >= self._compact_min_slots:
                worth = True
                break
        if worth:
            self.compact(max_blocks=self._compact_max_blocks)

    def compact(self, max_blocks: int | None = None) -> Compaction:
        """Compact now (see :meth:`VirtualKVCache.compact`: pinned blocks stay, nothing is
        mapped) and apply the moves to every block table, held hit and the prefix index.
        Call it between model steps only. Returns what it did."""
        c = self._cache.compact(max_blocks=max_blocks)
        if c.error or not c.blocks_moved:
            return c
        for g, moves in c.moves.items():
            if not moves:
                continue
            if self.prefix is not None:
                self.prefix.on_move(g, moves)
            get = moves.get
            for req in self._reqs.values():
                t = req[g]
                for i, b in enumerate(t):
                    nb = get(b)
                    if nb is not None:
                        t[i] = nb
                if req.held is not None:
                    h = req.held[g]
                    for i, b in enumerate(h):
                        nb = get(b)
                        if nb is not None:
                            h[i] = nb
        self.compactions += 1
        self.blocks_compacted += c.blocks_moved
        self.bytes_compacted_released += c.bytes_released
        return c

    # -- queries ---------------------------------------------------------------------------
    def capacity(self) -> KVCapacity:
        """Live capacity (see :class:`KVCapacity`)."""
        return capacity_of(self._cache, self._evictable(), self.block_size)

    def usage(self) -> float:
        """Fraction 0..1 of the KV capacity in use (``vllm:kv_cache_usage_perc``): referenced
        blocks over referenced + available blocks, the largest over groups (cached blocks
        count as available: they are given up on demand)."""
        return usage_of(self.capacity())

    def stats_snapshot(self) -> KVCacheStats:
        """Counters and gauges now (see :class:`KVCacheStats`)."""
        a = self._alloc
        names = self.group_names
        prefix = self.prefix.stats if self.prefix is not None else None
        return KVCacheStats.collect(
            prefix, self.host.stats if self.host is not None else None,
            block_size=self.block_size, requests=len(self._reqs),
            live_blocks=sum(a.num_live_blocks(g) for g in names),
            cached_blocks=sum(a.num_cached_blocks(g) for g in names),
            free_blocks=sum(a.num_free_blocks(g) for g in names),
            mapped_bytes=self._cache.active_bytes(),
            packed_floor_bytes=self._cache.packed_floor_bytes(),
            evictions=prefix.evictions if prefix is not None else 0,
            compactions=self.compactions, blocks_compacted=self.blocks_compacted,
            compaction_released_bytes=self.bytes_compacted_released, usage=self.usage(),
            asleep=self._asleep)

    def stats(self) -> dict[str, Any]:
        """:meth:`stats_snapshot` as the flat mapping ``/metrics`` and the engine's
        ``stats()["kvcache"]`` read (:meth:`KVCacheStats.as_dict`)."""
        return self.stats_snapshot().as_dict()

    # -- operator verbs --------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (device index and host tier); cached, unpinned device
        blocks are freed now (their pages released). Blocks requests reference stay with them.
        Returns the device blocks dropped."""
        if self.prefix is None:
            return 0
        n = self.prefix.reset()
        if self.host is not None:
            self.host.reset()
        return n

    def sleep(self, offload: bool = True) -> int:
        """Release every KV page. No request may hold blocks or a hit (raises
        :class:`KVCacheManagerError` naming them otherwise). With a host tier and ``offload``
        the write-through copies finish first, so cached prefixes survive on the host; the
        device's cached blocks are dropped. Returns the device bytes released (0 for a fixed
        or physical pool, whose pages stay backed)."""
        if self._reqs:
            names = ", ".join(sorted(self._reqs)[:5])
            raise KVCacheManagerError(
                f"sleep: {len(self._reqs)} request(s) still hold KV blocks or a prefix hit "
                f"({names}{', ...' if len(self._reqs) > 5 else ''}); free or abort them first")
        before = self._cache.pool.mapped_bytes
        host = self.host
        if host is not None:
            if offload:
                host.step()
            host.wait_all()
        if self.prefix is not None:
            self.prefix.reset()
        self._cache.pool.drain_ready()  # growth headroom too (its pages are held memory)
        self._asleep = True
        return max(0, before - self._cache.pool.mapped_bytes)

    def wake_up(self) -> None:
        """Allow mapping again (pages come back on demand). Idempotent."""
        self._asleep = False

    def is_sleeping(self) -> bool:
        return self._asleep

    def close(self) -> None:
        """Wait for every host copy and release the host pool; requests are forgotten (their
        blocks with them). The pool is the caller's to close. Idempotent."""
        if self._closed:
            return
        for rid in list(self._reqs):
            self.free(rid)
        if self.host is not None:
            self.host.close()
        pool = self._cache.pool
        if self._ready_pages:  # the headroom was this manager's (a closed pool holds none)
            pool.ready_pages = self._pool_ready_pages
            pool.drain_ready()
        self._closed = True

    def check_invariants(self) -> None:
        """Recount the allocator and check every table block is referenced (tests, tools)."""
        self._alloc.check_invariants()
        check_records(self._reqs, self._restoring, self._alloc, self.block_size)
