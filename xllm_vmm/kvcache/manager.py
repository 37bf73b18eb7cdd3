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
  keys are listed in :data:`xllm_vmm.kvcache.factory.TUNING`.

Multi-worker (a worker set, ``xllm_vmm.engine.distributed``): slot activation goes through
:attr:`VirtualKVCache` as the allocator's ``SlotBacking`` (``activate(slots)`` /
``deactivate(slots)`` / ``move(moves)``); a fan-out object implementing the same three calls
for several workers replaces it there.

Where it lives: this module holds the manager with its lookup, commit and release verbs;
its allocation verbs are :mod:`xllm_vmm.kvcache.manager_alloc`, its upkeep, queries and
operator verbs :mod:`xllm_vmm.kvcache.manager_upkeep` (both base classes of
:class:`KVCacheManager`); the request records :mod:`xllm_vmm.kvcache.records`, the stats
:mod:`xllm_vmm.kvcache.stats`, the host-tier wiring :mod:`xllm_vmm.kvcache.host_link` and the
factory (:func:`build_kv_cache_manager`) :mod:`xllm_vmm.kvcache.factory`.

Units: tokens (``num_*_tokens``), blocks (ids, counts), bytes (``*_bytes``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from xllm_vmm.kvcache.cache import CacheLayoutError, VirtualKVCache
from xllm_vmm.kvcache.hashing import DEFAULT_SEED, MediaSpan, block_hashes, request_extra_keys
from xllm_vmm.kvcache.host_link import HostLink
from xllm_vmm.kvcache.host_tier import HostTier
from xllm_vmm.kvcache.manager_alloc import AllocationVerbs
from xllm_vmm.kvcache.manager_upkeep import UpkeepVerbs
from xllm_vmm.kvcache.prefix import PrefixCache
from xllm_vmm.kvcache.records import (
    NO_HASHES,
    NULL_BLOCK,
    KVCacheManagerError,
    PrefixMatch,
    RequestRecord,
    new_match,
    set_upto,
)
from xllm_vmm.kvcache.stats import KVCacheStats, KVCapacity

__all__ = [
    "NULL_BLOCK",
    "KVCacheManager",
    "KVCacheManagerError",
    "KVCacheStats",
    "KVCapacity",
    "PrefixMatch",
]


class KVCacheManager(AllocationVerbs, UpkeepVerbs):
    """Request-level KV cache verbs over one worker's :class:`VirtualKVCache` (see the module
    docstring for the lifecycle and invariants). Build it with
    :func:`~xllm_vmm.kvcache.factory.build_kv_cache_manager`. The allocation verbs
    (:meth:`allocate`) and the upkeep, query and operator verbs (:meth:`step`,
    :meth:`compact`, :meth:`capacity`, :meth:`stats`, :meth:`sleep`, :meth:`close`, ...) are
    written in its base classes; every attribute lives in this class's slots.

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
                 "_reqs", "_restoring", "_host", "_asleep", "_closed", "_compact",
                 "_compact_min_slots",
                 "_compact_max_blocks", "_elastic", "_ready_pages", "_ready_fill",
                 "_pool_ready_pages", "compactions", "blocks_compacted",
                 "bytes_compacted_released")

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
        # the one-group hot paths below call the first group's block state directly
        g0 = cache.allocator.state(self._g0)
        self._alloc_group = g0.allocate
        self._free_group_lru = g0.free_lru
        self._acquire_chain = prefix.acquire_chain if self._chain else None  # type: ignore
        self._pg = prefix._groups[self._g0] if self._chain else None  # index + LRU of g0
        self._keep = g0.keep if self._chain else None
        self.hash_seed = hash_seed
        self._plain_seed = hash_seed == DEFAULT_SEED
        self._alloc = cache.allocator
        self._reqs: dict[str, RequestRecord] = {}
        # the host tier's wiring, and the requests with a host restore in flight (its dict)
        self._host = HostLink(host, self.block_size) if host is not None else None
        self._restoring: dict[str, RequestRecord] = (self._host.restoring if self._host
                                                     is not None else {})
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

    def _req(self, request_id: str) -> RequestRecord:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise KVCacheManagerError(f"unknown request {request_id!r}: lookup() or "
                                      "allocate() it first (or it was freed)") from None

    def _new(self, request_id: str) -> RequestRecord:
        return RequestRecord(request_id, self.group_names)

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
            req = self._reqs[request_id] = RequestRecord(request_id, self.group_names)
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
            m = new_match(PrefixMatch, (request_id, n, n, 0, None))
            req.match = m
            return m
        hit = prefix.lookup(hashes, max_blocks=cap)
        prefix.acquire(hit)
        n_dev = hit.num_blocks
        req.held = {g: list(hit.blocks[g]) for g in self.group_names}
        n_host = 0
        if self._host is not None and n_dev < cap:
            n_host = self._host.hold(req, hashes, n_dev, cap)
        m = PrefixMatch(request_id, (n_dev + n_host) * bs, n_dev * bs, n_host * bs,
                        hit.checkpoint)
        req.match = m
        return m

    def _release_hold(self, req: RequestRecord) -> None:
        """Give back a held hit (device references, host pins)."""
        if req.held is not None:
            if self.prefix is not None and any(req.held.values()):
                cached = self.prefix.release(req.held)
                if cached and self._host is not None:  # write-through
                    self._host.offload(cached)
            req.held = None
        if req.held_host:
            self._host.unhold(req)  # type: ignore[union-attr]
        req.match = None

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
        self._host.finish(req, r)  # type: ignore[union-attr]
        return True

    def wait_ready(self, request_id: str) -> bool:
        """Block until :meth:`ready`; ``True`` unless a host restore failed (then the engine
        computes from :meth:`num_computed_tokens`)."""
        req = self._req(request_id)
        r = req.restore
        if r is None:
            return True
        r.wait()
        self._host.finish(req, r)  # type: ignore[union-attr]
        return r.ok

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
            if 0 <= num_computed_tokens <= req.upto:  # completes no block (see RequestHot)
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
            # without checkpoints: its one pass over the index (a conflict raises, nothing
            # changed), then the retained flags set on the allocator's array (the blocks are
            # live, ref >= 1; tests/kvcache/test_hot_paths.py checks it against publish)
            keep = self._keep
            for b in prefix.index_run(req.first, hashes, first, full, base):  # type: ignore
                keep[b] = 1  # type: ignore[index]
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
            req.hashes = hashes[k:] if k < len(hashes) else NO_HASHES
        req.published = full
        pa = req.publish_at = (full + 1) * bs
        cap = req.cap  # set_upto, inline (no restore: refused above)
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
        set_upto(req)
        if self.prefix is not None:
            cached = self.prefix.release(tail)  # unpublished: nothing becomes cached
            if cached and self._host is not None:
                self._host.offload(cached)
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
                self._free_group_lru(first, self._pg.lru)  # type: ignore
            if not self._reqs and self._ready_pages:
                self._cache.pool.drain_ready()  # idle: no growth headroom held
            return
        if req.match is not None or req.held is not None or req.held_host:
            self._release_hold(req)
        if req.restore is not None:
            self._host.cancel(req)  # type: ignore[union-attr]
        if req.cap >= 0:  # admitted
            tables: Mapping[str, list[int]] = req
            if req.trimmed:  # sliding-window groups: their leading null entries hold nothing
                tables = {g: t[req.trimmed.get(g, 0):] for g, t in tables.items()}
            if self.prefix is not None:
                cached = self.prefix.release(tables)
                if cached and self._host is not None:  # write-through
                    self._host.offload(cached)
            elif tables[self.group_names[0]]:
                self._alloc.free(tables)
        if not self._reqs and self._ready_pages:
            self._cache.pool.drain_ready()  # idle: no growth headroom held

    def drop(self, request_id: str) -> None:
        """Give back a held hit of a request that will not be allocated now (same as
        :meth:`free`: the request is forgotten; a later :meth:`lookup` starts again)."""
        self.free(request_id)

    # -- queries -------------------------------------------------------------------------
    def block_tables(self, request_id: str) -> dict[str, list[int]]:
        """The request's block tables (the manager's lists, updated in place by compaction
        and restores; read them, do not modify them). A sliding-window group's table starts
        with :data:`NULL_BLOCK` entries for the blocks given back (outside the window)."""
        return self._req(request_id)
