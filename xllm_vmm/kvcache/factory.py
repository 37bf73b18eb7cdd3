"""The KV cache manager's factory, the one place the KV cache's parts are wired:
:func:`build_kv_cache_manager` builds the :class:`~xllm_vmm.kvcache.cache.VirtualKVCache`
over a pool, the prefix cache (PC-01; PC-02 for a layout with resident state), the host tier
(:func:`~xllm_vmm.kvcache.host_link.build_host_tier`: HK-01..HK-07) and the
:class:`~xllm_vmm.kvcache.manager.KVCacheManager` over them; a call that raises leaves
nothing on the pool.
"""

from __future__ import annotations

from typing import Any

from xllm_vmm.kvcache.cache import CacheLayoutError, VirtualKVCache, fit_tokens
from xllm_vmm.kvcache.hashing import DEFAULT_SEED
from xllm_vmm.kvcache.host_link import build_host_tier
from xllm_vmm.kvcache.manager import KVCacheManager
from xllm_vmm.kvcache.prefix import PrefixCache

__all__ = ["TUNING", "build_kv_cache_manager"]

#: the tuning keys build_kv_cache_manager takes, with what each does
TUNING = {
    "compact": "bool: compact in step() when whole slots can be reclaimed (elastic pools)",
    "compact_min_slots": "int >= 1: reclaimable slots (any group) that make a compaction worth it",
    "compact_max_blocks": "int >= 1 or None: blocks moved by one step() at most (default 64)",
    "ready_slots": "int >= 0: slots of pages step() creates ahead of demand (elastic; default 1)",
    "host_available_bytes": "int: host memory the host pool may take (HK-07; default MemAvailable)",
    "host_populate": "bool: commit the host pool's pages at start (HK-06; default True)",
}


def _kv_tokens_for_pool(pool: Any, layout: Any) -> int:
    """KV capacity in tokens when none is given: a fixed or physical pool's budget; an
    elastic pool's ceiling (what its budget could ever map: ``max_cache_size`` or the
    utilisation share of the device), both capped by the arena pages left for the tenant."""
    page = pool.page_bytes
    cap = pool.static_capacity_bytes()
    arena_left = pool.arena_bytes_left()
    return fit_tokens(layout, page, min(cap, arena_left) if cap > 0 else arena_left)


def build_kv_cache_manager(pool: Any, layout: Any, *, enable_prefix_cache: bool,
                           host_blocks_factor: float = 0.0, max_tokens: int | None = None,
                           driver: Any = None, vision: bool = False,
                           hash_seed: int = DEFAULT_SEED, **tuning: Any) -> KVCacheManager:
    """The KV cache of ``layout`` over ``pool`` (tenant ``"kv"``, low end of the arena) and the
    manager over it.

    ``max_tokens``: KV capacity in tokens per group (the virtual size of an elastic cache);
    ``None`` sizes it from the pool's budget and arena. ``enable_prefix_cache``: PC-01 (PC-02
    for a layout with resident linear state). ``host_blocks_factor > 1`` with prefix caching
    adds the host tier (HK-01; sized HK-06, refused HK-05 / HK-07 with the reason); a factor
    without prefix caching keeps no host copy (HK-02). ``driver``: the driver for host copies
    (default the pool's). ``tuning``: see ``TUNING`` (``compact``, ``compact_min_slots``,
    ``compact_max_blocks``, ``ready_slots``, ``host_available_bytes``, ``host_populate``)."""
    unknown = sorted(set(tuning) - set(TUNING))
    if unknown:
        raise TypeError(f"build_kv_cache_manager: unknown tuning parameter(s) "
                        f"{', '.join(unknown)}; known: {', '.join(sorted(TUNING))}")
    if max_tokens is not None and max_tokens < 1:
        raise CacheLayoutError(f"max_tokens must be >= 1 token, got {max_tokens}")
    tokens = max_tokens if max_tokens is not None else _kv_tokens_for_pool(pool, layout)
    if tokens < 1:
        raise CacheLayoutError(
            f"the pool leaves room for no KV token (budget {pool.static_capacity_bytes()} "
            f"bytes, arena {pool.arena_bytes_left()} bytes left); raise "
            "max_memory_utilization / max_cache_size or pass max_tokens")
    kw = {k: tuning[k] for k in ("compact", "compact_min_slots", "compact_max_blocks",
                                 "ready_slots") if k in tuning}
    had_kv = pool.has_tenant("kv")
    host = None
    try:
        cache = VirtualKVCache.for_tokens(pool, layout, tokens)
        prefix = None
        if enable_prefix_cache:
            prefix = PrefixCache(cache.allocator,
                                 {n: geo.group.block_bytes for n, geo in cache.geometry.items()},
                                 cache.layout.groups[0].block_size,
                                 hybrid=layout.resident is not None)  # PC-02
        host = build_host_tier(cache, prefix, layout, host_blocks_factor, vision=vision,
                               driver=driver or pool.driver, tuning=tuning)  # HK-01..HK-07
        return KVCacheManager(cache, prefix=prefix, host=host, hash_seed=hash_seed, **kw)
    except BaseException:
        # nothing stays on the caller's pool: the host buffer, the "kv" region (its pages and
        # its arena space); a "kv" tenant that was there before the call is not ours
        if host is not None:
            host.close()
        if not had_kv and pool.has_tenant("kv"):
            pool.remove_tenant("kv")
        raise
