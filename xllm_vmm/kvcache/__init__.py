"""The virtual KV cache: cache groups over a pool region, slots, page-aware blocks, admission.

Public API (stable; other packages import these names from here):

- :class:`KVCacheManager` and :func:`build_kv_cache_manager` — the one entry an engine uses
  (request-level verbs: lookup, allocate, commit, free, step; it owns the block tables);
  :class:`PrefixMatch`, :class:`KVCapacity`, :class:`KVCacheStats`, :class:`KVCacheManagerError`.

- :class:`VirtualKVCache` — groups of a ``CacheLayout`` over a ``VmmPool`` tenant region.
- :class:`BlockAllocator` — reference-counted, page-aware allocation, the one owner of block
  state (references, cached / retained flags, transfer pins; see
  :mod:`xllm_vmm.kvcache.allocator`), a façade over one :class:`BlockState` per group (the
  Python and native backends); :class:`Compaction`, what :meth:`VirtualKVCache.compact` did
  (old → new block ids per group, slots released, bytes).
- :class:`Admission`, :class:`AdmissionDecision` — AD-01…AD-04 across workers.
- :class:`SequenceSlots` — resident per-sequence slots (HY-01, AD-03).
"""

from xllm_vmm.kvcache.admission import Admission, AdmissionDecision, CapacitySource
from xllm_vmm.kvcache.allocator import (
    BlockAllocator,
    BlockInfo,
    BlockState,
    Compaction,
    GroupShape,
    SlotBacking,
    SlotInfo,
)
from xllm_vmm.kvcache.cache import (
    CacheCapacity,
    CacheLayoutError,
    GroupCapacity,
    GroupGeometry,
    VirtualKVCache,
    blocks_for_tokens,
    fit_tokens,
    slots_for_tokens,
)
from xllm_vmm.kvcache.factory import build_kv_cache_manager
from xllm_vmm.kvcache.manager import (
    NULL_BLOCK,
    KVCacheManager,
    KVCacheManagerError,
    KVCacheStats,
    KVCapacity,
    PrefixMatch,
)
from xllm_vmm.kvcache.resident import SequenceSlots

__all__ = [
    "Admission",
    "AdmissionDecision",
    "BlockAllocator",
    "BlockInfo",
    "BlockState",
    "CacheCapacity",
    "CacheLayoutError",
    "CapacitySource",
    "Compaction",
    "GroupCapacity",
    "GroupGeometry",
    "GroupShape",
    "KVCacheManager",
    "KVCacheManagerError",
    "KVCacheStats",
    "KVCapacity",
    "NULL_BLOCK",
    "PrefixMatch",
    "SequenceSlots",
    "SlotBacking",
    "SlotInfo",
    "VirtualKVCache",
    "blocks_for_tokens",
    "build_kv_cache_manager",
    "fit_tokens",
    "slots_for_tokens",
]
