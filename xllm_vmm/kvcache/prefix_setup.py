"""What the host KV tier needs from a :class:`VirtualKVCache`: block addresses, the HK-05
support criterion and the HK-06 pool size (the manager's factory,
:func:`~xllm_vmm.kvcache.manager.build_kv_cache_manager`, builds the tier with them).
Units: bytes, blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from xllm_vmm.kvcache.host_pool import HostPoolSize, host_pool_size

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


def device_capacity_bytes(cache: "VirtualKVCache") -> int:
    """The configured device KV tensor capacity: every slot of every group (HK-06)."""
    return sum(geo.num_slots * geo.slot_bytes for geo in cache.geometry.values())


def host_block_bytes(cache: "VirtualKVCache") -> int:
    """Bytes of one host block: one block of every tensor of every group."""
    return sum(geo.group.block_bytes for geo in cache.geometry.values())


def plan_host_pool(cache: "VirtualKVCache", host_blocks_factor: float) -> HostPoolSize:
    return host_pool_size(device_capacity_bytes(cache), host_blocks_factor,
                          host_block_bytes(cache))
