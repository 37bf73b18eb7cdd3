"""The prefix-cache state machine over the real stack: host driver → elastic pool (a quota of
two slots) → VirtualKVCache → PrefixCache → HostTier (write-through offload, restores), with
real bytes and the driver's real copy thread.

Each computed block gets a tag derived from its hash (16 bytes at the start and at the end of
every tensor's part of the block, plus the tensor's index); copies to and from the host tier
carry whole blocks, so the tags travel with them. Checked after every step: every block in the
hash index holds the tags of its hash (the index is consistent with the contents), every block
a running request holds — hits, restored and computed blocks alike — is still allocated and
still holds its tags (pinned blocks are never evicted or overwritten), blocks under a copy in
flight stay allocated and pinned, the pool never maps beyond its quota; at teardown, with
everything cancelled and drained, no block, mapping, handle or pin is left.
"""

import ctypes

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from xllm_vmm.vmm import CopyKind
from tests.prefix.real import BS, MiB, Stack, flat_layout
from tests._hyp import examples

BUDGET = 8 * MiB  # two slots of 8 blocks (K and V pages of 2 MiB, 256 KiB per tensor block)
SYSTEM_PROMPTS = [[1000 + i for i in range(3 * BS)], [2000 + i for i in range(2 * BS)],
                  [3000 + i for i in range(BS)]]
TAG = 16


def _tag(h: int, tensor: int) -> bytes:
    return ((h & ((1 << 120) - 1)) | (tensor << 120)).to_bytes(TAG, "little")


class RealPrefixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = Stack("host", flat_layout(), budget=BUDGET, max_tokens=4 * 8 * BS,
                       host_factor=1.5)
        self.alloc = self.s.cache.allocator
        self.groups = self.s.groups
        self.running: list = []
        self.computed: dict[int, int] = {}  # id(request) -> blocks holding their hash's tags
        self.next_tok = 1
        self._buf = (ctypes.c_char * TAG)()

    # ---- block contents: a tag per tensor at both ends of the block
    def _spots(self, g: str, block: int):
        geo = self.s.cache.geometry[g]
        nb = geo.group.tensor_block_bytes
        for t in range(geo.num_tensors):
            a = self.s.cache.block_address(g, t, block)
            yield t, a, a + nb - TAG

    def _write(self, g: str, block: int, h: int) -> None:
        for t, head, tail in self._spots(g, block):
            ctypes.memmove(self._buf, _tag(h, t), TAG)
            src = ctypes.addressof(self._buf)
            self.s.driver.copy_batch([head, tail], [src, src], [TAG, TAG], CopyKind.H2D)

    def _holds(self, g: str, block: int, h: int) -> bool:
        for t, head, tail in self._spots(g, block):
            for a in (head, tail):  # a checked copy: an unmapped block raises VmmNotMapped
                self.s.driver.copy(ctypes.addressof(self._buf), a, TAG, CopyKind.D2H)
                if bytes(self._buf) != _tag(h, t):
                    return False
        return True

    # ---- rules
    @rule(sp=st.integers(0, len(SYSTEM_PROMPTS) - 1), suffix=st.integers(0, 2),
          restore=st.booleans())
    def start(self, sp, suffix, restore):
        # Settle the copies in flight first: whether this request gets memory ("not now" when
        # blocks are still pinned by a copy) must not depend on the copy thread's timing, or
        # hypothesis cannot replay the rule sequence (the `running` preconditions would change
        # between runs). Copies still overlap every other rule and the invariant checks.
        self.s.host.wait_all()
        toks = list(SYSTEM_PROMPTS[sp])
        for _ in range(suffix * BS + 1):
            toks.append(self.next_tok % 3 + 1)  # few distinct suffixes: some are shared too
            self.next_tok += 1
        req = self.s.start(toks, restore=restore)  # None: "not now" (memory held by others)
        if req is not None:
            self.running.append(req)

    def _compute(self, req) -> None:
        if id(req) in self.computed:
            return
        first = req.hit
        if req.restore is not None and req.restore.wait():
            first += req.restore.num_blocks
        n = len(req.blocks[self.groups[0]])
        for i in range(first, n):
            h = req.hashes[i] if i < len(req.hashes) else 0  # the incomplete last block
            for g in self.groups:
                self._write(g, req.blocks[g][i], h)
        self.s.prefix.publish(req.blocks, req.hashes[first:], first_block=first)
        self.computed[id(req)] = len(req.hashes)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def compute(self, i):
        self._compute(self.running[i % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), cancel=st.integers(0, 3).map(lambda x: x == 0))
    def finish(self, i, cancel):
        """Complete (computing first if needed) or, sometimes, cancel a request."""
        req = self.running[i % len(self.running)]
        if cancel:
            if req.restore is not None:
                req.restore.cancel()
        else:
            self._compute(req)
        self.running.remove(req)
        self.computed.pop(id(req), None)
        self.s.finish(req)  # releases its references; the host tier reaps finished copies

    @rule()
    def poll(self):
        self.s.host.step()

    @rule()
    def drain_copies(self):
        self.s.host.wait_all()

    @rule()
    def memory_pressure(self):
        """Every evictable device block goes (slot-emptying order); pinned ones must stay."""
        for g in self.groups:
            victims = self.s.prefix.evict(g, self.alloc.num_evictable(g))
            self.alloc.release_cached(g, victims)

    @rule()
    def operator_reset(self):
        self.s.prefix.reset()

    # ---- invariants
    @invariant()
    def budget_respected(self):
        assert self.s.pool.mapped_bytes <= BUDGET
        self.alloc.check_invariants()

    @invariant()
    def index_matches_contents(self):
        for g in self.groups:
            grp = self.s.prefix._groups[g]
            for h, b in grp.hash_to_block.items():
                assert grp.block_hash[b] == h
                assert self.alloc.ref_count(g, b) > 0 or self.alloc.is_cached(g, b)
                assert self._holds(g, b, h), f"{g} block {b} does not hold the KV of its hash"

    @invariant()
    def running_requests_keep_their_blocks(self):
        for req in self.running:
            done = self.computed.get(id(req), req.hit)  # hits hold their tags from the start
            for g in self.groups:
                for i, b in enumerate(req.blocks[g]):
                    assert self.alloc.ref_count(g, b) > 0, f"{g} block {b} of a running request"
                    if i < done:
                        assert self._holds(g, b, req.hashes[i]), \
                            f"{g} block {b} of a running request was overwritten"

    @invariant()
    def copies_in_flight_hold_their_blocks(self):
        for t in self.s.host._inflight:
            for g, ids in t.device.items():
                for b in ids:
                    assert self.alloc.ref_count(g, b) > 0 or self.alloc.is_cached(g, b), \
                        f"{g} block {b} freed under a copy"
                    assert self.s.prefix.pin_count(g, b) > 0

    def teardown(self):
        s = self.s
        try:
            for req in self.running:
                if req.restore is not None:
                    req.restore.cancel()
                s.prefix.release(req.blocks)
            self.running.clear()
            s.host.step()  # submits the write-through of the blocks just released
            s.host.wait_all()
            s.prefix.reset()
            s.prefix.release_orphans()
            for g in self.groups:
                assert self.alloc.num_live_blocks(g) == 0, f"{g}: live blocks leaked"
                assert self.alloc.num_cached_blocks(g) == 0
            assert s.pool.mapped_bytes == 0 and s.host.in_flight == 0
            assert all(s.host.pool.pin_count(b) == 0 for b in range(s.host.pool.capacity))
            assert s.prefix.stats.cached_blocks == 0
            s.host.close()
            s.pool.close()
            stats = s.driver.stats()
            assert stats["committed_bytes"] == 0 and stats["mappings"] == 0
            assert stats["handles"] == 0 and stats["release_pending"] == 0
        finally:
            s.driver.close()


RealPrefixMachine.TestCase.settings = settings(
    max_examples=examples(40), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestRealPrefixStateful = RealPrefixMachine.TestCase
