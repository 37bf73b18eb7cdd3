"""The KV cache manager's allocation verbs: :meth:`~AllocationVerbs.allocate` (decode growth
next to a request's last block, a fresh request admitted on its whole prompt — AD-04 — from
its held hit), the sliding-window trim that gives back blocks outside the window, and eviction
*before* an allocation is retried (never inside one). A base class of
:class:`~xllm_vmm.kvcache.manager.KVCacheManager`, which holds every attribute these methods
read (see its ``__init__``); the manager's module docstring states the invariants they keep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from xllm_vmm.kvcache.records import (
    NULL_BLOCK,
    KVCacheManagerError,
    PrefixMatch,
    RequestRecord,
    set_upto,
)

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.kvcache.cache import VirtualKVCache
    from xllm_vmm.kvcache.host_link import HostLink
    from xllm_vmm.kvcache.prefix import PrefixCache

__all__ = ["AllocationVerbs"]


class AllocationVerbs:
    """:class:`~xllm_vmm.kvcache.manager.KVCacheManager`'s allocation verbs (slotless: the
    manager's slots hold the state)."""

    __slots__ = ()

    # the manager's state these verbs use (KVCacheManager.__init__ sets it)
    _cache: VirtualKVCache
    _alloc: Any
    _alloc_group: Any
    _reqs: dict[str, RequestRecord]
    _host: HostLink | None
    prefix: PrefixCache | None
    block_size: int
    _bs_1: int
    group_names: tuple[str, ...]
    _g0: str
    _sole: bool
    _chain: bool
    _windows: tuple[tuple[str, int], ...]
    _asleep: bool

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
                    new1 = self._alloc_group(need, first[-1] if first else -1)
                    if new1 is not None:
                        first += new1
                        cap = req.cap = len(first) * self.block_size
                        if req.restore is None:  # set_upto, inline
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
                new0 = self._alloc_group(need)
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
            req.upto = cap if cap < pa else pa - 1  # set_upto (no restore: no host tier)
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

    def _grow(self, req: RequestRecord, first: list[int], need: int) -> dict[str, list[int]] | None:
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
            set_upto(req)
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
        set_upto(req)
        return req

    def _admit(self, request_id: str, req: RequestRecord | None, num_new_tokens: int,
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
            self._host.start_restore(req, n_dev, n_host, new)  # type: ignore[union-attr]
        set_upto(req)
        if req.held_host:  # the restore pinned what it reads; the lookup's hold ends
            self._host.unhold(req)  # type: ignore[union-attr]
        if self._windows:
            self._trim(req)  # a long hit's blocks outside the window go back at once
        return req

    # -- sliding windows -------------------------------------------------------------
    def _trim(self, req: RequestRecord) -> int:
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

    # -- eviction before a retry ---------------------------------------------------------
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
                # finished host copies unpin their blocks, once
                if polled or self._host is None or not self._host.reap():
                    return None
                polled = True
                evicted = 1  # retry the allocation once
