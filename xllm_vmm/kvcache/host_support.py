"""The host KV tier's two rules, in one home for every side that needs them: the HK-05 support
criterion and the HK-06 host-pool size. ``check-config`` (:mod:`xllm_vmm.config.rules`), ``plan``
(:mod:`xllm_vmm.planner.sizing`) and the serving KV cache manager call these functions, so that
what the checker accepts, what the planner sizes and what serving builds cannot drift apart.

Pure functions over a :class:`~xllm_vmm.models.spec.CacheLayout` and integers: nothing here
imports torch, the pool or a driver. Units: bytes, host blocks.

HK-05: the host tier copies flat KV (``attn``), MLA latent + index (``mla``, ``index``) and the
MTP draft's flat KV (``draft``); it refuses a VLM backend, the conv/SSM state of a hybrid
model (a layout with resident state) and any other or window-capped group (sliding window).

HK-06: host capacity = the configured device KV tensor capacity × ``host_blocks_factor``,
preallocated at start (also in elastic mode), in *host blocks* of one block of every tensor of
every group: ``blocks = floor(device_capacity_bytes × factor / host_block_bytes)``; a factor of
1 or less is no host tier (HK-03).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.models.spec import CacheLayout

#: Cache groups the host tier can copy (HK-05 "flat KV and MLA+INDEX", plus the MTP draft, which
#: is flat KV of its own width).
HOST_TIER_GROUPS = frozenset({"attn", "mla", "index", "draft"})


def host_tier_unsupported_reason(layout: "CacheLayout", *, vision: bool = False) -> str | None:
    """Why HK-05 refuses host offload for ``layout`` (None when the tier supports it).
    ``vision``: the model is served by the VLM backend."""
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


@dataclass(frozen=True)
class HostPoolSize:
    """HK-06 sizing: ``blocks`` host blocks of ``block_bytes`` each (``bytes`` in all), for a
    device KV tensor capacity of ``device_capacity_bytes`` at ``factor``."""

    blocks: int
    block_bytes: int
    bytes: int
    factor: float
    device_capacity_bytes: int


def host_block_bytes(layout: "CacheLayout") -> int:
    """Bytes of one host block: one block of every tensor of every group of ``layout``."""
    return sum(g.block_bytes for g in layout.groups)


def host_pool_size(device_capacity_bytes: int, host_blocks_factor: float,
                   host_block_bytes: int) -> HostPoolSize:
    """HK-06: the host pool for a device KV tensor capacity of ``device_capacity_bytes`` (every
    VMM KV tensor of every group, the configured capacity, not what is mapped now). A factor
    of 1 or less means no host tier (HK-03): 0 blocks. Raises ValueError for a non-positive
    host block, a negative or non-finite factor (HK-08) or a negative capacity."""
    if host_block_bytes <= 0:
        raise ValueError(f"host_block_bytes={host_block_bytes}: must be > 0")
    if not math.isfinite(host_blocks_factor):
        raise ValueError(f"host_blocks_factor={host_blocks_factor}: must be a finite number")
    if host_blocks_factor < 0:
        raise ValueError(f"host_blocks_factor={host_blocks_factor}: must be >= 0 (HK-08)")
    if device_capacity_bytes < 0:
        raise ValueError(f"device_capacity_bytes={device_capacity_bytes}: must be >= 0")
    if host_blocks_factor <= 1:
        return HostPoolSize(0, host_block_bytes, 0, host_blocks_factor, device_capacity_bytes)
    blocks = int(device_capacity_bytes * host_blocks_factor) // host_block_bytes
    return HostPoolSize(blocks, host_block_bytes, blocks * host_block_bytes, host_blocks_factor,
                        device_capacity_bytes)
