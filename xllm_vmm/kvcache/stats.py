"""What the KV cache reports: :class:`KVCapacity` (the manager's live capacity per group, for
admission and ``/metrics``), :class:`PrefixCacheStats` (the prefix cache's counters) and
:class:`KVCacheStats` (the manager's counters and gauges, with the prefix cache's and the host
tier's counters it exports). ``KVCacheManager.stats()`` is
:meth:`KVCacheStats.as_dict` of :meth:`KVCacheStats.collect`: the flat mapping the engine's
``stats()["kvcache"]`` and ``/metrics`` read. Units: blocks, tokens, bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

__all__ = ["KVCacheStats", "KVCapacity", "PrefixCacheStats", "capacity_of", "usage_of"]


@dataclass(frozen=True)
class KVCapacity:
    """Live capacity snapshot (blocks per group; tokens derived with one block size).

    ``total_blocks``: the virtual KV tensor capacity (every slot); ``used_blocks``: blocks
    referenced by requests (or held hits); ``cached_blocks``: unreferenced blocks kept by the
    prefix cache; ``available_blocks``: what one group could take now = free blocks of mapped
    slots + evictable cached blocks + blocks of the slots the live budget can still map
    (the budget is shared by every group: each group's figure assumes it takes it alone)."""

    block_size: int
    total_blocks: Mapping[str, int]
    used_blocks: Mapping[str, int]
    cached_blocks: Mapping[str, int]
    available_blocks: Mapping[str, int]

    @property
    def available_tokens(self) -> int:
        """Tokens one new sequence could take now (the least over groups)."""
        return min(self.available_blocks.values()) * self.block_size

    @property
    def total_tokens(self) -> int:
        return min(self.total_blocks.values()) * self.block_size


def capacity_of(cache: Any, evictable: Mapping[str, int] | None, block_size: int) -> KVCapacity:
    """:class:`KVCapacity` of ``cache`` (a :class:`~xllm_vmm.kvcache.cache.VirtualKVCache`)
    with ``evictable`` cached blocks per group (``None``: no prefix cache)."""
    cap = cache.capacity(evictable)
    a = cache.allocator
    total, used, cached, avail = {}, {}, {}, {}
    for g, geo in cache.geometry.items():
        gc = cap.groups[g]
        total[g] = geo.num_blocks
        used[g] = a.num_live_blocks(g)
        cached[g] = a.num_cached_blocks(g)
        mappable = min(gc.inactive_slots, cap.mappable_bytes // gc.slot_bytes)
        avail[g] = gc.free_blocks + gc.evictable_blocks + mappable * gc.blocks_per_slot
    return KVCapacity(block_size, total, used, cached, avail)


def usage_of(c: KVCapacity) -> float:
    """Fraction 0..1 of the KV capacity in use (``vllm:kv_cache_usage_perc``): referenced
    blocks over referenced + available blocks, the largest over groups (cached blocks
    count as available: they are given up on demand)."""
    best = 0.0
    for g, u in c.used_blocks.items():
        d = u + c.available_blocks[g]
        if d:
            best = max(best, u / d)
    return best


@dataclass
class PrefixCacheStats:
    """The prefix cache's counters since start (or the last
    :meth:`~xllm_vmm.kvcache.prefix.PrefixCache.reset_stats`) and current sizes.

    ``queries``: lookups; ``query_tokens``: tokens those lookups asked about (complete blocks);
    ``hits``: lookups that reused at least one block; ``hit_blocks``/``hit_tokens``: what they
    reused; ``evictions``: blocks given up under memory pressure; ``evicted_slots_emptied``:
    slots those evictions emptied (released at once); ``cached_blocks``: blocks with
    ref 0 kept now; ``cached_bytes``: their bytes (every tensor of their group);
    ``indexed_hashes``: usable hashes now; ``checkpoint_bytes``: hybrid linear-state
    checkpoints held (PC-02).
    """

    queries: int = 0
    query_tokens: int = 0
    hits: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    evicted_slots_emptied: int = 0
    published_blocks: int = 0
    duplicate_publishes: int = 0
    cached_blocks: int = 0
    cached_bytes: int = 0
    indexed_hashes: int = 0
    checkpoint_bytes: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d



def _prefix(name: str) -> Any:
    """A field read from the prefix cache's :class:`PrefixCacheStats` ``<name>`` (0 without
    one)."""
    return field(default=0, metadata={"source": ("prefix", name)})


def _host(name: str) -> Any:
    """A field read from the host tier's ``HostTierStats.<name>`` (0 without one)."""
    return field(default=0, metadata={"source": ("host", name)})


@dataclass(frozen=True)
class KVCacheStats:
    """The manager's counters and gauges: blocks per state, ``mapped_bytes`` (KV pages mapped
    now), compactions and requests, then ``prefix_*`` (queries, query/hit tokens, hits,
    evictions, published blocks, cached bytes) and ``host_*`` (capacity, blocks used and hit,
    offloaded / restored blocks and bytes, failures). A ``prefix_*`` / ``host_*`` field names
    the counter it is read from; both are 0 when that part is off."""

    block_size: int
    requests: int
    live_blocks: int
    cached_blocks: int
    free_blocks: int
    mapped_bytes: int
    packed_floor_bytes: int
    evictions: int
    compactions: int
    blocks_compacted: int
    compaction_released_bytes: int
    usage: float
    asleep: bool
    prefix_enabled: bool = False
    prefix_queries: int = _prefix("queries")
    prefix_query_tokens: int = _prefix("query_tokens")
    prefix_hits: int = _prefix("hits")
    prefix_hit_tokens: int = _prefix("hit_tokens")
    prefix_evictions: int = _prefix("evictions")
    prefix_published_blocks: int = _prefix("published_blocks")
    prefix_cached_bytes: int = _prefix("cached_bytes")
    host_enabled: bool = False
    host_capacity_blocks: int = _host("host_capacity_blocks")
    host_blocks_used: int = _host("host_blocks_used")
    host_hit_blocks: int = _host("host_hit_blocks")
    host_offloaded_blocks: int = _host("offloaded_blocks")
    host_offload_bytes: int = _host("offloaded_bytes")
    host_restored_blocks: int = _host("restored_blocks")
    host_restore_bytes: int = _host("restored_bytes")
    host_restore_failures: int = _host("restore_failures")
    host_offload_failures: int = _host("offload_failures")

    @classmethod
    def collect(cls, prefix: Any, host: Any, **gauges: Any) -> "KVCacheStats":
        """The manager's ``gauges`` (the fields without a source) with every sourced field
        read from ``prefix`` (:class:`PrefixCacheStats` or ``None``) and ``host``
        (``HostTierStats`` or ``None``)."""
        parts = {"prefix": prefix, "host": host}
        read = {name: getattr(parts[part], attr) for name, part, attr in _SOURCED
                if parts[part] is not None}
        return cls(prefix_enabled=prefix is not None, host_enabled=host is not None,
                   **gauges, **read)

    def as_dict(self) -> dict[str, Any]:
        """The flat mapping ``KVCacheManager.stats()`` returns (field order)."""
        return asdict(self)


#: (field, part, counter) of every field read from the prefix cache or the host tier
_SOURCED = tuple((f.name, *f.metadata["source"]) for f in fields(KVCacheStats)
                 if "source" in f.metadata)
