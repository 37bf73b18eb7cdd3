"""The state machine over the KV cache manager on the real stack: host driver → elastic pool
(a quota of two slots) → ``build_kv_cache_manager`` (VirtualKVCache, PrefixCache, HostTier:
write-through offload, restores), with real bytes, on the host driver and on the ACL emulation.
Requests go through the manager's verbs only: they arrive (lookup + allocate), are computed
(commit), grow by decode tokens (allocate + commit), finish or are cancelled (free); host copies
complete in random order; compaction runs (the manager rewrites the block tables).

The host tier's asynchronous copies are queued and run (for real, through the driver's batched
copy) only when the ``complete_copies`` rule says so — the oldest first, sometimes with an
injected failure — or when something waits for them. So requests ask for memory while copies
still pin blocks, and which rule sequence does what never depends on a thread's timing
(hypothesis can replay every sequence).

Each computed block gets a tag derived from its hash (16 bytes at the start and at the end of
every tensor's part of the block, plus the tensor's index); copies to and from the host tier
carry whole blocks, so the tags travel with them. Checked after every step: every block in the
hash index holds the tags of its hash (the index is consistent with the contents), every block
a running request holds — hits, restored and computed blocks alike, through its block table as
the manager keeps it — is still allocated and still holds its tags (pinned blocks are never
evicted or overwritten; compaction moves the data with the ids), blocks under a copy in
flight stay allocated and pinned, the pool never maps beyond its quota; at teardown, with
everything cancelled and drained, no block, mapping, handle or pin is left.
"""

import ctypes
import hashlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from xllm_vmm.kvcache.hashing import block_hashes
from xllm_vmm.vmm import CopyKind
from tests.prefix.real import BS, MiB, Stack, flat_layout, mla_index_layout
from tests._hyp import examples

BUDGET = 8 * MiB  # two slots of 8 blocks (K and V pages of 2 MiB, 256 KiB per tensor block)
SYSTEM_PROMPTS = [[1000 + i for i in range(3 * BS)], [2000 + i for i in range(2 * BS)],
                  [3000 + i for i in range(BS)]]
TAG = 16


def _tag(h: int, tensor: int) -> bytes:
    return ((h & ((1 << 120) - 1)) | (tensor << 120)).to_bytes(TAG, "little")


class RealPrefixMachine(RuleBasedStateMachine):
    KIND = "host"
    LAYOUT = staticmethod(flat_layout)
    HOST_FACTOR = 1.5

    def __init__(self) -> None:
        super().__init__()
        self.s = Stack(self.KIND, self.LAYOUT(), budget=BUDGET, max_tokens=4 * 8 * BS,
                       host_factor=self.HOST_FACTOR, step_copies=True)
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
    @rule(sp=st.integers(0, len(SYSTEM_PROMPTS) - 1), suffix=st.integers(0, 2))
    def start(self, sp, suffix):
        # Copies still queued pin their blocks: this request may get "not now" because of them
        # (deterministically: copies complete only through rules).
        toks = list(SYSTEM_PROMPTS[sp])
        for _ in range(suffix * BS + 1):
            toks.append(self.next_tok % 3 + 1)  # few distinct suffixes: some are shared too
            self.next_tok += 1
        req = self.s.start(toks)  # None: "not now" (memory held by others)
        if req is not None:
            self.running.append(req)

    def _compute(self, req) -> None:
        if id(req) in self.computed:
            return
        first = req.hit
        if req.restore is not None and req.restore.wait():
            first += req.restore.num_blocks
        n = len(req.blocks[self.groups[0]])
        self._write_blocks(req, first, n)
        self.s.mgr.commit(req.rid, len(req.tokens), req.tokens)  # publishes complete blocks
        self.computed[id(req)] = len(req.hashes)

    @staticmethod
    def _partial_tag(req, i: int) -> int:
        """The tag of an incomplete block: the request's own (no other request has it)."""
        d = hashlib.blake2b(f"{req.rid}/{i}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "little") | (1 << 100)

    def _write_blocks(self, req, first: int, end: int) -> None:
        for i in range(first, end):
            h = req.hashes[i] if i < len(req.hashes) else self._partial_tag(req, i)
            for g in self.groups:
                self._write(g, req.blocks[g][i], h)

    @precondition(lambda self: any(id(r) in self.computed for r in self.running))
    @rule(i=st.integers(0, 100), n=st.integers(1, BS + 1))
    def decode(self, i, n):
        """``n`` generated tokens: allocate room (None: not now), write them, commit."""
        reqs = [r for r in self.running if id(r) in self.computed]
        req = reqs[i % len(reqs)]
        old = len(req.tokens)
        if self.s.mgr.allocate(req.rid, n) is None:
            return
        req.tokens.extend(7 + (old + k) % 3 for k in range(n))
        req.hashes = block_hashes(req.tokens, BS)
        self._write_blocks(req, old // BS, -(-len(req.tokens) // BS))
        self.s.mgr.commit(req.rid, len(req.tokens), req.tokens)
        self.computed[id(req)] = len(req.hashes)

    @precondition(lambda self: any(id(r) in self.computed for r in self.running))
    @rule(i=st.integers(0, 100), k=st.integers(1, 2 * BS + 1), accepted=st.integers(0, 100))
    def speculate(self, i, k, accepted):
        """One decode token plus ``k`` speculative ones: allocate with lookahead (None: not
        now), write them all, commit the accepted ones, truncate the rest:
        exactly the blocks beyond the kept tokens come back, free."""
        reqs = [r for r in self.running if id(r) in self.computed]
        req = reqs[i % len(reqs)]
        m = self.s.mgr
        old = len(req.tokens)
        t = m.allocate(req.rid, 1, lookahead=k)
        if t is None:
            return
        g0 = self.groups[0]
        assert len(t[g0]) == -(-(old + 1 + k) // BS)
        j = accepted % (k + 1)  # drafts accepted: 0..k
        req.tokens.extend(7 + (old + n) % 3 for n in range(1 + j))
        req.hashes = block_hashes(req.tokens, BS)
        self._write_blocks(req, old // BS, -(-len(req.tokens) // BS))
        m.commit(req.rid, len(req.tokens), req.tokens)
        keep = -(-len(req.tokens) // BS)
        tail = {g: list(t[g][keep:]) for g in self.groups}
        assert m.truncate(req.rid, len(req.tokens)) == len(tail[g0])
        for g in self.groups:
            assert len(t[g]) == keep
            for b in tail[g]:
                assert self.alloc.ref_count(g, b) == 0 and not self.alloc.is_cached(g, b)
        self.computed[id(req)] = len(req.hashes)

    @rule(cap=st.none() | st.integers(1, 8))
    def compact(self, cap):
        """Between steps the manager compacts; block tables are rewritten in place."""
        c = self.s.mgr.compact(max_blocks=cap)
        assert not c.error
        assert self.s.pool.mapped_bytes <= BUDGET

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def compute(self, i):
        self._compute(self.running[i % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), cancel=st.integers(0, 3).map(lambda x: x == 0))
    def finish(self, i, cancel):
        """Complete (computing first if needed) or, sometimes, cancel a request."""
        req = self.running[i % len(self.running)]
        if not cancel:
            self._compute(req)
        self.running.remove(req)
        self.computed.pop(id(req), None)
        self.s.finish(req)  # free (a restore in flight is cancelled) + step

    @rule()
    def poll(self):
        self.s.mgr.step()

    @precondition(lambda self: self.s.copies.queued)
    @rule(k=st.integers(1, 3), fail=st.integers(0, 4).map(lambda x: x == 0))
    def complete_copies(self, k, fail):
        """The oldest ``k`` queued copies run for real (the first fails instead, sometimes);
        the host tier notices at its next poll."""
        self.s.copies.complete(k, fail_first=fail)

    @precondition(lambda self: self.s.copies.queued)
    @rule(i=st.integers(0, 100), fail=st.integers(0, 4).map(lambda x: x == 0))
    def complete_a_copy_out_of_order(self, i, fail):
        """Any queued copy runs (not only the oldest): completions in random order."""
        self.s.copies.complete_at(i % self.s.copies.queued, fail=fail)

    @rule()
    def drain_copies(self):
        if self.s.host is not None:
            self.s.host.wait_all()

    @precondition(lambda self: not self.running)
    @rule(offload=st.booleans())
    def sleep_and_wake(self, offload):
        """Invariant 6 (the KV part): sleep with no request releases every KV page; after
        wake_up the cache maps on demand again."""
        self.s.mgr.sleep(offload=offload)
        assert self.s.pool.mapped_bytes == 0
        assert self.s.host is None or self.s.host.in_flight == 0
        self.s.mgr.wake_up()

    @rule()
    def memory_pressure(self):
        """Every evictable device block goes (slot-emptying order); pinned ones must stay."""
        for g in self.groups:
            self.s.prefix.evict(g, self.s.prefix.num_evictable(g))  # frees them

    @rule()
    def operator_reset(self):
        self.s.prefix.reset()

    # ---- invariants
    @invariant()
    def budget_respected(self):
        assert self.s.pool.mapped_bytes <= BUDGET
        self.s.mgr.check_invariants()

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
            computed = id(req) in self.computed
            done = self.computed.get(id(req), req.hit)  # hits hold their tags from the start
            for g in self.groups:
                for i, b in enumerate(req.blocks[g]):
                    assert self.alloc.ref_count(g, b) > 0, f"{g} block {b} of a running request"
                    if i < done:
                        assert self._holds(g, b, req.hashes[i]), \
                            f"{g} block {b} of a running request was overwritten"
                    elif computed:  # its own incomplete block: nobody else's data
                        assert self._holds(g, b, self._partial_tag(req, i)), \
                            f"{g} block {b} (incomplete) of a running request was overwritten"

    @invariant()
    def mapped_pages_are_exactly_the_used_slots(self):
        """Invariant 2: a page is mapped iff its slot holds a live or cached block."""
        pages = set()
        for g, geo in self.s.cache.geometry.items():
            for slot in self.alloc.active_slots(g):
                pages.update(geo.slot_pages(slot))
        assert set(self.s.pool.pages_in_use(self.s.cache.region)) == pages

    @invariant()
    def copies_in_flight_hold_their_blocks(self):
        for t in (self.s.host._inflight if self.s.host is not None else ()):
            for g, ids in t.device.items():
                for b in ids:
                    assert self.alloc.ref_count(g, b) > 0 or self.alloc.is_cached(g, b), \
                        f"{g} block {b} freed under a copy"
                    assert self.s.prefix.pin_count(g, b) > 0

    def teardown(self):
        s = self.s
        try:
            for req in self.running:
                s.mgr.free(req.rid)
            self.running.clear()
            s.mgr.step()  # submits the write-through of the blocks just released
            if s.host is not None:
                s.host.wait_all()
            s.mgr.reset_prefix_cache()
            for g in self.groups:
                assert self.alloc.num_live_blocks(g) == 0, f"{g}: live blocks leaked"
                assert self.alloc.num_cached_blocks(g) == 0
            assert s.pool.mapped_bytes == 0
            if s.host is not None:
                assert s.host.in_flight == 0
                assert all(s.host.pool.pin_count(b) == 0 for b in range(s.host.pool.capacity))
            assert s.prefix.stats.cached_blocks == 0
            s.mgr.close()
            s.pool.close()
            if hasattr(s.driver, "stats"):  # the host driver's native pool
                stats = s.driver.stats()
                assert stats["committed_bytes"] == 0 and stats["mappings"] == 0
                assert stats["handles"] == 0 and stats["release_pending"] == 0
            else:  # the ACL driver's own record of what it made
                led = s.driver._ledger
                assert led.committed == 0 and not led.handles and not led.mappings
        finally:
            s.driver.close()


class AclEmuPrefixMachine(RealPrefixMachine):
    KIND = "acl-emu"


class TwoGroupPrefixMachine(RealPrefixMachine):
    """MLA latent + index: two groups of different widths (8 and 16 blocks per page) behind the
    same verbs — allocated and freed together, a hash withdrawn from both, both copied to and
    from the host tier, both compacted."""

    LAYOUT = staticmethod(mla_index_layout)


class NoHostPrefixMachine(RealPrefixMachine):
    """Prefix caching without a host tier, one group: the manager's flat one-group paths
    (lookup through acquire_chain, the direct admission, the flat publish and release)."""

    HOST_FACTOR = 0.0


_SETTINGS = settings(max_examples=examples(20), stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
RealPrefixMachine.TestCase.settings = _SETTINGS
AclEmuPrefixMachine.TestCase.settings = _SETTINGS
NoHostPrefixMachine.TestCase.settings = _SETTINGS
TwoGroupPrefixMachine.TestCase.settings = settings(
    max_examples=examples(10), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestRealPrefixStatefulHost = RealPrefixMachine.TestCase
TestRealPrefixStatefulAclEmu = AclEmuPrefixMachine.TestCase
TestRealPrefixStatefulNoHost = NoHostPrefixMachine.TestCase
TestRealPrefixStatefulTwoGroups = TwoGroupPrefixMachine.TestCase


def test_a_request_asks_for_memory_while_a_copy_pins_blocks():
    """The coverage the rules give, once by hand: a finished request's blocks are offloaded;
    while that copy is queued (its blocks pinned), memory pressure cannot evict them and a
    request that needs them sees "not now"; once the copy completes they can go."""
    s = Stack("host", flat_layout(), budget=BUDGET, max_tokens=4 * 8 * BS, host_factor=1.5,
              step_copies=True)
    try:
        g = s.groups[0]
        req = s.start(list(SYSTEM_PROMPTS[0]) + [1])  # 4 blocks
        s.compute(req)
        s.finish(req)  # 3 complete blocks cached, their write-through queued
        assert s.copies.queued == 1 and s.host.in_flight == 1
        assert all(s.prefix.pin_count(g, b) == 1 for b in req.blocks[g][:3])
        assert s.prefix.evict(g, 8) == []  # pinned: none evictable
        big = s.start([9000 + i for i in range(13 * BS)] + [1])  # 14 blocks: two slots' worth
        assert big is None  # "not now": 3 blocks are pinned by the queued copy
        assert s.copies.complete(1) == 1
        s.host.step()  # reaps the finished copy: pins released, blocks on the host
        assert s.host.in_flight == 0 and s.host.stats.offloaded_blocks == 3
        victims = s.prefix.evict(g, s.prefix.num_evictable(g))
        assert sorted(victims) == sorted(req.blocks[g][:3])
        big = s.start([9000 + i for i in range(13 * BS)] + [1])
        assert big is not None and len(big.blocks[g]) == 14
        s.mgr.free(big.rid)
        s.host.wait_all()
        s.mgr.reset_prefix_cache()
    finally:
        s.close()
