"""What the host KV tier needs from a :class:`VirtualKVCache`: block addresses and the
HK-06 pool size of this cache (the manager's factory,
:func:`~xllm_vmm.kvcache.factory.build_kv_cache_manager`, builds the tier with them). The
HK-05 criterion and the HK-06 formula have one home, :mod:`xllm_vmm.kvcache.host_support`
(re-exported here). Units: bytes, blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from xllm_vmm.kvcache import host_support
from xllm_vmm.kvcache.host_support import (  # noqa: F401 (HK-05 lives there; re-exported)
    HOST_TIER_GROUPS,
    HostPoolSize,
    host_pool_size,
    host_tier_unsupported_reason,
)

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.kvcache.cache import VirtualKVCache


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


def device_capacity_bytes(cache: "VirtualKVCache") -> int:
    """The configured device KV tensor capacity: every slot of every group (HK-06)."""
    return sum(geo.num_slots * geo.slot_bytes for geo in cache.geometry.values())


def plan_host_pool(cache: "VirtualKVCache", host_blocks_factor: float) -> HostPoolSize:
    """HK-06 for this cache: :func:`~xllm_vmm.kvcache.host_support.host_pool_size` of its
    configured device capacity and its layout's host block (both formulas live there)."""
    return host_pool_size(device_capacity_bytes(cache), host_blocks_factor,
                          host_support.host_block_bytes(cache.layout))
