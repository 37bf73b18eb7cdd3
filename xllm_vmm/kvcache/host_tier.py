"""The host KV tier (HK-01): completed prefix blocks copied to a preallocated host pool, and
restored from it into newly mapped VMM blocks when their device copy was evicted.

Policy: **write-through on completion.** When a request releases its blocks and a published
hash becomes cached on the device (:meth:`PrefixCache.release` returns it; the manager hands it
to :meth:`HostTier.offload`), the tier queues a device→host copy of it; :meth:`HostTier.step`
submits the queue as one batched asynchronous copy. Why not offload on eviction: eviction runs
just before an allocation that is short of memory and must hand blocks back at once, whereas an
offload copy takes time; waiting for it would stall the allocating request, and pinning the
victims until the copy ends would free nothing now. Copying at completion keeps eviction
instant and the copy off the critical path; its cost is copying blocks that may never be
evicted (bounded by one copy per hash: a hash already on the host is not copied again). Only
blocks of requests that finished are copied; a running request's blocks never are (HK-01:
"active requests are not swapped out").

Restore: after a device lookup hits ``k`` blocks, :meth:`match` counts the next blocks found on
the host; the engine allocates device blocks for the rest of the prompt as usual and
:meth:`restore` copies the host blocks into the first of them (one batched host→device copy).
When it finishes the restored blocks are published in the device index and the request
proceeds as a device hit; if the copy fails the request simply computes those blocks.

Restores are de-duplicated: a hash that another request is restoring right now is not copied
again. The second request *joins* the copy in flight: it takes a reference on the device blocks
the first restore writes (and drops its own freshly allocated block for that position, which is
freed at once), and its :class:`Restore` finishes when that copy does, with the same outcome.
:attr:`Restore.blocks` are the device blocks that hold the restored hashes; the caller writes
them into the request's block table (:meth:`Restore.update`). If a shared copy fails, every
request that joined it sees the failure and computes those blocks into the shared blocks (the
KV of a block is a function of its token prefix, so they write the same bytes; the first
publish indexes the block, the others are no-ops).

Pins (invariant 4): every device block and host block a copy reads or writes is pinned from
submission until the copy has finished — successfully or not — and only then released. A
request cancelled mid-copy releases its references as usual; the pins keep its blocks (and the
host blocks) alive until the copy ends, after which nothing is left behind: restored blocks
whose copy succeeded stay as ordinary cached blocks, the others are freed. A joiner holds
references, not pins: the first restore's pins keep the shared blocks until the copy ends
whoever cancels, and each request's references keep them while that request runs.

Layout of a host block: for each cache group (in the prefix cache's order), for each tensor of
the group, that tensor's bytes of the block. Units: bytes, blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from xllm_vmm.kvcache.hashing import BlockHash
from xllm_vmm.kvcache.host_pool import HostPool
from xllm_vmm.kvcache.prefix import PrefixCache
from xllm_vmm.vmm.driver import CopyKind


class BlockAddresses(Protocol):
    """Where a block's bytes live on the device."""

    def block_segments(self, group: str, block: int) -> Sequence[tuple[int, int]]:
        """``(device address, nbytes)`` of ``block`` in every tensor of ``group``, in tensor
        order. The block's pages are mapped while it is allocated (invariant 1)."""


@dataclass
class HostTierStats:
    """Host tier counters (blocks are prefix hashes; bytes cover every group and tensor)."""

    offload_queued: int = 0
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    offload_failures: int = 0
    offload_skipped: int = 0  # host pool full of pinned/filling blocks, or hash evicted first
    host_lookups: int = 0
    host_hit_blocks: int = 0
    restored_blocks: int = 0
    restored_bytes: int = 0
    restore_failures: int = 0
    restores_cancelled: int = 0
    restore_joined_blocks: int = 0  # blocks a restore took from another restore in flight
    host_evictions: int = 0
    host_blocks_used: int = 0
    host_blocks_indexed: int = 0
    host_capacity_blocks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Restore:
    """A restore in flight for one request: ``num_blocks`` blocks from request block
    ``first_block``, held in the device blocks :attr:`blocks` (``blocks[g][j]`` for request
    block ``first_block + j``; the passed blocks, except where this restore joined another
    one in flight). Poll :meth:`done`; afterwards :attr:`ok` says whether they are valid (a
    failed restore leaves the blocks allocated to the request, to be computed)."""

    def __init__(self, tier: "HostTier", first_block: int, num_blocks: int,
                 blocks: Mapping[str, list[int]] | None = None) -> None:
        self._tier = tier
        self.first_block = first_block
        self.num_blocks = num_blocks
        self.blocks: dict[str, list[int]] = dict(blocks or {})
        self.joined = 0  # blocks taken by reference from another restore in flight
        self.finished = num_blocks == 0
        self.ok = num_blocks == 0
        self.cancelled = False
        self.error: BaseException | None = None
        self._waiting = 0  # copies (own and joined) not finished yet

    def update(self, table: Mapping[str, list[int]]) -> None:
        """Write :attr:`blocks` into a request's block table (``table[g][i]`` is the block of
        request block ``i``): required after a join, harmless otherwise."""
        for g, ids in self.blocks.items():
            table[g][self.first_block:self.first_block + len(ids)] = ids

    def _copy_finished(self, error: BaseException | None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self._waiting -= 1
        if self._waiting == 0:
            self.finished = True
            self.ok = self.error is None

    def done(self) -> bool:
        if not self.finished:
            self._tier.poll()
        return self.finished

    def wait(self) -> bool:
        while not self.finished:
            self._tier.wait_all()
        return self.ok

    def cancel(self) -> None:
        """The request is gone. Its blocks stay pinned until the copy finishes; the request may
        release its references right away (a request that joined another restore only drops
        its references; the copy and the other requests carry on)."""
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._tier.stats.restores_cancelled += 1


@dataclass
class _InFlight:
    kind: CopyKind
    transfer: Any
    hashes: list[BlockHash]
    device: dict[str, list[int]]  # group -> blocks, aligned with hashes
    host: list[int]  # host blocks, aligned with hashes
    restores: list[Restore] = field(default_factory=list)  # the first, then joiners
    error: BaseException | None = None
    nbytes: int = 0
    finished: bool = field(default=False)
    pending: tuple[list[int], list[int], list[int]] | None = None  # a restore not submitted yet


class HostTier:
    """Write-through host tier over a :class:`PrefixCache`, a :class:`HostPool` and a driver.

    The engine calls :meth:`step` once per scheduler iteration (and may call :meth:`poll` at any
    time); :meth:`close` waits for every copy and releases every pin."""

    def __init__(self, prefix: PrefixCache, pool: HostPool, driver: Any,
                 addresses: BlockAddresses) -> None:
        self.prefix = prefix
        self.pool = pool
        self.driver = driver
        self.addresses = addresses
        self._pending: OrderedDict[BlockHash, None] = OrderedDict()
        self._offloading: set[BlockHash] = set()
        self._inflight: list[_InFlight] = []
        # hash -> (its restore copy in flight, the device block it is copied into, per group)
        self._restoring: dict[BlockHash, tuple[_InFlight, dict[str, int]]] = {}
        self.stats = HostTierStats(host_capacity_blocks=pool.capacity)

    # ------------------------------------------------------------------ write-through
    def offload(self, hashes: Sequence[BlockHash]) -> None:
        """These hashes' blocks were released by their last request: queue their copies to the
        host (submitted by the next :meth:`step`; a hash already there or on its way is not
        copied again)."""
        if self.pool.capacity == 0:
            return
        pool, off, pending = self.pool, self._offloading, self._pending
        for h in hashes:
            if h in pool or h in off or h in pending:
                continue
            pending[h] = None
            self.stats.offload_queued += 1

    def _segments(self, blocks: Mapping[str, int]) -> list[tuple[int, int]]:
        segs: list[tuple[int, int]] = []
        for name in self.prefix.group_names:
            segs.extend(self.addresses.block_segments(name, blocks[name]))
        return segs

    def _add_copies(self, dsts: list[int], srcs: list[int], sizes: list[int],
                    blocks: Mapping[str, int], hb: int, *, to_host: bool) -> None:
        """Append the copies of one block between its device segments (every group, every
        tensor) and host block ``hb``, laid out back to back there."""
        off = self.pool.address(hb)
        for addr, nb in self._segments(blocks):
            dsts.append(off if to_host else addr)
            srcs.append(addr if to_host else off)
            sizes.append(nb)
            off += nb

    def step(self) -> None:
        """Submit queued offloads as one batched device→host copy, then reap finished copies."""
        self.poll()
        if not self._pending:
            return
        hashes: list[BlockHash] = []
        host: list[int] = []
        device: dict[str, list[int]] = {n: [] for n in self.prefix.group_names}
        dsts: list[int] = []
        srcs: list[int] = []
        sizes: list[int] = []
        pending, self._pending = self._pending, OrderedDict()
        for h in pending:
            if h in self.pool or not self.prefix.contains(h):
                self.stats.offload_skipped += 1
                continue
            hb = self.pool.reserve()
            if hb is None:
                self.stats.offload_skipped += 1
                continue
            blocks = self.prefix.blocks_of(h)
            for n, b in blocks.items():
                self.prefix.pin(n, b)
                device[n].append(b)
            self._add_copies(dsts, srcs, sizes, blocks, hb, to_host=True)
            hashes.append(h)
            host.append(hb)
            self._offloading.add(h)
        if not hashes:
            return
        self._submit(_InFlight(CopyKind.D2H, None, hashes, device, host, nbytes=sum(sizes)),
                     dsts, srcs, sizes)

    def _submit(self, t: _InFlight, dsts: list[int], srcs: list[int], sizes: list[int], *,
                defer: bool = False) -> None:
        """Start ``t``'s batched copy on the driver's copy stream; ``defer`` (restores) keeps
        it until the next :meth:`poll` submits it, or a waiter runs it on its own thread (a
        restore waited for at once costs no thread hand-off)."""
        if defer:
            t.pending = (dsts, srcs, sizes)
            self._inflight.append(t)
            return
        try:
            t.transfer = self.driver.copy_batch_async(dsts, srcs, sizes, t.kind)
        except Exception as e:  # the copy never started: finish it as failed right away
            t.error = e
            self._finish(t)
            return
        self._inflight.append(t)

    # ------------------------------------------------------------------ restore
    def match(self, hashes: Sequence[BlockHash], start: int, max_blocks: int | None = None
              ) -> int:
        """How many of ``hashes[start:]`` are on the host, consecutively from ``start``."""
        end = len(hashes) if max_blocks is None else min(len(hashes), max_blocks)
        n = 0
        for h in hashes[start:end]:
            if h in self.pool:
                n += 1
            else:
                break
        self.stats.host_lookups += 1
        self.stats.host_hit_blocks += n
        return n

    def restore(self, hashes: Sequence[BlockHash], first_block: int,
                blocks: Mapping[str, Sequence[int]]) -> Restore:
        """Copy the host blocks of ``hashes`` (request blocks ``first_block``…) into the device
        blocks ``blocks[g][j]`` (freshly allocated to the request, one per hash per group).
        Hashes no longer on the host end the restore early (see :attr:`Restore.num_blocks`).

        A hash that another restore is copying right now is joined instead of copied: this
        request gets a reference on that restore's device block and its own ``blocks[g][j]``
        is released (freed). Use :attr:`Restore.blocks` (or :meth:`Restore.update`) as the
        request's blocks for the restored positions."""
        groups = self.prefix.group_names
        hs: list[BlockHash] = []
        for h in hashes:
            if h not in self._restoring and h not in self.pool:
                break
            hs.append(h)
        n = len(hs)
        own = {g: list(blocks[g][:n]) for g in groups}
        r = Restore(self, first_block, n, own)
        if not n:
            return r
        result = {g: list(own[g]) for g in groups}
        dropped: dict[str, list[int]] = {g: [] for g in groups}
        joined: dict[int, _InFlight] = {}
        copy_at: list[int] = []
        for j, h in enumerate(hs):
            lead = self._restoring.get(h)
            if lead is None:
                copy_at.append(j)
                continue
            t, ids = lead
            for g in groups:
                self.prefix.touch(g, ids[g])  # this request's reference on the shared block
                result[g][j] = ids[g]
                dropped[g].append(own[g][j])
            joined[id(t)] = t
        r.blocks = result
        r.joined = n - len(copy_at)
        self.stats.restore_joined_blocks += r.joined
        if r.joined:
            self.prefix.release(dropped)  # unpublished, unpinned: freed now
        r._waiting = len(joined) + (1 if copy_at else 0)
        for t in joined.values():
            t.restores.append(r)
        if not copy_at:
            return r
        chs = [hs[j] for j in copy_at]
        device = {g: [own[g][j] for j in copy_at] for g in groups}
        host: list[int] = []
        dsts: list[int] = []
        srcs: list[int] = []
        sizes: list[int] = []
        for k, h in enumerate(chs):
            hb = self.pool.lookup(h)
            assert hb is not None  # checked above; nothing ran in between
            host.append(hb)
            self.pool.pin(hb)
            self.pool.touch(hb)
            ids = {g: device[g][k] for g in groups}
            for g, b in ids.items():
                self.prefix.pin(g, b)
            self._add_copies(dsts, srcs, sizes, ids, hb, to_host=False)
        t = _InFlight(CopyKind.H2D, None, chs, device, host, restores=[r], nbytes=sum(sizes))
        for k, h in enumerate(chs):
            self._restoring[h] = (t, {g: device[g][k] for g in groups})
        self._submit(t, dsts, srcs, sizes, defer=True)
        return r

    # ------------------------------------------------------------------ completion
    def _start(self, t: _InFlight) -> None:
        """Submit a deferred restore; a refused submission finishes it as failed (poll)."""
        dsts, srcs, sizes = t.pending  # type: ignore[misc]
        t.pending = None
        try:
            t.transfer = self.driver.copy_batch_async(dsts, srcs, sizes, t.kind)
        except Exception as e:  # the copy never started
            t.error = e

    def poll(self) -> int:
        """Submit deferred restores, then finish every copy that is done; returns how many
        finished."""
        n = 0
        still: list[_InFlight] = []
        for t in self._inflight:
            if t.pending is not None:
                self._start(t)
            if t.transfer is None or t.transfer.done():
                self._wait_and_finish(t)
                n += 1
            else:
                still.append(t)
        self._inflight = still
        return n

    def wait_all(self) -> None:
        """Wait for every copy in flight and finish it; a restore not submitted yet is copied
        on this thread (the driver's blocking batched copy)."""
        inflight, self._inflight = self._inflight, []
        for t in inflight:
            if t.pending is not None:
                copy = getattr(self.driver, "copy_batch", None)
                if copy is None:
                    self._start(t)
                else:
                    dsts, srcs, sizes = t.pending
                    t.pending = None
                    try:
                        copy(dsts, srcs, sizes, t.kind)
                    except Exception as e:
                        t.error = e
            self._wait_and_finish(t)

    def _wait_and_finish(self, t: "_InFlight") -> None:
        """Wait for ``t``'s copy (a failure is recorded on it) and finish it."""
        if t.transfer is not None:
            try:
                t.transfer.wait()
            except Exception as e:
                t.error = e
        self._finish(t)

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def _finish(self, t: _InFlight) -> None:
        """A copy ended (or never started): index what it brought, release its pins (a
        device block no hash keeps is freed by the allocator then, e.g. a cancelled request's
        block whose restore failed)."""
        ok = t.error is None
        if t.kind is CopyKind.D2H:
            for h, hb in zip(t.hashes, t.host):
                self._offloading.discard(h)
                if ok:
                    self.pool.commit(hb, h)
                else:
                    self.pool.abort(hb)
            if ok:
                self.stats.offloaded_blocks += len(t.hashes)
                self.stats.offloaded_bytes += t.nbytes
            else:
                self.stats.offload_failures += len(t.hashes)
        else:
            for h in t.hashes:
                if self._restoring.get(h, (None,))[0] is t:
                    del self._restoring[h]
            if ok:
                self.prefix.publish(t.device, t.hashes)
                self.stats.restored_blocks += len(t.hashes)
                self.stats.restored_bytes += t.nbytes
            else:
                self.stats.restore_failures += len(t.hashes)
            for hb in t.host:
                self.pool.unpin(hb)
            for r in t.restores:
                r._copy_finished(t.error)
        for n, ids in t.device.items():
            for b in ids:
                self.prefix.unpin(n, b)
        t.finished = True
        self._sync_stats()

    def _sync_stats(self) -> None:
        self.stats.host_evictions = self.pool.evictions
        self.stats.host_blocks_used = self.pool.used
        self.stats.host_blocks_indexed = self.pool.indexed

    # ------------------------------------------------------------------ tools
    def reset(self) -> int:
        """Forget every unpinned host block (operator reset); returns how many."""
        self._pending.clear()
        n = self.pool.reset()
        self._sync_stats()
        return n

    def close(self) -> None:
        self.wait_all()
        self._pending.clear()
        self.pool.close()
