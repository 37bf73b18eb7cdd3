"""Small fakes for the prefix-cache tests: a page-aware block allocator that calls the retention
policy exactly as the virtual KV cache does, a byte-backed "device", and a driver whose batched
copies finish only when the test says so (or fail on demand)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from xllm_vmm.vmm.driver import CopyKind, VmmError


@dataclass
class FakeGroup:
    blocks_per_slot: int
    num_slots: int  # virtual capacity in slots
    tensors: int = 2  # tensors per group (K and V)
    tensor_block_bytes: int = 16
    ref: dict[int, int] = field(default_factory=dict)  # allocated block -> ref count
    cached: set[int] = field(default_factory=set)
    mapped: set[int] = field(default_factory=set)  # mapped slots


class FakeAllocator:
    """Blocks ``slot * blocks_per_slot + i``. ``budget_slots`` caps the mapped slots over all
    groups (the live budget). Allocation fills the fullest mapped slot first (best fit), then
    maps a new slot; short of memory it asks the policy to evict (slot-emptying first)."""

    def __init__(self, groups: dict[str, FakeGroup], budget_slots: int, policy=None) -> None:
        self.groups = groups
        self.budget_slots = budget_slots
        self.policy = policy
        self.released_slots: list[tuple[str, int]] = []
        self.mapped_peak = 0
        # "device" memory: one buffer per group per tensor, capacity num_slots * bps blocks
        self.mem: dict[str, list[ctypes.Array]] = {}
        for name, g in groups.items():
            n = g.num_slots * g.blocks_per_slot * g.tensor_block_bytes
            self.mem[name] = [(ctypes.c_char * n)() for _ in range(g.tensors)]

    # ---- helpers
    def mapped_total(self) -> int:
        return sum(len(g.mapped) for g in self.groups.values())

    def _slot_occupancy(self, g: FakeGroup, slot: int) -> int:
        lo = slot * g.blocks_per_slot
        return sum(1 for b in range(lo, lo + g.blocks_per_slot) if b in g.ref)

    def _free_positions(self, name: str) -> list[int]:
        g = self.groups[name]
        slots = sorted(g.mapped, key=lambda s: (-self._slot_occupancy(g, s), s))
        out = []
        for s in slots:
            lo = s * g.blocks_per_slot
            out.extend(b for b in range(lo, lo + g.blocks_per_slot) if b not in g.ref)
        return out

    def available(self, name: str) -> int:
        g = self.groups[name]
        spare = min(self.budget_slots - self.mapped_total(), g.num_slots - len(g.mapped))
        n = len(self._free_positions(name)) + max(0, spare) * g.blocks_per_slot
        if self.policy is not None:
            n += self.policy.num_evictable(name)
        return n

    # ---- allocator API
    def allocate(self, name: str, n: int) -> list[int] | None:
        g = self.groups[name]
        for attempt in range(3):
            got = self._try(name, n)
            if got is not None:
                for b in got:
                    g.ref[b] = 1
                return got
            if self.policy is None:
                return None
            short = n - len(self._free_positions(name))
            victims = self.policy.evict(name, short, prefer_slot_emptying=True)
            if not victims:
                return None
            for b in victims:
                assert g.ref.get(b) == 0, f"policy evicted block {b} with ref {g.ref.get(b)}"
                assert self.policy.pin_count(name, b) == 0, f"policy evicted pinned block {b}"
                g.cached.discard(b)
                self._release(name, b)
        return None

    def _try(self, name: str, n: int) -> list[int] | None:
        g = self.groups[name]
        free = self._free_positions(name)
        added = []
        while len(free) < n:
            new = [s for s in range(g.num_slots) if s not in g.mapped]
            if self.mapped_total() >= self.budget_slots or not new:
                g.mapped.difference_update(added)  # all or nothing, like the real pool
                return None
            g.mapped.add(new[0])
            added.append(new[0])
            self.mapped_peak = max(self.mapped_peak, self.mapped_total())
            free = self._free_positions(name)
        return free[:n]

    def _release(self, name: str, b: int) -> None:
        g = self.groups[name]
        del g.ref[b]
        slot = b // g.blocks_per_slot
        if self._slot_occupancy(g, slot) == 0:
            g.mapped.discard(slot)
            self.released_slots.append((name, slot))

    def free(self, name: str, blocks) -> None:
        g = self.groups[name]
        for b in blocks:
            assert g.ref.get(b, 0) > 0, f"free of block {b} with ref {g.ref.get(b)}"
            g.ref[b] -= 1
            if g.ref[b] == 0:
                keep = self.policy is not None and self.policy.on_zero_ref(name, b)
                if keep:
                    g.cached.add(b)
                else:
                    self._release(name, b)

    def touch(self, name: str, block: int) -> None:
        g = self.groups[name]
        assert block in g.ref, f"touch of unallocated block {block}"
        if g.ref[block] == 0:
            g.cached.discard(block)
            g.ref[block] = 1
            self.policy.on_revive(name, block)
        else:
            g.ref[block] += 1

    def slot_of(self, name: str, block: int) -> int:
        return block // self.groups[name].blocks_per_slot

    def slot_live(self, name: str, slot: int) -> int:
        g = self.groups[name]
        lo = slot * g.blocks_per_slot
        return sum(1 for b in range(lo, lo + g.blocks_per_slot) if g.ref.get(b, 0) > 0)

    # ---- addresses (BlockAddresses)
    def block_segments(self, name: str, block: int):
        g = self.groups[name]
        assert block in g.ref, f"address of unallocated block {block} (invariant 1)"
        assert block // g.blocks_per_slot in g.mapped, f"block {block} on an unmapped slot"
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
        self.prefix.release(req.blocks)
        if self.host is not None:
            self.host.step()


@dataclass
class Req:
    tokens: list
    hashes: list
    blocks: dict
    hit: int
    restore: object = None
