"""The prefix cache (PC-01, PC-02): the hash index of published blocks and the LRU order of the
unreferenced ones — nothing else. Block state (references, cached / retained flags, transfer
pins) belongs to the :class:`~xllm_vmm.kvcache.allocator.BlockAllocator`; the prefix cache
calls it (never the other way round):

- :meth:`PrefixCache.publish` indexes complete, written blocks and marks them *retained*
  (``allocator.retain``): at ref 0 they become *cached* (still allocated, their slot still
  mapped) instead of free;
- :meth:`PrefixCache.release` drops a request's references (``allocator.free``, tail block
  first) and appends the blocks that became cached to the LRU, in that order;
- :meth:`PrefixCache.acquire` references a hit's blocks (``allocator.touch``); revived blocks
  leave the LRU;
- :meth:`PrefixCache.evict` gives up cached blocks when the caller (the manager, *before* an
  allocation) needs memory: it withdraws their hashes and frees them
  (``allocator.release_cached``).

Invariants (checked by ``tests/prefix`` and the manager's state machine):

- ``lru[g]`` = the cached, unpinned blocks of ``g`` that hold an indexed hash, in release order
  (a pinned block leaves it while a transfer runs and comes back at the most recent end).
- Index: ``hash_to_block[g][h] == b  ⇔  block_hash[g][b] == h``, and every indexed block is
  retained (one block per hash per group: the first block published under a hash wins; a
  duplicate stays unretained and is freed when released).
- A hash is *usable* only if every cache group of the model has a block under it (target and
  draft, MLA latent and index): lookups walk the chain while all groups hit. When one group's
  block is evicted, the hash is withdrawn from every group and the peer blocks are unretained
  (a cached peer is freed at once; a live one when its request releases it).

Eviction order: plain LRU gives up the least recently released block first (ties: release
order). Requests release their blocks tail first, so a request's last blocks go before its
prefix. The manager evicts a block shortfall by exact LRU (``evict(...,
prefer_slot_emptying=False)``: nothing exact LRU keeps is given up, O(1) per block). When it
needs pages rather than block positions (a budget shared by several groups), :meth:`evict_pages`
chooses whole slots inside a bounded window of the LRU tail: walking the
``WINDOW_FACTOR × (n + blocks per slot)`` least recently released blocks oldest first, the
slots whose every used block has been seen go whole, in the order they complete (the first page
exact LRU would empty first), then plain LRU for the rest. ``evict(...,
prefer_slot_emptying=True)`` is the older pages-first choice (whole evictable slots in the
order of their oldest block, whatever the recency of the rest).

Units: blocks (ids are the allocator's per-group block ids), tokens, bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

from xllm_vmm.kvcache import eviction
from xllm_vmm.kvcache.allocator import BlockAllocator
from xllm_vmm.kvcache.hashing import BlockHash
from xllm_vmm.kvcache.stats import PrefixCacheStats


#: the page-aware window of :meth:`PrefixCache.evict_pages`: the
#: ``WINDOW_FACTOR × (n + blocks per slot)`` least recently released blocks (a constant:
#: eviction's cost does not grow with the cache)
WINDOW_FACTOR = 8



_REPUBLISHED = ("publish: request block {} is already published under another hash (a "
                "block's content changed after it was published?)")


class PrefixCacheError(RuntimeError):
    """Misuse of the prefix cache (publishing into an unknown group, a changed block)."""


class PrefixHit(NamedTuple):
    """The result of a lookup: the first ``num_blocks`` blocks of the request are in the device
    cache; ``blocks[g]`` are their ids in group ``g`` (not yet referenced — call
    :meth:`PrefixCache.acquire`); ``checkpoint`` is the linear-state checkpoint stored with the
    last hit block (hybrid models, PC-02), else None."""

    num_blocks: int
    hashes: tuple[BlockHash, ...]
    blocks: Mapping[str, tuple[int, ...]]
    checkpoint: Any = None

    def num_tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size


@dataclass
class _Checkpoint:
    state: Any
    nbytes: int


@dataclass
class _Group:
    name: str
    block_bytes: int
    bps: int
    hash_to_block: dict[BlockHash, int] = field(default_factory=dict)
    block_hash: dict[int, BlockHash] = field(default_factory=dict)
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # evictable, oldest first


class PrefixCache:
    """Hash index + LRU of unreferenced published blocks over ``allocator``.

    ``groups`` maps each cache group name to the bytes of one block in that group (every tensor
    of the group together). ``hybrid=True`` (PC-02) makes a hit usable only up to the last
    matched block that carries a linear-state checkpoint.
    """

    def __init__(self, allocator: BlockAllocator, groups: Mapping[str, int], block_size: int,
                 *, hybrid: bool = False) -> None:
        if not groups:
            raise ValueError("PrefixCache needs at least one cache group")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size}: must be a positive number of tokens")
        self.block_size = block_size
        self.hybrid = hybrid
        self.allocator = allocator
        self._groups: dict[str, _Group] = {
            g: _Group(g, int(nb), allocator.shape(g).blocks_per_slot) for g, nb in groups.items()}
        self._order = tuple(self._groups)
        self._sole = self._groups[self._order[0]] if len(self._order) == 1 else None
        self._checkpoints: dict[BlockHash, _Checkpoint] = {}
        self._stats = PrefixCacheStats()
        # the sole group's allocator state, for acquire_chain's one loop
        self._ag = allocator.state(self._order[0]) if self._sole is not None else None
        for name in self._order:  # the manager's flat commit sets retained flags directly
            allocator.will_retain(name)

    @property
    def group_names(self) -> tuple[str, ...]:
        return self._order

    @property
    def stats(self) -> PrefixCacheStats:
        """The counters, with ``cached_blocks`` / ``cached_bytes`` read from the allocator."""
        s = self._stats
        a = self.allocator
        s.cached_blocks = sum(a.num_cached_blocks(n) for n in self._order)
        s.cached_bytes = sum(a.num_cached_blocks(n) * g.block_bytes
                             for n, g in self._groups.items())
        return s

    def _g(self, group: str) -> _Group:
        try:
            return self._groups[group]
        except KeyError:
            raise PrefixCacheError(
                f"unknown cache group {group!r}; this prefix cache has {list(self._order)}"
            ) from None

    # ------------------------------------------------------------------ requests
    def acquire(self, hit: PrefixHit) -> None:
        """Reference every block of ``hit`` for a request (shared, never copied)."""
        if not hit.num_blocks:
            return
        touch_many = self.allocator.touch_many
        for name in self._order:
            revived = touch_many(name, hit.blocks[name])
            if revived:
                lru = self._groups[name].lru
                for b in revived:
                    lru.pop(b, None)

    def acquire_chain(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """:meth:`lookup` then :meth:`acquire` in one call, for a one-group cache without
        linear-state checkpoints (``hybrid=False``; most models): the blocks of the longest
        indexed prefix of ``hashes`` (at most ``max_blocks``), each referenced once more for
        the caller, as a new list. Same counters and LRU effect as the two calls."""
        g = self._sole
        if g is None or self.hybrid:
            raise PrefixCacheError("acquire_chain is for a one-group cache without "
                                   "checkpoints; use lookup() and acquire()")
        # one loop: the walk and the references (allocator.touch_many's effect, on the
        # allocator's arrays of this group, bound once; an indexed block is live or cached)
        get = g.hash_to_block.get
        ag = self._ag
        ref = ag.ref
        cached = ag.cached
        out: list[int] = []
        revived = 0
        for h in (hashes if max_blocks >= len(hashes) else hashes[:max(0, max_blocks)]):
            b = get(h)
            if b is None:
                break
            r = ref[b]
            if r:
                ref[b] = r + 1
            else:  # cached: revived, out of the LRU
                if not cached[b]:
                    raise PrefixCacheError(f"indexed block {b} of group {g.name!r} is free")
                cached[b] = 0
                ref[b] = 1
                g.lru.pop(b, None)
                revived += 1
            out.append(b)
        if revived:
            ag.n_cached -= revived
        s = self._stats
        s.queries += 1
        bs = self.block_size
        s.query_tokens += len(hashes) * bs
        if out:
            n = len(out)
            s.hits += 1
            s.hit_blocks += n
            s.hit_tokens += n * bs
        return out

    def touch(self, group: str, block: int) -> None:
        """One more reference on ``block`` (a restore joining another one in flight)."""
        if self.allocator.touch(group, block):
            self._g(group).lru.pop(block, None)

    def release(self, blocks: Mapping[str, Sequence[int]]) -> list[BlockHash]:
        """Drop a request's references, tail block first, so that within one release the
        request's last blocks are evicted before its prefix. Returns the hashes whose blocks
        just became cached in every group (write-through candidates for the host tier)."""
        g = self._sole
        a = self.allocator
        if g is not None:  # one group: no dicts on the way
            kept1 = a.free_group(g.name, blocks[g.name][::-1])
            if not kept1:
                return []
            lru = g.lru
            bh = g.block_hash
            pins = a.pinned_blocks(g.name)
            out = []
            for b in kept1:
                h = bh.get(b)
                if h is not None and b not in pins:
                    lru[b] = None
                    out.append(h)
            return out
        kept = a.free({n: ids[::-1] for n, ids in blocks.items()})
        if not kept:
            return []
        cand: dict[BlockHash, None] = {}
        for name, bs in kept.items():
            gg = self._groups[name]
            pins = a.pinned_blocks(name)
            for b in bs:
                h = gg.block_hash.get(b)
                if h is not None and b not in pins:
                    gg.lru[b] = None
                    cand[h] = None
        return [h for h in cand
                if all(a.is_cached(n, gg.hash_to_block[h]) for n, gg in self._groups.items()
                       if h in gg.hash_to_block) and self.contains(h)]

    # ------------------------------------------------------------------ index
    def publish(self, blocks: Mapping[str, Sequence[int]], hashes: Sequence[BlockHash], *,
                first_block: int = 0, checkpoints: Mapping[int, tuple[Any, int]] | None = None
                ) -> int:
        """Make complete, written blocks findable (PC-01).

        ``blocks[g][i]`` is the block of request block ``i`` in group ``g`` (the request's whole
        block table); ``hashes[j]`` is the hash of request block ``first_block + j``. Only call
        this once the KV of those blocks is written (chunked prefill: once a block is complete).
        ``checkpoints`` maps a request block index to ``(state, nbytes)``, the linear-state
        checkpoint at the end of that block (PC-02). Returns how many hashes were newly indexed;
        a hash already indexed under another block keeps that block (the duplicate is freed when
        its request releases it)."""
        order = self._order
        for name in order:
            if name not in blocks:
                raise PrefixCacheError(f"publish needs blocks for every cache group "
                                       f"{list(order)}; missing {name!r}")
        sole = self._sole
        if sole is not None and not checkpoints:  # one group: one tight pass
            ids = blocks[sole.name]
            end = first_block + len(hashes)
            if end > len(ids):
                raise PrefixCacheError(f"publish: request block {max(len(ids), first_block)} "
                                       "has no block id")
            fresh = self.index_run(ids, hashes, first_block, end, first_block)
            if fresh:
                self.allocator.retain(sole.name, fresh)
            return len(fresh)
        return self._publish_each(blocks, hashes, first_block, checkpoints)

    def index_run(self, ids: Sequence[int], hashes: Sequence[BlockHash], first: int, end: int,
                  base: int) -> list[int]:
        """Index request blocks ``[first, end)`` of the one-group cache: block ``i`` is
        ``ids[i]``, its hash ``hashes[i - base]``. Returns the blocks newly indexed; the caller
        retains them (:meth:`publish`; the manager's one-group commit sets their retained
        flags itself). A block already indexed under another hash refuses the run
        (:class:`PrefixCacheError`, nothing changed)."""
        g = self._sole
        h2b = g.hash_to_block  # type: ignore[union-attr]
        b2h = g.block_hash  # type: ignore[union-attr]
        get = h2b.get
        fresh: list[int] = []
        dup = 0
        for i in range(first, end):
            h = hashes[i - base]
            b = ids[i]
            e = get(h)
            if e is None:
                if b in b2h:
                    for fb in fresh:  # a refused publish changes nothing
                        del h2b[b2h.pop(fb)]
                    raise PrefixCacheError(_REPUBLISHED.format(i))
                h2b[h] = b
                b2h[b] = h
                fresh.append(b)
            elif e != b:
                dup += 1
        st = self._stats
        if dup:
            st.duplicate_publishes += dup
        if fresh:
            n = len(fresh)
            st.published_blocks += n
            st.indexed_hashes += n
        return fresh

    def _publish_each(self, blocks: Mapping[str, Sequence[int]], hashes: Sequence[BlockHash],
                      first_block: int, checkpoints: Mapping[int, tuple[Any, int]] | None
                      ) -> int:
        """:meth:`publish` block by block: several groups (a hash indexed in all or none),
        or checkpoints."""
        order = self._order
        a = self.allocator
        sole = self._sole
        new = 0
        retained: list[int] | None = None  # the sole group's newly indexed blocks
        for j, h in enumerate(hashes):
            i = first_block + j
            if sole is not None:
                ids = blocks[sole.name]
                if i >= len(ids):
                    raise PrefixCacheError(f"publish: request block {i} has no block id")
                b = ids[i]
                e = sole.hash_to_block.get(h)
                if e is not None and e != b:
                    self._stats.duplicate_publishes += 1
                    continue
                if e is None:
                    if b in sole.block_hash:
                        raise PrefixCacheError(_REPUBLISHED.format(i))
                    sole.hash_to_block[h] = b
                    sole.block_hash[b] = h
                    if retained is None:
                        retained = [b]
                    else:
                        retained.append(b)
                    new += 1
            else:
                if any(i >= len(blocks[n]) for n in order):
                    raise PrefixCacheError(f"publish: request block {i} has no block id in "
                                           "every group")
                pairs = [(self._groups[n], blocks[n][i]) for n in order]
                existing = [g.hash_to_block.get(h) for g, _ in pairs]
                if not all(e == b for e, (_, b) in zip(existing, pairs)):
                    if any(e is not None for e in existing):
                        self._stats.duplicate_publishes += 1
                        continue
                    if any(b in g.block_hash for g, b in pairs):
                        raise PrefixCacheError(_REPUBLISHED.format(i))
                    for g, b in pairs:
                        g.hash_to_block[h] = b
                        g.block_hash[b] = h
                        a.retain(g.name, (b,))
                    new += 1
            if checkpoints and i in checkpoints and h not in self._checkpoints:
                state, nbytes = checkpoints[i]
                self._checkpoints[h] = _Checkpoint(state, int(nbytes))
                self._stats.checkpoint_bytes += int(nbytes)
        if retained:
            a.retain(sole.name, retained)  # type: ignore[union-attr]
        self._stats.published_blocks += new
        self._stats.indexed_hashes += new
        return new

    def lookup(self, hashes: Sequence[BlockHash], *, max_blocks: int | None = None,
               record: bool = True) -> PrefixHit:
        """Walk the chain: the longest prefix of ``hashes`` whose every block is indexed in every
        group (hybrid: cut back to the last block with a checkpoint). Costs one dict lookup per
        group per block, independent of how many blocks are cached. ``max_blocks`` caps the hit
        (the engine passes ``(prompt_tokens - 1) // block_size`` so one token is computed)."""
        limit = len(hashes) if max_blocks is None else max(0, min(max_blocks, len(hashes)))
        groups = [self._groups[n] for n in self._order]
        n = 0
        if len(groups) == 1:
            index = groups[0].hash_to_block
            for i in range(limit):
                if hashes[i] not in index:
                    break
                n += 1
        else:
            for h in hashes[:limit]:
                if all(h in g.hash_to_block for g in groups):
                    n += 1
                else:
                    break
        if self.hybrid:
            while n > 0 and hashes[n - 1] not in self._checkpoints:
                n -= 1
        hit_hashes = tuple(hashes[:n])
        blocks = {g.name: tuple(map(g.hash_to_block.__getitem__, hit_hashes)) for g in groups}
        ckpt = self._checkpoints[hit_hashes[-1]].state if (n and self.hybrid) else None
        if record:
            s = self._stats
            s.queries += 1
            s.query_tokens += len(hashes) * self.block_size
            if n:
                s.hits += 1
                s.hit_blocks += n
                s.hit_tokens += n * self.block_size
        return PrefixHit(n, hit_hashes, blocks, ckpt)

    def hash_of(self, group: str, block: int) -> BlockHash | None:
        return self._g(group).block_hash.get(block)

    def block_of(self, group: str, h: BlockHash) -> int | None:
        return self._g(group).hash_to_block.get(h)

    def contains(self, h: BlockHash) -> bool:
        """Whether ``h`` is usable (indexed in every group)."""
        return all(h in g.hash_to_block for g in self._groups.values())

    def blocks_of(self, h: BlockHash) -> dict[str, int]:
        return {n: self._groups[n].hash_to_block[h] for n in self._order}

    def checkpoint_of(self, h: BlockHash) -> Any:
        c = self._checkpoints.get(h)
        return None if c is None else c.state

    def is_cached(self, group: str, block: int) -> bool:
        return self.allocator.is_cached(group, block)

    def lru_order(self, group: str) -> list[int]:
        """Evictable blocks of ``group``, next victim of plain LRU first."""
        return list(self._g(group).lru)

    def num_evictable(self, group: str) -> int:
        """Blocks of ``group`` that :meth:`evict` could give up now (cached, unpinned)."""
        return len(self._g(group).lru)

    # ------------------------------------------------------------------ pins (transfers)
    def pin(self, group: str, block: int) -> None:
        """Hold ``block`` for a transfer (``allocator.pin``): it leaves the LRU meanwhile."""
        self.allocator.pin(group, block)
        self._g(group).lru.pop(block, None)

    def unpin(self, group: str, block: int) -> None:
        """End a transfer's hold; a cached, indexed block left unpinned returns to the LRU (most
        recent end), a cached block no hash holds is freed by the allocator."""
        a = self.allocator
        a.unpin(group, block)
        g = self._g(group)
        if a.is_cached(group, block) and not a.pin_count(group, block) and block in g.block_hash:
            g.lru[block] = None

    def pin_count(self, group: str, block: int) -> int:
        return self.allocator.pin_count(group, block)

    # ------------------------------------------------------------------ eviction
    def evict(self, group: str, n_blocks: int, prefer_slot_emptying: bool = True) -> list[int]:
        """Give up at least ``n_blocks`` evictable blocks of ``group`` (fewer if there are not
        that many): their hashes are withdrawn from every group and the blocks freed (their
        peers in other groups too, when cached). Returns the blocks of ``group`` freed, in the
        order chosen. Never gives up a referenced or pinned block (invariant 4).

        ``prefer_slot_emptying=False``: exact LRU, the ``n_blocks`` least recently released
        blocks (O(1) per block: the head of the ordered LRU). The manager evicts a block
        shortfall this way, so nothing exact LRU keeps is given up.

        ``prefer_slot_emptying=True`` (pages first, whatever their recency): whole evictable
        slots come first (the result may exceed ``n_blocks`` by the rest of the last slot), in
        the order of their least recently released block, looking at the
        ``8 × (n_blocks + blocks per slot)`` least recently released blocks only; then plain
        LRU. A slot found this way may hold recently released blocks that exact LRU keeps;
        :meth:`evict_pages` is the page-aware choice that never gives those up."""
        g = self._g(group)
        if n_blocks <= 0 or not g.lru:
            return []
        if prefer_slot_emptying and g.bps > 1:
            a = self.allocator
            chosen = eviction.slots_first(g.lru, lambda s: a.slot_evictable(group, s), g.bps,
                                          n_blocks)
            lru = g.lru
            for b in chosen:
                del lru[b]
        else:
            pop = g.lru.popitem
            chosen = [pop(False)[0] for _ in range(min(n_blocks, len(g.lru)))]
        return self._give_up(group, g, chosen)

    def evict_pages(self, group: str, n_blocks: int) -> list[int]:
        """Give up at least ``n_blocks`` evictable blocks of ``group`` when the caller needs
        pages (a budget shared by several groups): page-aware, but inside a bounded window of
        the LRU tail and never past what exact LRU gives up to free the same pages (see
        :func:`~xllm_vmm.kvcache.eviction.window_victims`). The result may exceed ``n_blocks`` by the rest of the last
        slot. O(``WINDOW_FACTOR × (n_blocks + blocks per slot)``) however large the cache."""
        g = self._g(group)
        if n_blocks <= 0 or not g.lru:
            return []
        if g.bps == 1:
            return self.evict(group, n_blocks, prefer_slot_emptying=False)
        chosen = eviction.window_victims(g.lru, self.allocator.state(group).used, g.bps,
                                         n_blocks, WINDOW_FACTOR)
        lru = g.lru
        for b in chosen:
            del lru[b]
        return self._give_up(group, g, chosen)

    def _give_up(self, group: str, g: _Group, chosen: list[int]) -> list[int]:
        """Withdraw the hashes of ``chosen`` (out of the LRU already) and free the blocks."""
        bh = g.block_hash
        h2b = g.hash_to_block
        if self._sole is not None and not self._checkpoints:  # one group: the index only
            for b in chosen:
                del h2b[bh.pop(b)]
            self._stats.indexed_hashes -= len(chosen)
        else:
            for b in chosen:
                h = bh.pop(b)
                del h2b[h]
                self._withdraw_peers(h, group)
        a = self.allocator
        a.release_cached(group, chosen)
        st = self._stats
        st.evictions += len(chosen)
        stack_len = a.state(group).stack_len
        bps = g.bps
        st.evicted_slots_emptied += sum(1 for s in {b // bps for b in chosen}
                                        if stack_len(s) < 0)
        return chosen

    def _withdraw_peers(self, h: BlockHash, except_group: str | None) -> None:
        """``h`` leaves the index of every group but ``except_group`` (done by the caller):
        peer blocks are unretained (freed now when cached and unpinned)."""
        if self._sole is None:
            a = self.allocator
            for name, g in self._groups.items():
                if name == except_group:
                    continue
                b = g.hash_to_block.pop(h, None)
                if b is None:
                    continue
                del g.block_hash[b]
                g.lru.pop(b, None)
                a.unretain(name, (b,))
        self._stats.indexed_hashes -= 1
        c = self._checkpoints.pop(h, None)
        if c is not None:
            self._stats.checkpoint_bytes -= c.nbytes

    def on_move(self, group: str, moves: Mapping[int, int]) -> None:
        """Compaction moved blocks of ``group`` (old → new; contents copied, the allocator's
        state moved): the index and the LRU (same order) follow. Pinned blocks never move."""
        if not moves:
            return
        g = self._g(group)
        bh = g.block_hash
        hashes = [(new, bh.pop(old)) for old, new in moves.items() if old in bh]
        for new, h in hashes:
            bh[new] = h
            g.hash_to_block[h] = new
        if any(old in g.lru for old in moves):
            g.lru = OrderedDict((moves.get(b, b), None) for b in g.lru)

    # ------------------------------------------------------------------ operator tools
    def reset(self) -> int:
        """Forget every hash (the operator's "reset the prefix cache"): cached, unpinned blocks
        are freed now; blocks requests reference are freed when released; pinned blocks when
        their transfer finishes. Returns the blocks freed now."""
        a = self.allocator
        freed = 0
        for name, g in self._groups.items():
            blocks = list(g.block_hash)
            g.hash_to_block.clear()
            g.block_hash.clear()
            g.lru.clear()
            freed += a.unretain(name, blocks)
        self._checkpoints.clear()
        self._stats.indexed_hashes = 0
        self._stats.checkpoint_bytes = 0
        self._stats.resets += 1
        return freed

    def reset_stats(self) -> None:
        s = self._stats
        self._stats = PrefixCacheStats(indexed_hashes=s.indexed_hashes,
                                       checkpoint_bytes=s.checkpoint_bytes)
