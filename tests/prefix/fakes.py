"""Small fakes for the prefix-cache unit tests: the real block allocator over a byte-backed
fake "device" with a slot budget (eviction before a retried allocation, as the manager does),
a driver whose batched copies finish only when the test says so (or fail on demand), and a
unit-level request driver. The engine's path — the manager — is tested in
``tests/kvcache/test_manager*.py`` and ``tests/prefix/test_stateful_real.py``."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from xllm_vmm.vmm.driver import CopyKind, VmmError


@dataclass
class FakeGroup:
    blocks_per_slot: int
    num_slots: int  # virtual capacity in slots
    tensors: int = 2  # tensors per group (K and V)
    tensor_block_bytes: int = 16


class _GroupView:
    """The old test-facing view of one group, computed from the real allocator's state."""

    def __init__(self, alloc: "FakeAllocator", name: str) -> None:
        self._a, self._n = alloc, name

    @property
    def ref(self) -> dict[int, int]:
        """Allocated (live or cached) block -> ref count."""
        a, n = self._a.allocator, self._n
        return {b: a.ref_count(n, b) for s in a.active_slots(n) for b in a.blocks_of_slot(n, s)
                if a.ref_count(n, b) or a.is_cached(n, b)}

    @property
    def cached(self) -> set[int]:
        a, n = self._a.allocator, self._n
        return {b for s in a.active_slots(n) for b in a.blocks_of_slot(n, s)
                if a.is_cached(n, b)}

    @property
    def mapped(self) -> set[int]:
        return set(self._a.allocator.active_slots(self._n))


class FakeAllocator:
    """A real :class:`~xllm_vmm.kvcache.allocator.BlockAllocator` over a byte-backed fake
    device whose mapped slots are capped at ``budget_slots`` over all groups (the live
    budget). :meth:`allocate` does what the manager does: the allocator answers "not now",
    then the prefix cache (``policy``) evicts — before the retry, never inside it."""

    def __init__(self, groups: dict[str, FakeGroup], budget_slots: int, policy=None) -> None:
        from xllm_vmm.kvcache.allocator import BlockAllocator, GroupShape

        self.spec = groups
        self.budget_slots = budget_slots
        self.policy = policy
        self.released_slots: list[tuple[str, int]] = []
        self.mapped_peak = 0
        self._active: set[tuple[str, int]] = set()
        self.allocator = BlockAllocator(
            [GroupShape(n, g.num_slots, g.blocks_per_slot) for n, g in groups.items()], self)
        self.groups = {n: _GroupView(self, n) for n in groups}
        # "device" memory: one buffer per group per tensor, capacity num_slots * bps blocks
        self.mem: dict[str, list[ctypes.Array]] = {}
        for name, g in groups.items():
            n = g.num_slots * g.blocks_per_slot * g.tensor_block_bytes
            self.mem[name] = [(ctypes.c_char * n)() for _ in range(g.tensors)]

    # ---- SlotBacking
    def activate(self, slots) -> bool:
        n = sum(len(v) for v in slots.values())
        if len(self._active) + n > self.budget_slots:
            return False
        for g, ss in slots.items():
            self._active.update((g, s) for s in ss)
        self.mapped_peak = max(self.mapped_peak, len(self._active))
        return True

    def deactivate(self, slots) -> None:
        for g, ss in slots.items():
            for s in ss:
                self._active.remove((g, s))
                self.released_slots.append((g, s))

    # ---- helpers
    def mapped_total(self) -> int:
        return len(self._active)

    def available(self, name: str) -> int:
        a = self.allocator
        g = self.spec[name]
        spare = min(self.budget_slots - self.mapped_total(), a.num_inactive_slots(name))
        n = a.num_free_blocks(name) + max(0, spare) * g.blocks_per_slot
        if self.policy is not None:
            n += self.policy.num_evictable(name)
        return n

    def allocate(self, name: str, n: int) -> list[int] | None:
        a = self.allocator
        got = a.allocate({name: n})
        if got is None and self.policy is not None:
            short = n - a.num_free_blocks(name)
            while self.policy.evict(name, max(short, 1), prefer_slot_emptying=True):
                got = a.allocate({name: n})
                if got is not None:
                    break
                short = n - a.num_free_blocks(name)
        return None if got is None else got[name]

    def free(self, name: str, blocks) -> None:
        """A request's references dropped (unpublished blocks: no prefix cache needed)."""
        self.allocator.free({name: list(blocks)})

    # ---- addresses (BlockAddresses)
    def block_segments(self, name: str, block: int):
        a = self.allocator
        g = self.spec[name]
        assert a.ref_count(name, block) or a.is_cached(name, block), \
            f"address of unallocated block {block} (invariant 1)"
        assert (name, block // g.blocks_per_slot) in self._active, \
            f"block {block} on an unmapped slot"
        return [(ctypes.addressof(t) + block * g.tensor_block_bytes, g.tensor_block_bytes)
                for t in self.mem[name]]

    def write_block(self, name: str, block: int, payload: bytes) -> None:
        for i, (addr, nb) in enumerate(self.block_segments(name, block)):
            data = (payload * (nb // len(payload) + 1))[:nb]
            data = bytes((x + i) % 256 for x in data)
            ctypes.memmove(addr, data, nb)

    def read_block(self, name: str, block: int) -> bytes:
        return b"".join(ctypes.string_at(a, n) for a, n in self.block_segments(name, block))


class ManualTransfer:
    def __init__(self, driver: "ManualDriver", ops, fail: bool) -> None:
        self.driver = driver
        self.ops = ops
        self.fail = fail
        self.completed = False

    def complete(self) -> None:
        if self.completed:
            return
        if not self.fail:
            for d, s, n in self.ops:
                ctypes.memmove(d, s, n)
        self.completed = True

    def done(self) -> bool:
        if self.driver.auto_complete:
            self.complete()
        return self.completed

    def wait(self, timeout=None) -> None:
        self.complete()
        if self.fail:
            raise VmmError("copy_batch_async", 5, "injected copy failure")


class ManualDriver:
    """Copies run when the test calls ``complete`` (or at ``done`` with ``auto_complete``)."""

    name = "manual"
    device_kind = "cpu"
    device_index = 0

    def __init__(self, auto_complete: bool = False) -> None:
        self.auto_complete = auto_complete
        self.transfers: list[ManualTransfer] = []
        self.fail_next_submit = 0
        self.fail_next_copy = 0

    def copy_batch_async(self, dsts, srcs, sizes, kind: CopyKind):
        if self.fail_next_submit:
            self.fail_next_submit -= 1
            raise VmmError("copy_batch_async", 22, "injected submit failure")
        fail = False
        if self.fail_next_copy:
            self.fail_next_copy -= 1
            fail = True
        t = ManualTransfer(self, list(zip(dsts, srcs, sizes)), fail)
        t.kind = kind
        self.transfers.append(t)
        return t

    def complete_all(self) -> None:
        for t in self.transfers:
            t.complete()


class Runner:
    """Drives requests the way the engine does: hash, look up, acquire the hit, allocate the
    rest, write the KV (a payload derived from the block hash, so content can be checked
    against the index), publish complete blocks, release tail first."""

    def __init__(self, alloc: FakeAllocator, prefix, block_size: int, host=None) -> None:
        self.alloc = alloc
        self.prefix = prefix
        self.block_size = block_size
        self.host = host

    @staticmethod
    def payload(h: int) -> bytes:
        return h.to_bytes(16, "little")

    def start(self, tokens, *, restore=True):
        from xllm_vmm.kvcache.hashing import block_hashes

        hashes = block_hashes(tokens, self.block_size)
        n_blocks = -(-len(tokens) // self.block_size)
        hit = self.prefix.lookup(hashes, max_blocks=(len(tokens) - 1) // self.block_size)
        self.prefix.acquire(hit)
        blocks = {g: list(hit.blocks[g]) for g in self.prefix.group_names}
        need = n_blocks - hit.num_blocks
        got = {}
        for g in self.prefix.group_names:
            new = self.alloc.allocate(g, need) if need else []
            if new is None:
                for gg, ids in got.items():
                    self.alloc.free(gg, ids)
                self.prefix.release({g: list(hit.blocks[g]) for g in self.prefix.group_names})
                return None
            got[g] = new
            blocks[g].extend(new)
        r = None
        n_host = 0
        if self.host is not None and restore:
            n_host = self.host.match(hashes, hit.num_blocks,
                                     max_blocks=(len(tokens) - 1) // self.block_size)
            if n_host:
                r = self.host.restore(hashes[hit.num_blocks:hit.num_blocks + n_host],
                                      hit.num_blocks,
                                      {g: got[g][:n_host] for g in self.prefix.group_names})
                r.update(blocks)  # positions that joined another restore use its blocks
        return Req(tokens, hashes, blocks, hit.num_blocks, r)

    def compute(self, req) -> None:
        """Write every block not hit on the device (nor restored successfully), then publish."""
        first = req.hit
        if req.restore is not None:
            req.restore.wait()
            if req.restore.ok:
                first += req.restore.num_blocks
        for i in range(first, len(req.hashes)):
            for g in self.prefix.group_names:
                self.alloc.write_block(g, req.blocks[g][i], self.payload(req.hashes[i]))
        self.prefix.publish(req.blocks, req.hashes[first:], first_block=first)

    def finish(self, req) -> None:
        hashes = self.prefix.release(req.blocks)
        if self.host is not None:
            self.host.offload(hashes)
            self.host.step()


@dataclass
class Req:
    tokens: list
    hashes: list
    blocks: dict
    hit: int
    restore: object = None
    rid: str = ""  # the manager's request id (real stack)
    host: int = 0  # blocks restored from the host tier (real stack)
