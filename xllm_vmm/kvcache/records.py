"""What the KV cache manager keeps and hands out per request: the match a lookup holds
(:class:`PrefixMatch`), the request's record, which *is* its block tables
(:class:`RequestRecord`), and the check of the records against the allocator
(:func:`check_records`). :class:`~xllm_vmm.kvcache.manager.KVCacheManager` is their only
writer. Units: tokens, blocks.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from xllm_vmm.kvcache.hashing import BlockHash, MediaSpan
from xllm_vmm.kvcache.host_tier import Restore

__all__ = ["NULL_BLOCK", "NO_HASHES", "NO_HOST", "KVCacheManagerError", "PrefixMatch",
           "RequestHot", "RequestRecord", "check_records", "new_match", "set_upto"]


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


class RequestHot(dict):
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
    (:func:`set_upto`; ``check_invariants`` checks it).

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


class RequestRecord(RequestHot):
    """The manager's state of one request and its block tables (its ``dict`` items: group →
    list of block ids; see a :class:`RequestHot`). A plain slotted class: one is made per
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
        self.upto = -1  # see RequestHot
        # the hashes of the complete blocks hashed so far: all of them from block 0 while
        # parent is None; once a one-group commit dropped the published ones (see commit),
        # those from block `published` on, and parent is the hash of block published - 1
        self.hashes: list[BlockHash] = NO_HASHES
        self.parent: BlockHash | None = None
        self.media: tuple[MediaSpan, ...] = ()
        self.extra: tuple[str, ...] = ()  # extra hash keys of block 0 (adapter, cache salt)
        self.published = 0  # request blocks [0, published) are in the index (or hit)
        # the held hit (lookup → allocate): device blocks referenced, host blocks pinned
        self.match: PrefixMatch | None = None
        self.held: dict[str, list[int]] | None = None
        self.held_host: list[int] = NO_HOST  # replaced (never appended to) when it holds some
        # a restore in flight (allocate → ready)
        self.restore: Restore | None = None  # its first_block: the device hit's blocks
        self.first: list[int] = NO_HOST  # self[first group] (the same list) once admitted
        # tokens its blocks cover (len(first) × block_size); -1 until admitted (allocate()
        # succeeded once): ``cap >= 0`` is "admitted"
        self.cap = -1
        self.publish_at = 1 << 62  # committing this many tokens completes the next block
        # sliding-window groups: leading table entries given back (NULL_BLOCK), per group
        self.trimmed: dict[str, int] | None = None


def set_upto(req: RequestHot) -> None:
    """Recompute ``req.upto`` after ``cap``, ``publish_at`` or ``restore`` changed (see
    a :class:`RequestHot`)."""
    if req.restore is not None:  # type: ignore[attr-defined]
        req.upto = -1
    else:
        cap, pa = req.cap, req.publish_at  # type: ignore[attr-defined]
        req.upto = cap if cap < pa else pa - 1


NO_HOST: list[int] = []  # shared empty default (never mutated)
NO_HASHES: list[BlockHash] = []  # shared empty default (never mutated: commit replaces it)
new_match = tuple.__new__  # PrefixMatch without its Python-level __new__ (hot path)


def check_records(reqs: Mapping[str, RequestRecord], restoring: Mapping[str, RequestRecord],
                  alloc: Any, block_size: int) -> None:
    """Every block in a request's tables or held hit is referenced at least as often as they
    name it; tables have equal length, trimmed entries are null, ``cap`` and ``upto`` agree
    with the blocks (``AssertionError`` otherwise; the manager's ``check_invariants``)."""
    refs: dict[tuple[str, int], int] = {}
    for req in reqs.values():
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
        rc = alloc.ref_count(g, b)
        assert rc >= n, f"block {b} of group {g!r}: {n} table entries, ref count {rc}"
    for r in reqs.values():
        assert r.cap == -1 or r.cap == len(r.first) * block_size, \
            f"request {r.rid!r}: cap {r.cap} for {len(r.first)} blocks"
        want = -1 if r.restore is not None else min(r.cap, r.publish_at - 1)
        assert r.upto == want, f"request {r.rid!r}: upto {r.upto}, expected {want}"
        lens = {len(t) for t in r.values()}
        assert len(lens) == 1, f"request {r.rid!r}: tables of unequal length {lens}"
        if r.cap >= 0:
            assert r.num_computed <= lens.pop() * block_size
    assert set(restoring) == {r.rid for r in reqs.values() if r.restore}, \
        "requests with a restore in flight and the manager's record of them differ"
