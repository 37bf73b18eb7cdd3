"""``KVCacheManager``: the one object an engine holds for its KV cache.

Request-level verbs over the virtual KV cache (slots → blocks), the prefix cache (hash index +
LRU of unreferenced blocks) and the host KV tier, in the spirit of vLLM v1's
``KVCacheManager``. The manager owns every request's *block tables* (group → list of block
ids; position ``p`` of the request lives in block ``table[p // block_size]``): compaction moves
and host restores are applied to them by the manager itself, in place, so a list obtained from
:meth:`KVCacheManager.block_tables` stays current and a caller never rewrites one.

Lifecycle of a request (what the engine's scheduler does)::

    hit = mgr.lookup(rid, prompt_ids)             # longest cached prefix, held (pinned)
    tables = mgr.allocate(rid, n, hit=hit,        # fresh: admitted on its whole prompt (AD-04)
                          num_prompt_tokens=len(prompt_ids))
    if tables is None: ...                        # "not now": nothing changed, retry / preempt
    while not mgr.ready(rid): mgr.step()          # a host-tier restore is in flight
    ...run the model on the chunk...
    mgr.commit(rid, num_computed, token_ids)      # publishes every newly complete block
    tables = mgr.allocate(rid, 1)                 # decode growth (lookahead: speculative room)
    mgr.truncate(rid, kept)                       # speculative tokens rejected: tail blocks back
    mgr.free(rid)                                 # blocks cached or freed (transfer pins kept)
    mgr.step()                                    # once per engine iteration

Invariants (checked by ``tests/kvcache/test_manager.py`` and the state machine
over the manager, ``tests/prefix/test_stateful_real.py``):

- Every block id in a request's table is referenced by that request (ref ≥ 1) until
  :meth:`~KVCacheManager.free`; table length = ⌈(tokens covered) / block_size⌉ in every group
  (one block size across groups). A sliding-window group (``max_tokens_per_seq`` = window
  ``w``) gives back the blocks wholly outside the window as the request advances: with ``N``
  tokens committed the next query attends to positions ``≥ N − w + 1``, so its table's first
  ``(N − w + 1) // block_size`` entries become :data:`NULL_BLOCK` and those blocks go back
  (published ones stay cached and findable, like vLLM v1's ``SlidingWindowManager``), at
  :meth:`~KVCacheManager.allocate` — before it takes new blocks, so decode reuses them.
- A held hit's device blocks are referenced from :meth:`~KVCacheManager.lookup` until
  :meth:`~KVCacheManager.allocate` or :meth:`~KVCacheManager.drop` / :meth:`free`; its host
  blocks are pinned in the host pool for the same time (never evicted in between).
- ``allocate`` returning ``None`` changed nothing a caller can see: no table grew, the held
  hit is still held (cached blocks may have been evicted to make room, and the pool rolled
  back every page it mapped in that call — invariant 3).
- A block a transfer (offload / restore copy) uses stays pinned until the copy ends, also when
  its request is freed (invariant 4).
- Only complete blocks whose KV is written are published (PC-01: chunked prefill publishes a
  block once all its tokens are committed; PC-02: a hybrid model's hit is cut back to the last
  block with a linear-state checkpoint, so without checkpoints it never hits).

Where the interface departs from vLLM's (kept names; the nearest sound thing):

- ``mm_hashes`` is a sequence of :class:`~xllm_vmm.kvcache.hashing.MediaSpan` (offset and
  length in tokens, content hash): a bare hash cannot say which blocks it overlaps.
- A host-tier restore can fail. :meth:`KVCacheManager.ready` then returns ``True`` and
  :meth:`KVCacheManager.num_computed_tokens` drops back to the device hit: the engine computes
  from there (the blocks stay allocated to the request).
- :meth:`KVCacheManager.drop` is the verb for a looked-up request that is never allocated; on
  an allocated one it is :meth:`free`.
- :meth:`KVCacheManager.close` does not close the pool (the caller built it and owns it); a
  factory call that raises (HK-05, HK-07, bad tuning, a failed mapping or host allocation)
  leaves nothing on the pool: no ``kv`` tenant, its arena space and pages given back, no host
  buffer.
- ``compact`` (and ``wait_ready``, ``num_computed_tokens``, ``drop``) are additions; tuning
  keys are listed in ``_TUNING``.

Multi-worker (a worker set, ``xllm_vmm.engine.distributed``): slot activation goes through :attr:`VirtualKVCache` as the
allocator's ``SlotBacking`` (``activate(slots)`` / ``deactivate(slots)`` / ``move(moves)``); a
fan-out object implementing the same three calls for several workers replaces it there.

Units: tokens (``num_*_tokens``), blocks (ids, counts), bytes (``*_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

from xllm_vmm.kvcache.allocator import Compaction
from xllm_vmm.kvcache.cache import CacheLayoutError, VirtualKVCache, fit_tokens
from xllm_vmm.kvcache.hashing import (
    DEFAULT_SEED,
    BlockHash,
    MediaSpan,
    block_hashes,
    request_extra_keys,
)
from xllm_vmm.kvcache.host_pool import HostPool, check_host_pool_fits
from xllm_vmm.kvcache.host_tier import HostTier, Restore
from xllm_vmm.kvcache.prefix import PrefixCache
from xllm_vmm.kvcache.host_support import host_tier_unsupported_reason
from xllm_vmm.kvcache.prefix_setup import HostTierUnsupported, KvBlockAddresses, plan_host_pool

__all__ = [
    "NULL_BLOCK",
    "KVCacheManager",
    "KVCacheManagerError",
    "KVCapacity",
    "PrefixMatch",
    "build_kv_cache_manager",
]


NULL_BLOCK = -1
"""A block-table entry of a sliding-window group whose block was given back (wholly outside
the window): never read by attention, never a block id."""


class KVCacheManagerError(RuntimeError):
    """Misuse of the manager's verbs (unknown request, a hit from another request, sleep with
    requests holding blocks, allocation while asleep); the message says what to do."""


class PrefixMatch(NamedTuple):
    """What :meth:`KVCacheManager.lookup` found for ``request_id``.

    ``num_tokens`` = ``num_device_tokens + num_host_tokens``: the first ``num_tokens`` tokens
    of the prompt need no compute; always a multiple of the block size and at most
    ``len(token_ids) - 1`` (the last prompt token is always computed so that logits exist).
    ``num_host_tokens`` come back from the host tier by a restore started in
    :meth:`KVCacheManager.allocate`. ``checkpoint``: a hybrid model's linear-state checkpoint
    at the end of the device hit (PC-02), else ``None``. Immutable (a named tuple); identity
    matters: ``allocate`` takes only the match object its request holds now."""

    request_id: str
    num_tokens: int
    num_device_tokens: int
    num_host_tokens: int
    checkpoint: Any = None


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


class _RequestHot(dict):
    """A request's block tables (the mapping group → list of block ids that :meth:`allocate`
    and :meth:`block_tables` return) with the two fields the per-token verbs read and write
    (``allocate`` of a decode token that fits, ``commit`` of one that completes no block):
    ``num_computed`` and ``upto``.

    ``upto`` (tokens) is the most tokens a :meth:`~KVCacheManager.commit` may record with no
    other effect: ``min(cap, publish_at - 1)`` while no host restore is in flight, ``-1``
    otherwise (and until the request is admitted: ``cap`` is -1). So ``n <= upto`` says at
    once that ``n`` tokens lie within the request's blocks, complete no block and may be
    committed; and since ``upto <= cap``, an ``allocate`` whose tokens fit under ``upto``
    needs no block. Every change of ``cap``, ``publish_at`` or ``restore`` recomputes it
    (:func:`_set_upto`; ``check_invariants`` checks it).

    The record *is* the tables mapping (a slotted ``dict`` subclass) so that the decode
    token's ``allocate``, which returns the tables, touches one object per request instead of
    two: at thousands of running requests each request's first touch in a step misses the
    cache, one line per object (the object header: its reference count). The record starts
    on a cache line (its 16 slots make it 192 bytes with the GC header, a multiple of 64), and
    the two hot fields are declared in this base class so that CPython lays them out first,
    right after the dict's own 48 bytes (it sorts a class's ``__slots__`` by name, base class
    slots first): a decode token's ``allocate`` and ``commit`` touch that one line of the
    record. One object fewer per request is also one fewer for the cyclic GC to track."""

    __slots__ = ("num_computed", "upto")


class _Request(_RequestHot):
    """The manager's state of one request and its block tables (its ``dict`` items: group →
    list of block ids; see :class:`_RequestHot`). A plain slotted class: one is made per
    request on the hot path, so no generated ``__init__`` with default factories."""

    __slots__ = ("rid", "cap", "publish_at", "restore", "hashes", "parent", "media", "extra",
                 "published", "match", "held", "held_host", "first", "trimmed")

    def __init__(self, rid: str, groups: tuple[str, ...]) -> None:
        if len(groups) == 1:  # most models (no loop to set up)
            self[groups[0]] = []
        else:
            for g in groups:
                self[g] = []
        self.rid = rid
        self.num_computed = 0  # tokens whose KV is written (or restored / hit)
        self.upto = -1  # see _RequestHot
        # the hashes of the complete blocks hashed so far: all of them from block 0 while
        # parent is None; once a one-group commit dropped the published ones (see commit),
        # those from block `published` on, and parent is the hash of block published - 1
        self.hashes: list[BlockHash] = _NO_HASHES
        self.parent: BlockHash | None = None
        self.media: tuple[MediaSpan, ...] = ()
        self.extra: tuple[str, ...] = ()  # extra hash keys of block 0 (adapter, cache salt)
        self.published = 0  # request blocks [0, published) are in the index (or hit)
        # the held hit (lookup → allocate): device blocks referenced, host blocks pinned
        self.match: PrefixMatch | None = None
        self.held: dict[str, list[int]] | None = None
        self.held_host: list[int] = _NO_HOST  # replaced (never appended to) when it holds some
        # a restore in flight (allocate → ready)
        self.restore: Restore | None = None  # its first_block: the device hit's blocks
        self.first: list[int] = _NO_HOST  # self[first group] (the same list) once admitted
        # tokens its blocks cover (len(first) × block_size); -1 until admitted (allocate()
        # succeeded once): ``cap >= 0`` is "admitted"
        self.cap = -1
        self.publish_at = 1 << 62  # committing this many tokens completes the next block
        # sliding-window groups: leading table entries given back (NULL_BLOCK), per group
        self.trimmed: dict[str, int] | None = None


def _set_upto(req: _RequestHot) -> None:
    """Recompute ``req.upto`` after ``cap``, ``publish_at`` or ``restore`` changed (see
    :class:`_RequestHot`)."""
    if req.restore is not None:  # type: ignore[attr-defined]
        req.upto = -1
    else:
        cap, pa = req.cap, req.publish_at  # type: ignore[attr-defined]
        req.upto = cap if cap < pa else pa - 1


_NO_HOST: list[int] = []  # shared empty default (never mutated)
_NO_HASHES: list[BlockHash] = []  # shared empty default (never mutated: commit replaces it)
_new_match = tuple.__new__  # PrefixMatch without its Python-level __new__ (hot path)


_TUNING = {
    "compact": "bool: compact in step() when whole slots can be reclaimed (elastic pools)",
    "compact_min_slots": "int >= 1: reclaimable slots (any group) that make a compaction worth it",
    "compact_max_blocks": "int >= 1 or None: blocks moved by one step() at most (default 64)",
    "ready_slots": "int >= 0: slots of pages step() creates ahead of demand (elastic; default 1)",
    "host_available_bytes": "int: host memory the host pool may take (HK-07; default MemAvailable)",
    "host_populate": "bool: commit the host pool's pages at start (HK-06; default True)",
}


class KVCacheManager:
    """Request-level KV cache verbs over one worker's :class:`VirtualKVCache` (see the module
    docstring for the lifecycle and invariants). Build it with :func:`build_kv_cache_manager`.

    The optional parameters of the verbs are positional-or-keyword, not keyword-only; pass
    them by keyword. CPython 3.11 does not specialise a call to a function with keyword-only
    parameters, and that costs about 40 ns per call (measured here), a large share of a
    per-token verb.

    Slotted: CPython 3.11 keeps at most 30 attributes of an instance in its fast shared-key
    layout; past that every ``self.x`` of the hot paths becomes a slower dict lookup.
    """

    __slots__ = ("_cache", "block_size", "_bs_1", "group_names", "_g0", "_sole", "_windows",
                 "prefix", "host", "_chain", "_alloc_group", "_free_group_lru",
                 "_acquire_chain", "_pg", "_keep", "hash_seed", "_plain_seed", "_alloc",
                 "_reqs", "_restoring", "_asleep", "_closed", "_compact", "_compact_min_slots",
                 "_compact_max_blocks", "_elastic", "_ready_pages", "_ready_fill",
                 "_pool_ready_pages", "compactions", "blocks_compacted",
                 "bytes_compacted_released", "restore_failures")

    def __init__(self, cache: VirtualKVCache, *, prefix: PrefixCache | None = None,
                 host: HostTier | None = None, hash_seed: int = DEFAULT_SEED,
                 compact: bool = True, compact_min_slots: int = 2,
                 compact_max_blocks: int | None = 64, ready_slots: int = 1) -> None:
        sizes = {geo.group.block_size for geo in cache.geometry.values()}
        if len(sizes) != 1:
            raise CacheLayoutError(f"the KV cache manager needs one block_size across cache "
                                   f"groups, got {sorted(sizes)}")
        if compact_min_slots < 1:
            raise ValueError(f"compact_min_slots must be >= 1, got {compact_min_slots}")
        if compact_max_blocks is not None and compact_max_blocks < 1:
            raise ValueError(f"compact_max_blocks must be >= 1 or None, got {compact_max_blocks}")
        if not isinstance(ready_slots, int) or ready_slots < 0:
            raise ValueError(f"ready_slots must be an int >= 0 (slots of pages created ahead of "
                             f"demand), got {ready_slots!r}")
        self._cache = cache
        self.block_size: int = sizes.pop()
        self._bs_1 = self.block_size - 1
        self.group_names: tuple[str, ...] = tuple(cache.geometry)
        self._g0 = self.group_names[0]
        self._sole = len(self.group_names) == 1
        # sliding-window groups: (group, window in tokens); empty for most models
        self._windows: tuple[tuple[str, int], ...] = tuple(
            (n, geo.group.max_tokens_per_seq) for n, geo in cache.geometry.items()
            if geo.group.max_tokens_per_seq is not None)
        self.prefix = prefix
        self.host = host
        # one group, prefix caching without a host tier or checkpoints: lookup is one
        # acquire_chain call (most models)
        self._chain = (self._sole and prefix is not None and host is None
                       and not prefix.hybrid and not self._windows)
        # the one-group hot paths below call these directly (bound once)
        self._alloc_group = cache.allocator.allocate_group
        self._free_group_lru = cache.allocator.free_group_lru
        self._acquire_chain = prefix.acquire_chain if self._chain else None  # type: ignore
        self._pg = prefix._groups[self._g0] if self._chain else None  # index + LRU of g0
        self._keep = cache.allocator._groups[self._g0].keep if self._chain else None
        self.hash_seed = hash_seed
        self._plain_seed = hash_seed == DEFAULT_SEED
        self._alloc = cache.allocator
        self._reqs: dict[str, _Request] = {}
        self._restoring: dict[str, _Request] = {}  # requests with a host restore in flight
        self._asleep = False
        self._closed = False
        self._compact = compact
        self._compact_min_slots = compact_min_slots
        self._compact_max_blocks = compact_max_blocks
        self._elastic = cache.pool.mode.value == "elastic"
        # growth headroom (elastic): up to ready_slots slots of the widest group's pages are
        # created ahead of demand by step(), _ready_fill a step, and freed when idle
        pool = cache.pool
        self._ready_pages = (ready_slots * max(g.num_tensors for g in cache.geometry.values())
                             if self._elastic else 0)
        self._ready_fill = -(-self._ready_pages // 8)
        self._pool_ready_pages = pool.ready_pages  # restored by close()
        if self._ready_pages > pool.ready_pages:
            pool.ready_pages = self._ready_pages
        self.compactions = 0
        self.blocks_compacted = 0
        self.bytes_compacted_released = 0
        self.restore_failures = 0

    # -- properties ----------------------------------------------------------------------
    @property
    def cache(self) -> VirtualKVCache:
        """The worker-side cache (tensors over the arena); block ``b`` of group ``g`` is at
        ``cache.block_address(g, tensor, b)``."""
        return self._cache

    @property
    def enable_prefix_cache(self) -> bool:
        return self.prefix is not None

    @property
    def num_requests(self) -> int:
        """Requests the manager knows (looked up or allocated, not yet freed)."""
        return len(self._reqs)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reqs

    def _req(self, request_id: str) -> _Request:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise KVCacheManagerError(f"unknown request {request_id!r}: lookup() or "
                                      "allocate() it first (or it was freed)") from None

    def _new(self, request_id: str) -> _Request:
        return _Request(request_id, self.group_names)

    # -- lookup --------------------------------------------------------------------------
    def lookup(self, request_id: str, token_ids: Sequence[int],
               mm_hashes: Sequence[MediaSpan] = (), cache_salt: str | None = None,
               lora: str | int | None = None) -> PrefixMatch:
        """The longest cached prefix of the prompt ``token_ids``: device blocks first, then the
        host tier's consecutive blocks after them, by the same XXH3-128 chain (tokens and the
        multimodal spans ``mm_hashes``). The hit is held — device blocks referenced, host
        blocks pinned — until :meth:`allocate` of this request or :meth:`drop`. A second lookup
        of the same (not yet allocated) request replaces the held hit. Without prefix caching
        the match is empty (the request is still registered).

        ``cache_salt`` (vLLM's request field) and ``lora`` (the adapter's name or id; ``None``
        = the base model) are extra keys of the request's first block
        (:func:`~xllm_vmm.kvcache.hashing.request_extra_keys`): every block the request
        publishes chains over them, so requests that differ in either never share a block,
        on the device or on the host tier."""
        req = self._reqs.get(request_id)
        if req is not None and req.cap >= 0:  # admitted
            raise KVCacheManagerError(f"lookup of request {request_id!r}, which is already "
                                      "allocated; free() it first")
        if req is None:
            req = self._reqs[request_id] = _Request(request_id, self.group_names)
        else:
            self._release_hold(req)
        media = mm_hashes if type(mm_hashes) is tuple else tuple(mm_hashes)
        req.media = media
        if cache_salt is not None or lora is not None:
            extra = req.extra = request_extra_keys(cache_salt=cache_salt, lora=lora)
        else:
            extra = req.extra = ()
        bs = self.block_size
        prefix = self.prefix
        if prefix is None:
            m = PrefixMatch(request_id, 0, 0, 0)
            req.match = m
            return m
        if media or extra or not self._plain_seed:
            hashes = block_hashes(token_ids, bs, seed=self.hash_seed, media=media,
                                  extra_keys=extra)
        else:  # the same chain; no keyword handling (most requests)
            hashes = block_hashes(token_ids, bs)
        req.hashes = hashes
        cap = (len(token_ids) - 1) // bs if token_ids else 0
        if self._chain:  # PrefixCache.acquire_chain (lookup + acquire), one group
            blocks = self._acquire_chain(hashes, cap)
            req.held = {self._g0: blocks}
            n = len(blocks) * bs
            m = _new_match(PrefixMatch, (request_id, n, n, 0, None))
            req.match = m
            return m
        hit = prefix.lookup(hashes, max_blocks=cap)
        prefix.acquire(hit)
        n_dev = hit.num_blocks
        req.held = {g: list(hit.blocks[g]) for g in self.group_names}
        n_host = 0
        host = self.host
        if host is not None and n_dev < cap:
            n_host = host.match(hashes, n_dev, max_blocks=cap)
            pool = host.pool
            held_host = []
            for h in hashes[n_dev:n_dev + n_host]:
                hb = pool.lookup(h)
                pool.pin(hb)  # type: ignore[arg-type]
                held_host.append(hb)
            if held_host:
                req.held_host = held_host  # type: ignore[assignment]
        m = PrefixMatch(request_id, (n_dev + n_host) * bs, n_dev * bs, n_host * bs,
                        hit.checkpoint)
        req.match = m
        return m

    def _release_hold(self, req: _Request) -> None:
        """Give back a held hit (device references, host pins)."""
        if req.held is not None:
            if self.prefix is not None and any(req.held.values()):
                self._offload(self.prefix.release(req.held))
            req.held = None
        if req.held_host:
            pool = self.host.pool  # type: ignore[union-attr]
            for hb in req.held_host:
                pool.unpin(hb)
            req.held_host = _NO_HOST
        req.match = None

    # -- allocate ------------------------------------------------------------------------
    def allocate(self, request_id: str, num_new_tokens: int, hit: PrefixMatch | None = None,
                 lookahead: int = 0, num_prompt_tokens: int | None = None
                 ) -> dict[str, list[int]] | None:
        """Make the request's block tables cover ``num_computed + num_new_tokens + lookahead``
        tokens and return them (group → block ids; the manager's own lists).

        ``num_computed``: tokens committed so far; for a fresh request, the tokens of ``hit``
        (the match :meth:`lookup` returned for it; ``None``: no hit, a held one is given back).
        A fresh request is admitted against its whole prompt footprint,
        ``num_prompt_tokens`` (default: ``num_computed + num_new_tokens``) plus ``lookahead``,
        even when this call allocates only its first chunk (AD-04); a running one takes the
        blocks its new tokens need (decode growth: one block at a time, next to its last
        block). A host hit starts its restore here (:meth:`ready` is ``False`` until it ends).

        ``None`` = "not now": nothing changed (see the module docstring); retry later or
        preempt something."""
        try:  # a subscript, not dict.get: a specialised dict lookup, no method call
            req = self._reqs[request_id]
        except KeyError:
            req = None
        if req is not None and hit is None and num_new_tokens >= 0 <= lookahead:
            # a running request (decode growth): the hot path (never asleep: sleep needs no
            # request to hold blocks); ``cap`` (and ``upto``) is -1 until it is admitted
            if self._windows and req.cap >= 0:
                self._trim(req)  # blocks that left the window first: growth reuses them
            tokens = req.num_computed + num_new_tokens + lookahead
            if tokens <= req.upto:  # upto <= cap: the record's first line only
                return req
            if tokens <= req.cap:
                return req
            if req.cap >= 0:  # admitted
                first = req.first
                need = (tokens + self._bs_1) // self.block_size - len(first)
                if self._sole:  # one group: next to its last block, no dicts
                    new1 = self._alloc_group(self._g0, need, first[-1] if first else -1)
                    if new1 is not None:
                        first += new1
                        cap = req.cap = len(first) * self.block_size
                        if req.restore is None:  # _set_upto, inline
                            pa = req.publish_at
                            req.upto = cap if cap < pa else pa - 1
                        return req
                return self._grow(req, first, need)
        elif (self._chain and req is not None and hit is not None and req.match is hit
              and num_prompt_tokens is None and num_new_tokens >= 0 <= lookahead
              and not self._asleep):
            # a fresh request with its held hit, one group, prefix caching only (most
            # models): _admit's sole-group path without its general bookkeeping
            bs = self.block_size
            first = req.held[self._g0]  # type: ignore[index]
            n_dev = len(first)
            need = (n_dev * bs + num_new_tokens + lookahead + self._bs_1) // bs - n_dev
            if need > 0:
                new0 = self._alloc_group(self._g0, need)
                if new0 is None:  # eviction first: the general path (nothing changed yet)
                    return self._admit(request_id, req, num_new_tokens, hit, lookahead, None)
                first += new0
            req[self._g0] = first
            req.first = first
            cap = req.cap = len(first) * bs  # admitted
            req.held = req.match = None
            req.num_computed = n_dev * bs
            req.published = n_dev
            pa = req.publish_at = (n_dev + 1) * bs
            req.upto = cap if cap < pa else pa - 1  # _set_upto (no restore: no host tier)
            return req
        if self._asleep:
            raise KVCacheManagerError("allocate while the KV cache is asleep: wake_up() first")
        if num_new_tokens < 0 or lookahead < 0:
            raise ValueError(f"allocate({request_id!r}): num_new_tokens={num_new_tokens} and "
                             f"lookahead={lookahead} must be >= 0 tokens")
        if req is not None and req.cap >= 0:  # admitted
            raise KVCacheManagerError(f"allocate({request_id!r}, hit=...): the request is "
                                      "already running; a hit applies to its first "
                                      "allocation only")
        return self._admit(request_id, req, num_new_tokens, hit, lookahead, num_prompt_tokens)

    def _grow(self, req: _Request, first: list[int], need: int) -> dict[str, list[int]] | None:
        """``need`` more blocks in every group, next to the request's last ones."""
        if self._sole:
            new1 = self._alloc.allocate_group(self._g0, need, first[-1] if first else -1)
            if new1 is None:
                g = self._g0
                near = {g: first[-1]} if first else None
                new = self._evict_and_allocate({g: need}, near)
                if new is None:
                    return None
                new1 = new[g]
            first.extend(new1)
            req.cap = len(first) * self.block_size
            _set_upto(req)
            return req
        near = {g: t[-1] for g, t in req.items()} if first else None
        counts = {g: need for g in self.group_names}
        new = self._alloc.allocate(counts, near)
        if new is None:
            new = self._evict_and_allocate(counts, near)
            if new is None:
                return None
        for g, ids in new.items():
            req[g].extend(ids)
        req.cap = len(first) * self.block_size
        _set_upto(req)
        return req

    def _admit(self, request_id: str, req: _Request | None, num_new_tokens: int,
               hit: PrefixMatch | None, lookahead: int, num_prompt_tokens: int | None
               ) -> dict[str, list[int]] | None:
        if hit is not None and (req is None or req.match is not hit):
            raise KVCacheManagerError(
                f"allocate({request_id!r}, hit=...): that match is not the one lookup() holds "
                "for this request (another request's, replaced by a later lookup, or dropped)")
        bs = self.block_size
        n_dev = hit.num_device_tokens // bs if hit is not None else 0
        n_host = hit.num_host_tokens // bs if hit is not None else 0
        computed = (n_dev + n_host) * bs
        total = computed + num_new_tokens + lookahead
        prompt = computed + num_new_tokens if num_prompt_tokens is None else num_prompt_tokens
        if prompt < computed:
            raise ValueError(f"allocate({request_id!r}): num_prompt_tokens={prompt} is less "
                             f"than the {computed} tokens of its hit")
        n_blocks = -(-total // bs)
        groups = self.group_names
        if prompt + lookahead > total:  # a first chunk: admit on the whole prompt (AD-04)
            foot = -(-(prompt + lookahead) // bs) - n_dev
            if not self._cache.capacity(self._evictable()).fits({g: foot for g in groups}):
                return None
        need = n_blocks - n_dev
        if self._sole:  # one group: lists, no per-group dicts
            g0 = self._g0
            new0 = self._alloc.allocate_group(g0, need) if need > 0 else []
            if new0 is None:
                got = self._evict_and_allocate({g0: need}, None)
                if got is None:
                    return None
                new0 = got[g0]
            if req is None:
                req = self._reqs[request_id] = self._new(request_id)
            if hit is None:
                self._release_hold(req)
                first = new0
            else:
                first = req.held[g0] + new0 if req.held else new0
            req[g0] = first
            new = {g0: new0}
        else:
            if need > 0:
                counts = {g: need for g in groups}
                new = self._alloc.allocate(counts)
                if new is None:
                    new = self._evict_and_allocate(counts, None)
                    if new is None:
                        return None
            else:
                new = {g: [] for g in groups}
            if req is None:
                req = self._reqs[request_id] = self._new(request_id)
            if hit is None:
                self._release_hold(req)
                held = {g: [] for g in groups}
            else:
                held = req.held or {g: [] for g in groups}
            for g in groups:
                req[g] = held[g] + new[g]
            first = req[self._g0]
        req.first = first
        req.cap = len(req.first) * bs  # admitted
        req.held = None
        req.match = None
        req.num_computed = computed
        req.published = n_dev
        req.publish_at = (n_dev + 1) * bs if self.prefix is not None else 1 << 62
        if n_host:
            host = self.host
            assert host is not None
            r = host.restore(req.hashes[n_dev:n_dev + n_host], n_dev,
                             {g: new[g][:n_host] for g in groups})
            r.update(req)  # positions that joined another restore in flight
            req.restore = r
            self._restoring[request_id] = req
        _set_upto(req)
        if req.held_host:  # the restore pinned what it reads; the lookup's hold ends
            pool = self.host.pool  # type: ignore[union-attr]
            for hb in req.held_host:
                pool.unpin(hb)
            req.held_host = _NO_HOST
        if self._windows:
            self._trim(req)  # a long hit's blocks outside the window go back at once
        return req

    def _trim(self, req: _Request) -> int:
        """Sliding-window groups: give back the blocks wholly outside the window of the next
        query (positions ``< num_computed − w + 1``), replacing their entries by
        :data:`NULL_BLOCK`. With prefix caching only published blocks are trimmed (a block
        is published once committed, so this holds back nothing in practice, and
        :meth:`~PrefixCache.publish` never sees a null entry); published blocks become cached
        (findable by later requests until evicted). Returns the blocks given back."""
        n_done = req.num_computed
        bs = self.block_size
        done = req.trimmed
        freed = 0
        for g, w in self._windows:
            k = (n_done - w + 1) // bs
            if self.prefix is not None and k > req.published:
                k = req.published
            start = done.get(g, 0) if done is not None else 0
            if k <= start:
                continue
            t = req[g]
            blocks = t[start:k]
            t[start:k] = [NULL_BLOCK] * (k - start)
            if done is None:
                done = req.trimmed = {}
            done[g] = k
            if self.prefix is not None:
                self.prefix.release({g: blocks})  # no host tier with windows (HK-05)
            else:
                self._alloc.free({g: blocks})
            freed += k - start
        return freed

    # -- progress ------------------------------------------------------------------------
    def ready(self, request_id: str) -> bool:
        """``False`` while a host-tier restore into the request's blocks is in flight. When it
        ends: success — the restored blocks are published and the hit stands; failure —
        :meth:`num_computed_tokens` drops back to the device hit and the engine computes the
        rest into the same blocks."""
        if not self._restoring and request_id in self._reqs:
            return True  # no restore in flight at all (the engine asks for every request)
        req = self._req(request_id)
        r = req.restore
        if r is None:
            return True
        if not r.done():
            return False
        self._finish_restore(req, r)
        return True

    def wait_ready(self, request_id: str) -> bool:
        """Block until :meth:`ready`; ``True`` unless a host restore failed (then the engine
        computes from :meth:`num_computed_tokens`)."""
        req = self._req(request_id)
        r = req.restore
        if r is None:
            return True
        r.wait()
        self._finish_restore(req, r)
        return r.ok

    def _finish_restore(self, req: _Request, r: Restore) -> None:
        req.restore = None
        self._restoring.pop(req.rid, None)
        if r.ok:
            req.published = max(req.published, r.first_block + r.num_blocks)
            req.publish_at = (req.published + 1) * self.block_size
        else:
            self.restore_failures += 1
            req.num_computed = r.first_block * self.block_size  # the device hit
            req.published = min(req.published, r.first_block)
            req.publish_at = (req.published + 1) * self.block_size
        _set_upto(req)

    def num_computed_tokens(self, request_id: str) -> int:
        """Tokens of the request whose KV is in its blocks (hit, restored or committed)."""
        try:  # one frame (the engine asks for every running request every step)
            return self._reqs[request_id].num_computed
        except KeyError:
            return self._req(request_id).num_computed  # raises, naming the request

    def commit(self, request_id: str, num_computed_tokens: int,
               token_ids: Sequence[int],
               checkpoints: Mapping[int, tuple[Any, int]] | None = None) -> None:
        """``num_computed_tokens`` tokens of ``token_ids`` (the request's tokens so far: prompt
        then output) now hold KV: publish every block that became complete (PC-01), hashing
        only the new complete blocks (the chain continues from the last hash).
        ``checkpoints`` (hybrid models, PC-02): request block index -> ``(state, nbytes)``, the
        linear-state checkpoint at the end of that block, published with it.

        Refused (nothing changes): an unknown or not yet allocated request, one whose host
        restore is in flight, ``num_computed_tokens`` outside ``0..`` the tokens its blocks
        cover. ``token_ids`` is read only when a block completes, and its length is checked
        then (``num_computed_tokens <= len(token_ids)``): a commit that completes no block
        (most decode tokens) touches nothing but the request's record."""
        try:  # a subscript, not dict.get (see allocate)
            req = self._reqs[request_id]
        except KeyError:
            req = None
        else:
            if 0 <= num_computed_tokens <= req.upto:  # completes no block (see _RequestHot)
                req.num_computed = num_computed_tokens
                return
        if (req is None or req.restore is not None or not 0 <= num_computed_tokens <= req.cap
                or num_computed_tokens > len(token_ids)):  # cap is -1 until admitted
            self._refuse_commit(request_id, num_computed_tokens, token_ids)
        req.num_computed = num_computed_tokens  # type: ignore[union-attr]
        if num_computed_tokens < req.publish_at:  # type: ignore[union-attr]
            return  # no block became complete (always, without prefix caching)
        prefix = self.prefix
        bs = self.block_size
        full = num_computed_tokens // bs
        hashes = req.hashes
        first = req.published
        base = first if req.parent is not None else 0  # hashes[0] is block base's
        have = base + len(hashes)
        if have < full:
            parent = hashes[-1] if hashes else req.parent  # None for block 0
            if have and not req.media and self._plain_seed:  # extra keys are in block 0 only
                more = block_hashes(token_ids[have * bs:full * bs], bs, parent=parent,
                                    first_block=have)
            else:
                more = block_hashes(
                    token_ids[have * bs:full * bs], bs, seed=self.hash_seed, media=req.media,
                    extra_keys=req.extra, parent=parent, first_block=have)
            if hashes:
                hashes.extend(more)
            else:  # the shared empty list is never extended
                req.hashes = hashes = more
        if self._chain and not checkpoints:
            # PrefixCache.publish of request blocks [first, full) for the one-group cache
            # without checkpoints, written flat (the index, the allocator's retained flags,
            # the counters; tests/kvcache/test_hot_paths.py checks it against publish). A
            # conflict (a block already indexed under another hash) undoes what it did and
            # lets publish raise.
            pg = self._pg
            h2b = pg.hash_to_block  # type: ignore[union-attr]
            b2h = pg.block_hash  # type: ignore[union-attr]
            get = h2b.get
            keep = self._keep
            ids = req.first
            fresh: list[int] = []
            dup = 0
            for i in range(first, full):
                h = hashes[i - base]
                b = ids[i]
                e = get(h)
                if e is None:
                    if b in b2h:  # undo, then the reference path raises (nothing changed)
                        for fb in fresh:
                            del h2b[b2h.pop(fb)]
                            keep[fb] = 0  # type: ignore[index]
                        prefix.publish({self._g0: ids},  # type: ignore
                                       hashes[first - base:full - base], first_block=first)
                        raise AssertionError("unreachable: publish refuses the conflict")
                    h2b[h] = b
                    b2h[b] = h
                    keep[b] = 1  # type: ignore[index]  # retain (the block is live: ref >= 1)
                    fresh.append(b)
                elif e != b:
                    dup += 1
            st = prefix._stats  # type: ignore[union-attr]
            if dup:
                st.duplicate_publishes += dup
            if fresh:
                n = len(fresh)
                st.published_blocks += n
                st.indexed_hashes += n
        else:
            prefix.publish(req, hashes[first - base:full - base],  # type: ignore
                           first_block=first, checkpoints=checkpoints)
        if self._chain:
            # one group without a host tier: nothing reads a published block's hash from
            # the request again. Keep the chain's parent (block full - 1's hash) and the
            # hashes beyond it (a chunked prompt's blocks not committed yet), drop the rest
            # now, while they are in cache, rather than when the request is freed: a decoding
            # request then holds no hash list at all (one object fewer per request for its
            # free and the cyclic GC to touch)
            k = full - base
            req.parent = hashes[k - 1]
            req.hashes = hashes[k:] if k < len(hashes) else _NO_HASHES
        req.published = full
        pa = req.publish_at = (full + 1) * bs
        cap = req.cap  # _set_upto, inline (no restore: refused above)
        req.upto = cap if cap < pa else pa - 1

    def _refuse_commit(self, request_id: str, num_computed_tokens: int,
                       token_ids: Sequence[int]) -> None:
        req = self._req(request_id)
        if req.cap < 0:
            raise KVCacheManagerError(f"commit({request_id!r}) before allocate()")
        if req.restore is not None:
            raise KVCacheManagerError(f"commit({request_id!r}) while its host restore is in "
                                      "flight: wait until ready() is True")
        covered = len(req[self._g0]) * self.block_size
        raise ValueError(f"commit({request_id!r}): num_computed_tokens={num_computed_tokens} "
                         f"must be within 0..min(tokens in its blocks {covered}, "
                         f"len(token_ids) {len(token_ids)})")

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Shrink the request's block tables (every group) to exactly
        ``ceil(num_tokens / block_size)`` blocks; the blocks beyond go back to the allocator
        at once, tail first. Used for rejected speculative tokens:
        ``allocate(rid, 1, lookahead=K)``, run, ``commit`` the accepted tokens, then
        ``truncate(rid, kept)``; the next :meth:`allocate` grows from the committed count
        again.

        Requires ``num_computed_tokens(rid) <= num_tokens <= tokens its blocks cover``
        (``ValueError`` naming ``num_tokens`` otherwise; nothing changes). Because a block is
        published only by :meth:`commit` of all its tokens, every block released here is
        unpublished and referenced by this request alone (a held prefix hit, host-tier
        restores and published blocks all lie below the committed count); a released block
        a transfer still pins stays allocated until the transfer ends (invariant 4).
        The table lists are shortened in place (lists from :meth:`block_tables` stay
        current). Returns the number of blocks released per group (the same in every group:
        tables have equal length)."""
        req = self._req(request_id)
        if req.cap < 0:
            raise KVCacheManagerError(f"truncate({request_id!r}) before allocate()")
        bs = self.block_size
        first = req.first
        covered = len(first) * bs
        if not isinstance(num_tokens, int) or not req.num_computed <= num_tokens <= covered:
            raise ValueError(
                f"truncate({request_id!r}): num_tokens={num_tokens!r} must be within "
                f"{req.num_computed}..{covered} (committed tokens .. tokens in its blocks); "
                "a committed block cannot be taken back")
        keep = (num_tokens + self._bs_1) // bs
        n = len(first) - keep
        if n <= 0:
            return 0
        tail = {g: t[keep:] for g, t in req.items()}
        for t in req.values():
            del t[keep:]
        req.cap = keep * bs
        _set_upto(req)
        if self.prefix is not None:
            cached = self.prefix.release(tail)  # unpublished: nothing becomes cached
            if cached and self.host is not None:
                self.host.offload(cached)
        else:
            self._alloc.free(tail)
        return n

    def free(self, request_id: str) -> None:
        """The request is finished or aborted: its blocks are given back tail first (published
        ones stay cached, the rest are freed; blocks a copy still uses stay pinned until it
        ends, invariant 4), and a held hit is dropped. Unknown ids are ignored (idempotent)."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        if self._chain and req.cap >= 0:  # admitted
            # PrefixCache.release's one-group path, flat: no host tier (no restore, no host
            # pins) and an admitted request holds no hit; tail first, retained blocks join
            # the LRU in that order
            first = req.first
            if first:
                self._free_group_lru(self._g0, first, self._pg.lru)  # type: ignore
            if not self._reqs and self._ready_pages:
                self._cache.pool.drain_ready()  # idle: no growth headroom held
            return
        if req.match is not None or req.held is not None or req.held_host:
            self._release_hold(req)
        if req.restore is not None:
            req.restore.cancel()
            req.restore = None
            self._restoring.pop(request_id, None)
        if req.cap >= 0:  # admitted
            tables: Mapping[str, list[int]] = req
            if req.trimmed:  # sliding-window groups: their leading null entries hold nothing
                tables = {g: t[req.trimmed.get(g, 0):] for g, t in tables.items()}
            if self.prefix is not None:
                cached = self.prefix.release(tables)
                if cached and self.host is not None:  # write-through (see _offload)
                    self.host.offload(cached)
            elif tables[self.group_names[0]]:
                self._alloc.free(tables)
        if not self._reqs and self._ready_pages:
            self._cache.pool.drain_ready()  # idle: no growth headroom held

    def _offload(self, hashes: list) -> None:
        """Write-through: hashes whose blocks just became cached go to the host tier."""
        if hashes and self.host is not None:
            self.host.offload(hashes)

    def _evictable(self) -> dict[str, int] | None:
        p = self.prefix
        return None if p is None else {g: p.num_evictable(g) for g in self.group_names}

    def _evict_and_allocate(self, counts: Mapping[str, int], near: Mapping[str, int] | None
                            ) -> dict[str, list[int]] | None:
        """The allocator said "not now": give up cached blocks *before* the next attempt
        (never inside one). First each short group's shortfall by exact LRU (the blocks freed
        are what exact LRU would free: no hit is lost to page-awareness), then, while the
        shared budget still refuses, one slot's worth of every group at a time, page-aware
        within the LRU tail (:meth:`PrefixCache.evict_pages`). Copies that have finished are
        reaped once when nothing is evictable (their pins end). ``None`` when nothing more
        can go."""
        prefix = self.prefix
        if prefix is None:
            return None
        a = self._alloc
        evicted = 0
        for g, n in counts.items():
            short = n - a.num_free_blocks(g)
            if short > 0:
                evicted += len(prefix.evict(g, short, prefer_slot_emptying=False))
        polled = False
        while True:
            if evicted:
                new = a.allocate(counts, near)
                if new is not None:
                    return new
            evicted = 0
            for g in self.group_names:
                evicted += len(prefix.evict_pages(g, a.shape(g).blocks_per_slot))
            if not evicted:
                if polled or self.host is None or not self.host.in_flight:
                    return None
                self.host.poll()  # finished copies unpin their blocks
                polled = True
                evicted = 1  # retry the allocation once

    def drop(self, request_id: str) -> None:
        """Give back a held hit of a request that will not be allocated now (same as
        :meth:`free`: the request is forgotten; a later :meth:`lookup` starts again)."""
        self.free(request_id)

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
        if self.host is not None:
            self.host.step()
            for req in [q for q in self._restoring.values() if q.restore.finished]:  # type: ignore[union-attr]
                self._finish_restore(req, req.restore)  # type: ignore[arg-type]
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

    # -- queries -------------------------------------------------------------------------
    def block_tables(self, request_id: str) -> dict[str, list[int]]:
        """The request's block tables (the manager's lists, updated in place by compaction
        and restores; read them, do not modify them). A sliding-window group's table starts
        with :data:`NULL_BLOCK` entries for the blocks given back (outside the window)."""
        return self._req(request_id)

    def capacity(self) -> KVCapacity:
        """Live capacity (see :class:`KVCapacity`)."""
        cap = self._cache.capacity(self._evictable())
        a = self._alloc
        total, used, cached, avail = {}, {}, {}, {}
        for g, geo in self._cache.geometry.items():
            gc = cap.groups[g]
            total[g] = geo.num_blocks
            used[g] = a.num_live_blocks(g)
            cached[g] = a.num_cached_blocks(g)
            mappable = min(gc.inactive_slots, cap.mappable_bytes // gc.slot_bytes)
            avail[g] = gc.free_blocks + gc.evictable_blocks + mappable * gc.blocks_per_slot
        return KVCapacity(self.block_size, total, used, cached, avail)

    def usage(self) -> float:
        """Fraction 0..1 of the KV capacity in use (``vllm:kv_cache_usage_perc``): referenced
        blocks over referenced + available blocks, the largest over groups (cached blocks
        count as available: they are given up on demand)."""
        c = self.capacity()
        best = 0.0
        for g in self.group_names:
            u = c.used_blocks[g]
            d = u + c.available_blocks[g]
            if d:
                best = max(best, u / d)
        return best

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: ``prefix_*`` (queries, query/hit tokens, hits, evictions,
        cached blocks), ``host_*`` (offloaded / restored blocks and bytes, failures),
        ``mapped_bytes`` (KV pages mapped now), blocks per state, compactions, requests."""
        a = self._alloc
        out: dict[str, Any] = {
            "block_size": self.block_size,
            "requests": len(self._reqs),
            "live_blocks": sum(a.num_live_blocks(g) for g in self.group_names),
            "cached_blocks": sum(a.num_cached_blocks(g) for g in self.group_names),
            "free_blocks": sum(a.num_free_blocks(g) for g in self.group_names),
            "mapped_bytes": self._cache.active_bytes(),
            "packed_floor_bytes": self._cache.packed_floor_bytes(),
            "evictions": self.prefix.stats.evictions if self.prefix is not None else 0,
            "compactions": self.compactions,
            "blocks_compacted": self.blocks_compacted,
            "compaction_released_bytes": self.bytes_compacted_released,
            "usage": self.usage(),
            "asleep": self._asleep,
        }
        p = self.prefix.stats if self.prefix is not None else None
        out.update({
            "prefix_enabled": p is not None,
            "prefix_queries": p.queries if p else 0,
            "prefix_query_tokens": p.query_tokens if p else 0,
            "prefix_hits": p.hits if p else 0,
            "prefix_hit_tokens": p.hit_tokens if p else 0,
            "prefix_evictions": p.evictions if p else 0,
            "prefix_published_blocks": p.published_blocks if p else 0,
            "prefix_cached_bytes": p.cached_bytes if p else 0,
        })
        h = self.host.stats if self.host is not None else None
        out.update({
            "host_enabled": h is not None,
            "host_capacity_blocks": h.host_capacity_blocks if h else 0,
            "host_blocks_used": h.host_blocks_used if h else 0,
            "host_hit_blocks": h.host_hit_blocks if h else 0,
            "host_offloaded_blocks": h.offloaded_blocks if h else 0,
            "host_offload_bytes": h.offloaded_bytes if h else 0,
            "host_restored_blocks": h.restored_blocks if h else 0,
            "host_restore_bytes": h.restored_bytes if h else 0,
            "host_restore_failures": h.restore_failures if h else 0,
            "host_offload_failures": h.offload_failures if h else 0,
        })
        return out

    # -- operator verbs ------------------------------------------------------------------
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
        refs: dict[tuple[str, int], int] = {}
        for req in self._reqs.values():
            for g, t in req.items():
                k = req.trimmed.get(g, 0) if req.trimmed else 0
                assert all(b == NULL_BLOCK for b in t[:k]), \
                    f"request {req.rid!r}: trimmed entries of {g!r} are not null"
                for b in t[k:]:
                    assert b >= 0, f"request {req.rid!r}: a null entry inside {g!r}'s window"
                    refs[(g, b)] = refs.get((g, b), 0) + 1
            for g, t in (req.held or {}).items():
                for b in t:
                    refs[(g, b)] = refs.get((g, b), 0) + 1
        for (g, b), n in refs.items():
            rc = self._alloc.ref_count(g, b)
            assert rc >= n, f"block {b} of group {g!r}: {n} table entries, ref count {rc}"
        for r in self._reqs.values():
            assert r.cap == -1 or r.cap == len(r.first) * self.block_size, \
                f"request {r.rid!r}: cap {r.cap} for {len(r.first)} blocks"
            want = -1 if r.restore is not None else min(r.cap, r.publish_at - 1)
            assert r.upto == want, f"request {r.rid!r}: upto {r.upto}, expected {want}"
        assert set(self._restoring) == {r.rid for r in self._reqs.values() if r.restore}, \
            "requests with a restore in flight and the manager's record of them differ"
        n0 = None
        for req in self._reqs.values():
            lens = {len(t) for t in req.values()}
            assert len(lens) == 1, f"request {req.rid!r}: tables of unequal length {lens}"
            n0 = lens.pop()
            if req.cap >= 0:
                assert req.num_computed <= n0 * self.block_size


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
    (default the pool's). ``tuning``: see ``_TUNING`` (``compact``, ``compact_min_slots``,
    ``compact_max_blocks``, ``ready_slots``, ``host_available_bytes``, ``host_populate``)."""
    unknown = sorted(set(tuning) - set(_TUNING))
    if unknown:
        raise TypeError(f"build_kv_cache_manager: unknown tuning parameter(s) "
                        f"{', '.join(unknown)}; known: {', '.join(sorted(_TUNING))}")
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
    cache = hpool = host = None
    try:
        cache = VirtualKVCache.for_tokens(pool, layout, tokens)
        prefix = None
        if enable_prefix_cache:
            prefix = PrefixCache(cache.allocator,
                                 {n: geo.group.block_bytes for n, geo in cache.geometry.items()},
                                 cache.layout.groups[0].block_size,
                                 hybrid=layout.resident is not None)  # PC-02
        if prefix is not None and host_blocks_factor > 1:  # HK-01 (HK-02/HK-03: no host tier)
            reason = host_tier_unsupported_reason(layout, vision=vision)
            if reason:
                raise HostTierUnsupported(f"{reason}; set host_blocks_factor=0 (or <= 1) to "
                                          "run without the host tier")
            size = plan_host_pool(cache, host_blocks_factor)  # HK-06
            check_host_pool_fits(size, tuning.get("host_available_bytes"))  # HK-07
            hpool = HostPool(size, driver or pool.driver,
                             populate=tuning.get("host_populate", True))
            host = HostTier(prefix, hpool, driver or pool.driver, KvBlockAddresses(cache))
        return KVCacheManager(cache, prefix=prefix, host=host, hash_seed=hash_seed, **kw)
    except BaseException:
        # nothing stays on the caller's pool: the host buffer, the "kv" region (its pages and
        # its arena space); a "kv" tenant that was there before the call is not ours
        if host is not None:
            host.close()
        elif hpool is not None:
            hpool.close()
        if not had_kv and pool.has_tenant("kv"):
            pool.remove_tenant("kv")
        raise
