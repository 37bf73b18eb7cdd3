"""The prefix cache on the virtual KV cache (PC-01, PC-02): hash index, LRU of unreferenced
blocks, page-aware eviction, transfer pins and statistics.

:class:`PrefixCache` is the block allocator's *retention policy*. The allocator reference
counts blocks; when a block's count drops to 0 it asks :meth:`PrefixCache.on_zero_ref`:

- a *published* block (a complete block whose KV is written and whose hash is in the index)
  is kept: it becomes *cached* (ref 0, still allocated, its slot still mapped) and joins the
  LRU of evictable blocks;
- a block pinned by a transfer (host offload or restore) is kept too, but is not evictable
  until the transfer finishes (invariant 4);
- anything else is freed at once.

A hit revives cached blocks through the allocator's ``touch`` (→ :meth:`on_revive`). When an
allocation cannot get memory the allocator calls :meth:`evict` and frees what it returns.

Invariants (checked by ``tests/prefix``):

- ``LRU ⊆ cached``; a block is in the LRU iff it is cached and not pinned.
- A pinned block (``pin_count > 0``) or a block with ref > 0 is never returned by :meth:`evict`.
- Index: ``hash_to_block[g][h] == b  ⇔  block_hash[g][b] == h`` (one block per hash per group:
  the first block published under a hash wins; a duplicate stays unpublished and is freed when
  released).
- A hash is *usable* only if every cache group of the model has a block under it (target and
  draft, MLA latent and index): lookups walk the chain while all groups hit. When one group's
  block is evicted, the hash is withdrawn from every group and the peer blocks become *orphans*
  that are evicted first.

Eviction order: plain LRU evicts the least recently released block first (ties: release order).
Requests release their blocks tail first (:meth:`release` does that), so a request's last blocks
go before its prefix. With ``prefer_slot_emptying=True`` (used when the allocator needs a page,
not a block position) :meth:`evict` first gives up whole slots in which every block is
evictable — so each eviction frees a physical page — taking the slot whose most recently used
block is oldest first, then falls back to plain LRU for the rest.

Units: blocks (ids are the allocator's per-group block ids), tokens, bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from xllm_vmm.kvcache.hashing import BlockHash


class PrefixCacheError(RuntimeError):
    """Misuse of the prefix cache (releasing an unknown pin, publishing into an unknown group)."""


class BlockBackend(Protocol):
    """What the prefix cache needs from the block allocator (the virtual KV cache)."""

    def touch(self, group: str, block: int) -> None:
        """Take one more reference on ``block`` (reviving it if it is cached)."""

    def free(self, group: str, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, in the given order."""

    # optional: ``release_cached(group, blocks)`` frees cached blocks the policy gives up
    # without another ``on_zero_ref`` (used by :meth:`PrefixCache.release_orphans`).

    def slot_of(self, group: str, block: int) -> int:
        """The slot (page offset across every tensor of the group) that holds ``block``."""

    def slot_live(self, group: str, slot: int) -> int:
        """Blocks in ``slot`` with ref > 0."""


@dataclass
class PrefixCacheStats:
    """Counters since start (or the last :meth:`PrefixCache.reset_stats`) and current sizes.

    ``queries``: lookups; ``query_tokens``: tokens those lookups asked about (complete blocks);
    ``hits``: lookups that reused at least one block; ``hit_blocks``/``hit_tokens``: what they
    reused; ``evictions``: blocks given up to the allocator; ``cached_blocks``: blocks with ref 0
    kept now; ``cached_bytes``: their bytes (every tensor of their group); ``indexed_hashes``:
    usable hashes now; ``checkpoint_bytes``: hybrid linear-state checkpoints held (PC-02).
    """

    queries: int = 0
    query_tokens: int = 0
    hits: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    evicted_slots_emptied: int = 0
    published_blocks: int = 0
    duplicate_publishes: int = 0
    cached_blocks: int = 0
    cached_bytes: int = 0
    indexed_hashes: int = 0
    checkpoint_bytes: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


@dataclass(frozen=True)
class PrefixHit:
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
    hash_to_block: dict[BlockHash, int] = field(default_factory=dict)
    block_hash: dict[int, BlockHash] = field(default_factory=dict)
    cached: set[int] = field(default_factory=set)  # ref 0, kept
    lru: OrderedDict[int, int] = field(default_factory=OrderedDict)  # block -> tick; evictable
    pins: dict[int, int] = field(default_factory=dict)  # block -> transfer pin count
    slot_evictable: dict[int, set[int]] = field(default_factory=dict)  # slot -> LRU blocks
    slot_cached: dict[int, int] = field(default_factory=dict)  # slot -> cached blocks
    block_slot: dict[int, int] = field(default_factory=dict)  # cached block -> slot


class PrefixCache:
    """Hash index + LRU of unreferenced blocks + pins, as the allocator's retention policy.

    ``groups`` maps each cache group name to the bytes of one block in that group (every tensor
    of the group together). ``hybrid=True`` (PC-02) makes a hit usable only up to the last
    matched block that carries a linear-state checkpoint.
    """

    ORPHAN_TICK = -1  # orphans sort before every released block

    def __init__(self, groups: Mapping[str, int], block_size: int, *,
                 backend: BlockBackend | None = None, hybrid: bool = False) -> None:
        if not groups:
            raise ValueError("PrefixCache needs at least one cache group")
        if block_size <= 0:
            raise ValueError(f"block_size={block_size}: must be a positive number of tokens")
        self.block_size = block_size
        self.hybrid = hybrid
        self.backend: BlockBackend | None = backend
        self._groups: dict[str, _Group] = {g: _Group(g, int(nb)) for g, nb in groups.items()}
        self._order = tuple(self._groups)
        self._tick = 0
        self._checkpoints: dict[BlockHash, _Checkpoint] = {}
        self._dropping: set[tuple[str, int]] = set()
        self._orphans: set[tuple[str, int]] = set()
        self.stats = PrefixCacheStats()
        self._listeners: list[Any] = []

    # ------------------------------------------------------------------ wiring
    def bind(self, backend: BlockBackend) -> None:
        """Attach the allocator (when it is built after the policy)."""
        self.backend = backend

    def add_listener(self, listener: Any) -> None:
        """``listener.on_cached(hash)`` is called when all groups' blocks of a hash are first
        cached (its request released it); the host tier uses it for write-through.
        ``listener.reap()``, if present, is called from :meth:`evict` when pinned blocks stand
        between it and the blocks asked for: it finishes copies that are done (unpinning their
        blocks) without calling back into the allocator."""
        self._listeners.append(listener)

    @property
    def group_names(self) -> tuple[str, ...]:
        return self._order

    def _g(self, group: str) -> _Group:
        try:
            return self._groups[group]
        except KeyError:
            raise PrefixCacheError(
                f"unknown cache group {group!r}; this prefix cache has {list(self._order)}"
            ) from None

    def _backend(self) -> BlockBackend:
        if self.backend is None:
            raise PrefixCacheError("the prefix cache is not bound to a block allocator")
        return self.backend

    # ------------------------------------------------------------------ retention policy
    def on_zero_ref(self, group: str, block: int) -> bool:
        """The allocator dropped ``block``'s last reference: keep it (True) or free it (False)."""
        g = self._g(group)
        key = (group, block)
        if key in self._dropping:
            self._dropping.discard(key)
            return False
        published = block in g.block_hash
        pinned = g.pins.get(block, 0) > 0
        if not published and not pinned:
            return False
        slot = self._backend().slot_of(group, block)
        g.cached.add(block)
        g.block_slot[block] = slot
        g.slot_cached[slot] = g.slot_cached.get(slot, 0) + 1
        self.stats.cached_blocks += 1
        self.stats.cached_bytes += g.block_bytes
        if not pinned:
            self._to_lru(g, block, orphan=not published)
        if published and self._listeners:
            h = g.block_hash[block]
            if all(self._groups[o].hash_to_block.get(h) in self._groups[o].cached
                   for o in self._order):
                for lst in self._listeners:
                    lst.on_cached(h)
        return True

    def on_revive(self, group: str, block: int) -> None:
        """A cached block got a reference again (a hit, or a drop in progress)."""
        g = self._g(group)
        if block not in g.cached:
            return
        self._uncache(g, block)

    def can_move(self, group: str, block: int) -> bool:
        """Compaction may move ``block`` unless a transfer has it pinned (invariant 4: a copy
        in flight reads or writes it)."""
        return self._g(group).pins.get(block, 0) == 0

    def on_move(self, group: str, moves: Mapping[int, int]) -> None:
        """The allocator's compaction moved blocks of ``group`` (``moves``: old → new, contents
        copied, ref counts and cached flags moved): the index, the LRU (same order and ticks),
        the per-slot counts and the orphan set follow. Pinned blocks are never moved."""
        g = self._g(group)
        if not moves:
            return
        backend = self._backend()
        for old, new in moves.items():
            if g.pins.get(old, 0):
                raise PrefixCacheError(f"on_move: block {old} of group {group!r} is pinned by "
                                       "a transfer and must not move")
        hashes = [(new, g.block_hash.pop(old)) for old, new in moves.items()
                  if old in g.block_hash]
        for new, h in hashes:
            g.block_hash[new] = h
            g.hash_to_block[h] = new
        moved_cached = [(old, new) for old, new in moves.items() if old in g.cached]
        for old, new in moved_cached:
            g.cached.discard(old)
            slot = g.block_slot.pop(old)
            c = g.slot_cached[slot] - 1
            if c:
                g.slot_cached[slot] = c
            else:
                del g.slot_cached[slot]
            if old in g.lru:
                ev = g.slot_evictable[slot]
                ev.discard(old)
                if not ev:
                    del g.slot_evictable[slot]
        for old, new in moved_cached:
            g.cached.add(new)
            slot = backend.slot_of(group, new)
            g.block_slot[new] = slot
            g.slot_cached[slot] = g.slot_cached.get(slot, 0) + 1
            if old in g.lru:
                g.slot_evictable.setdefault(slot, set()).add(new)
        if any(old in g.lru for old in moves):
            g.lru = OrderedDict((moves.get(b, b), t) for b, t in g.lru.items())
        for old, new in moves.items():
            if (group, old) in self._orphans:
                self._orphans.discard((group, old))
                self._orphans.add((group, new))

    def num_evictable(self, group: str) -> int:
        """Blocks of ``group`` that :meth:`evict` could give up now (cached and not pinned)."""
        return len(self._g(group).lru)

    def evict(self, group: str, n_blocks: int, prefer_slot_emptying: bool = True) -> list[int]:
        """Give up at least ``n_blocks`` evictable blocks of ``group`` (fewer if there are not
        that many), removing them from the cache; the allocator frees them. With
        ``prefer_slot_emptying`` whole evictable slots come first (so the result may exceed
        ``n_blocks`` by the rest of the last slot), oldest slot first; then plain LRU."""
        g = self._g(group)
        if n_blocks <= 0:
            return []
        if len(g.lru) < n_blocks and g.pins:
            for lst in self._listeners:  # copies that finished unpin their blocks now
                reap = getattr(lst, "reap", None)
                if reap is not None:
                    reap()
        if not g.lru:
            return []
        chosen: list[int] = []
        taken: set[int] = set()
        if prefer_slot_emptying:
            backend = self._backend()
            cands: list[tuple[int, int]] = []
            for slot, blocks in g.slot_evictable.items():
                if (blocks and len(blocks) == g.slot_cached.get(slot, 0)
                        and backend.slot_live(group, slot) == 0):
                    cands.append((max(g.lru[b] for b in blocks), slot))
            cands.sort()
            for _, slot in cands:
                if len(chosen) >= n_blocks:
                    break
                blocks = sorted(g.slot_evictable[slot], key=lambda b: (g.lru[b], b))
                chosen.extend(blocks)
                taken.update(blocks)
                self.stats.evicted_slots_emptied += 1
        if len(chosen) < n_blocks:
            for b in g.lru:
                if b in taken:
                    continue
                chosen.append(b)
                if len(chosen) >= n_blocks:
                    break
        for b in chosen:
            self._evict_one(g, b)
        self.stats.evictions += len(chosen)
        return chosen

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
        its request releases it).
        """
        for name in self._order:
            if name not in blocks:
                raise PrefixCacheError(f"publish needs blocks for every cache group "
                                       f"{list(self._order)}; missing {name!r}")
        new = 0
        for j, h in enumerate(hashes):
            i = first_block + j
            if any(i >= len(blocks[n]) for n in self._order):
                raise PrefixCacheError(f"publish: request block {i} has no block id in every "
                                       "group")
            ids = [blocks[n][i] for n in self._order]
            existing = [self._groups[n].hash_to_block.get(h) for n in self._order]
            if all(e == b for e, b in zip(existing, ids)):
                pass  # already published (re-publish is a no-op)
            elif any(e is not None for e in existing):
                self.stats.duplicate_publishes += 1
                continue
            else:
                if any(b in self._groups[n].block_hash for n, b in zip(self._order, ids)):
                    raise PrefixCacheError(
                        f"publish: request block {i} is already published under another hash "
                        "(a block's content changed after it was published?)")
                for n, b in zip(self._order, ids):
                    g = self._groups[n]
                    g.hash_to_block[h] = b
                    g.block_hash[b] = h
                    if (n, b) in self._orphans and b in g.lru:
                        self._orphans.discard((n, b))
                new += 1
                self.stats.published_blocks += 1
                self.stats.indexed_hashes += 1
            if checkpoints and i in checkpoints and h not in self._checkpoints:
                state, nbytes = checkpoints[i]
                self._checkpoints[h] = _Checkpoint(state, int(nbytes))
                self.stats.checkpoint_bytes += int(nbytes)
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
        for h in hashes[:limit]:
            if all(h in g.hash_to_block for g in groups):
                n += 1
            else:
                break
        if self.hybrid:
            while n > 0 and hashes[n - 1] not in self._checkpoints:
                n -= 1
        hit_hashes = tuple(hashes[:n])
        blocks = {g.name: tuple(g.hash_to_block[h] for h in hit_hashes) for g in groups}
        ckpt = self._checkpoints[hit_hashes[-1]].state if (n and self.hybrid) else None
        if record:
            self.stats.queries += 1
            self.stats.query_tokens += len(hashes) * self.block_size
            if n:
                self.stats.hits += 1
                self.stats.hit_blocks += n
                self.stats.hit_tokens += n * self.block_size
        return PrefixHit(n, hit_hashes, blocks, ckpt)

    def acquire(self, hit: PrefixHit) -> None:
        """Reference every block of ``hit`` for a request (shared, never copied)."""
        backend = self._backend()
        for name in self._order:
            for b in hit.blocks[name]:
                backend.touch(name, b)

    def release(self, blocks: Mapping[str, Sequence[int]]) -> None:
        """Drop a request's references, tail block first, so that within one release the
        request's last blocks are evicted before its prefix."""
        backend = self._backend()
        for name, ids in blocks.items():
            backend.free(name, list(reversed(ids)))

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
        return block in self._g(group).cached

    def lru_order(self, group: str) -> list[int]:
        """Evictable blocks of ``group``, next victim of plain LRU first (orphans, then the
        least recently released)."""
        return list(self._g(group).lru)

    # ------------------------------------------------------------------ pins
    def pin(self, group: str, block: int) -> None:
        """Hold ``block`` for a transfer: never evicted, never freed, until :meth:`unpin`."""
        g = self._g(group)
        g.pins[block] = g.pins.get(block, 0) + 1
        if block in g.lru:
            self._from_lru(g, block)

    def unpin(self, group: str, block: int) -> None:
        g = self._g(group)
        c = g.pins.get(block, 0)
        if c <= 0:
            raise PrefixCacheError(f"unpin of block {block} in group {group!r}, which is not "
                                   "pinned")
        if c == 1:
            del g.pins[block]
            if block in g.cached:
                self._to_lru(g, block, orphan=block not in g.block_hash)
        else:
            g.pins[block] = c - 1

    def pin_count(self, group: str, block: int) -> int:
        return self._g(group).pins.get(block, 0)

    # ------------------------------------------------------------------ operator tools
    def reset(self) -> int:
        """Forget every hash and free every cached, unpinned block (the operator's "reset the
        prefix cache"). Blocks that requests still reference stay with them and are freed when
        released; pinned blocks are freed when their transfer finishes. Returns the blocks
        freed now."""
        for g in self._groups.values():
            g.hash_to_block.clear()
            g.block_hash.clear()
        self._checkpoints.clear()
        self.stats.indexed_hashes = 0
        self.stats.checkpoint_bytes = 0
        self.stats.resets += 1
        freed = 0
        for g in self._groups.values():
            for b in list(g.lru):
                self._orphans.add((g.name, b))
        freed = self.release_orphans()
        return freed

    def release_orphans(self) -> int:
        """Free cached blocks that no longer back a usable hash (their peer in another group was
        evicted, the cache was reset, a restore copy failed), so their pages are released now
        rather than at the next eviction. Returns the blocks freed. Must not be called from
        inside an allocator callback."""
        if not self._orphans:
            return 0
        backend = self._backend()
        release_cached = getattr(backend, "release_cached", None)
        per_group: dict[str, list[int]] = {}
        for name, b in sorted(self._orphans):
            if b in self._groups[name].lru:  # pinned orphans wait: unpin puts them back
                per_group.setdefault(name, []).append(b)
        n = 0
        for name, blocks in per_group.items():
            g = self._groups[name]
            for b in blocks:
                self._uncache(g, b)
            if release_cached is not None:
                release_cached(name, blocks)
            else:  # a backend without release_cached: revive, then drop the last reference
                for b in blocks:
                    self._dropping.add((name, b))
                    backend.touch(name, b)
                    backend.free(name, [b])
                    self._dropping.discard((name, b))
            n += len(blocks)
        return n

    def reset_stats(self) -> None:
        s = self.stats
        self.stats = PrefixCacheStats(cached_blocks=s.cached_blocks, cached_bytes=s.cached_bytes,
                                      indexed_hashes=s.indexed_hashes,
                                      checkpoint_bytes=s.checkpoint_bytes)

    # ------------------------------------------------------------------ internals
    def _to_lru(self, g: _Group, block: int, orphan: bool) -> None:
        if orphan:
            tick = self.ORPHAN_TICK
            g.lru[block] = tick
            g.lru.move_to_end(block, last=False)
            self._orphans.add((g.name, block))
        else:
            self._tick += 1
            g.lru[block] = self._tick
        g.slot_evictable.setdefault(g.block_slot[block], set()).add(block)

    def _from_lru(self, g: _Group, block: int) -> None:
        del g.lru[block]
        slot = g.block_slot[block]
        s = g.slot_evictable[slot]
        s.discard(block)
        if not s:
            del g.slot_evictable[slot]

    def _uncache(self, g: _Group, block: int) -> None:
        if block in g.lru:
            self._from_lru(g, block)
        g.cached.discard(block)
        slot = g.block_slot.pop(block)
        c = g.slot_cached[slot] - 1
        if c:
            g.slot_cached[slot] = c
        else:
            del g.slot_cached[slot]
        self._orphans.discard((g.name, block))
        self.stats.cached_blocks -= 1
        self.stats.cached_bytes -= g.block_bytes

    def _evict_one(self, g: _Group, block: int) -> None:
        h = g.block_hash.get(block)
        if h is not None:
            self._withdraw(h)
        self._uncache(g, block)

    def _withdraw(self, h: BlockHash) -> None:
        """Remove ``h`` from every group's index; peer blocks left cached become orphans."""
        present = False
        for g in self._groups.values():
            b = g.hash_to_block.pop(h, None)
            if b is None:
                continue
            present = True
            del g.block_hash[b]
            if b in g.lru:
                self._from_lru(g, b)
                self._to_lru(g, b, orphan=True)
        if present:
            self.stats.indexed_hashes -= 1
        c = self._checkpoints.pop(h, None)
        if c is not None:
            self.stats.checkpoint_bytes -= c.nbytes

