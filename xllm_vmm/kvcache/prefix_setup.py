"""Wiring of the prefix cache and the host KV tier onto a :class:`VirtualKVCache`.

:func:`attach_prefix_cache` makes a :class:`~xllm_vmm.kvcache.prefix.PrefixCache` the cache's
retention policy (PC-01; PC-02 for a layout with resident linear state).
:func:`attach_host_tier` sizes (HK-06), checks (HK-05, HK-07) and preallocates the host pool and
returns the :class:`~xllm_vmm.kvcache.host_tier.HostTier`, or ``None`` when the factor is 1 or
less (HK-03). Units: bytes, blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from xllm_vmm.kvcache.host_pool import (
    HostPool,
    HostPoolSize,
    check_host_pool_fits,
    host_pool_size,
)
from xllm_vmm.kvcache.host_tier import HostTier
from xllm_vmm.kvcache.prefix import PrefixCache

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.kvcache.cache import VirtualKVCache
    from xllm_vmm.models.spec import CacheLayout

# Cache groups the host tier can copy: flat KV, MLA latent + index (HK-05 "flat KV and
# MLA+INDEX"), and the MTP draft, which is flat KV of its own width.
HOST_TIER_GROUPS = frozenset({"attn", "mla", "index", "draft"})


class HostTierUnsupported(ValueError):
    """HK-05: the layout has caches the host tier cannot offload."""


class KvBlockAddresses:
    """:class:`~xllm_vmm.kvcache.host_tier.BlockAddresses` over a :class:`VirtualKVCache`:
    block ``b`` of group ``g`` is ``tensor_block_bytes`` at ``block_address(g, t, b)`` in every
    tensor ``t`` of the group."""

    def __init__(self, cache: "VirtualKVCache") -> None:
        self.cache = cache
        self._geo = {n: (geo.num_tensors, geo.group.tensor_block_bytes)
                     for n, geo in cache.geometry.items()}

    def block_segments(self, group: str, block: int) -> Sequence[tuple[int, int]]:
        nt, nb = self._geo[group]
        addr = self.cache.block_address
        return [(addr(group, t, block), nb) for t in range(nt)]


def host_tier_unsupported_reason(layout: "CacheLayout", *, vision: bool = False) -> str | None:
    """Why HK-05 refuses host offload for ``layout`` (None when it is supported)."""
    if vision:
        return "VLM backends are unsupported for VMM host KV offload (HK-05)"
    if layout.resident is not None:
        return ("hybrid linear-attention conv/SSM caches are unsupported for VMM host KV "
                "offload (HK-05)")
    bad = [g.name for g in layout.groups if g.name not in HOST_TIER_GROUPS
           or g.max_tokens_per_seq is not None]
    if bad:
        return (f"grouped caches ({', '.join(bad)}) are unsupported for VMM host KV offload "
                "(HK-05)")
    return None


def attach_prefix_cache(cache: "VirtualKVCache", *, hybrid: bool | None = None) -> PrefixCache:
    """A prefix cache over every group of ``cache``, set as its allocator's retention policy.
    ``hybrid`` defaults to whether the layout has resident linear state (PC-02)."""
    if hybrid is None:
        hybrid = cache.layout.resident is not None
    groups = {n: geo.group.block_bytes for n, geo in cache.geometry.items()}
    block_sizes = {geo.group.block_size for geo in cache.geometry.values()}
    if len(block_sizes) != 1:
        raise ValueError(f"prefix caching needs one block_size across cache groups, got "
                         f"{sorted(block_sizes)}")
    prefix = PrefixCache(groups, block_sizes.pop(), backend=cache.allocator, hybrid=hybrid)
    cache.allocator.set_retention(prefix)
    return prefix


def device_capacity_bytes(cache: "VirtualKVCache") -> int:
    """The configured device KV tensor capacity: every slot of every group (HK-06)."""
    return sum(geo.num_slots * geo.slot_bytes for geo in cache.geometry.values())


def host_block_bytes(cache: "VirtualKVCache") -> int:
    """Bytes of one host block: one block of every tensor of every group."""
    return sum(geo.group.block_bytes for geo in cache.geometry.values())


def plan_host_pool(cache: "VirtualKVCache", host_blocks_factor: float) -> HostPoolSize:
    return host_pool_size(device_capacity_bytes(cache), host_blocks_factor,
                          host_block_bytes(cache))


def attach_host_tier(cache: "VirtualKVCache", prefix: PrefixCache, driver: Any,
                     host_blocks_factor: float, *, vision: bool = False,
                     available_bytes: int | None = None, populate: bool = True
                     ) -> HostTier | None:
    """Preallocate the host pool and start the write-through host tier. ``None`` when
    ``host_blocks_factor <= 1`` (HK-03). Raises :class:`HostTierUnsupported` (HK-05) and
    :class:`~xllm_vmm.kvcache.host_pool.HostPoolTooLarge` (HK-07, with the numbers)."""
    if host_blocks_factor <= 1:
        return None
    reason = host_tier_unsupported_reason(cache.layout, vision=vision)
    if reason:
        raise HostTierUnsupported(f"{reason}; set host_blocks_factor=0 (or <= 1) to run "
                                  "without the host tier")
    size = plan_host_pool(cache, host_blocks_factor)
    check_host_pool_fits(size, available_bytes)
    pool = HostPool(size, driver, populate=populate)
    return HostTier(prefix, pool, driver, KvBlockAddresses(cache))
