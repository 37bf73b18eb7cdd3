"""Property-based stateful test: random request streams with shared prefixes, cancellations,
budget pressure and injected copy failures, over the prefix cache + host tier on the real allocator over a fake device.

Checked after every step: pinned blocks are never evicted (the allocator refuses it), blocks under a copy in flight stay allocated, the device and host indexes are
consistent with the bytes they name, reference counts match the running requests (no leaks),
the budget is respected; and at the end, with everything cancelled and drained, nothing is left.
"""

import ctypes
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from xllm_vmm.kvcache.hashing import block_hashes
from xllm_vmm.kvcache.host_pool import HostPool, host_pool_size
from xllm_vmm.kvcache.host_tier import HostTier
from xllm_vmm.kvcache.prefix import PrefixCache
from tests.prefix.fakes import FakeAllocator, FakeGroup, ManualDriver, Runner
from tests._hyp import examples

BS = 2
TBB = 8
GROUPS = ("attn", "draft")
SYSTEM_PROMPTS = [[1000 + i for i in range(2 * BS)], [2000 + i for i in range(3 * BS)],
                  [3000 + i for i in range(BS)]]


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        fg = {g: FakeGroup(blocks_per_slot=2, num_slots=16, tensor_block_bytes=TBB)
              for g in GROUPS}
        self.budget = 6
        self.alloc = FakeAllocator(fg, self.budget)
        self.prefix = PrefixCache(self.alloc.allocator, {g: 2 * TBB for g in GROUPS}, BS)
        self.alloc.policy = self.prefix
        size = host_pool_size(6 * 2 * TBB * len(GROUPS), 1.5, 2 * TBB * len(GROUPS))
        self.pool = HostPool(size)
        self.driver = ManualDriver(auto_complete=False)
        self.tier = HostTier(self.prefix, self.pool, self.driver, self.alloc)
        self.run = Runner(self.alloc, self.prefix, BS, host=self.tier)
        self.running: list = []  # requests holding references
        self.computed: set[int] = set()
        self.next_tok = 1

    # ---- rules
    @rule(sp=st.integers(0, len(SYSTEM_PROMPTS) - 1), suffix=st.integers(0, 3),
          restore=st.booleans())
    def start(self, sp, suffix, restore):
        toks = list(SYSTEM_PROMPTS[sp])
        for _ in range(suffix * BS + 1):
            toks.append(self.next_tok % 5 + 1)  # few distinct suffixes: some get shared too
            self.next_tok += 1
        req = self.run.start(toks, restore=restore)
        if req is not None:
            self.running.append(req)

    def _compute(self, req) -> bool:
        if id(req) in self.computed:
            return True
        if req.restore is not None and not req.restore.finished:
            return False  # must wait for the restore
        first = req.hit + (req.restore.num_blocks if req.restore is not None and req.restore.ok
                           else 0)
        for j in range(first, len(req.hashes)):
            for g in GROUPS:
                self.alloc.write_block(g, req.blocks[g][j], Runner.payload(req.hashes[j]))
        self.prefix.publish(req.blocks, req.hashes[first:], first_block=first)
        self.computed.add(id(req))
        return True

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
        elif not self._compute(req):
            return
        self.running.remove(req)
        self.computed.discard(id(req))
        self.tier.offload(self.prefix.release(req.blocks))
        self.tier.step()

    @precondition(lambda self: self.driver.transfers)
    @rule(i=st.integers(0, 100), fail=st.integers(0, 4).map(lambda x: x == 0))
    def complete_a_copy(self, i, fail):
        pending = [t for t in self.driver.transfers if not t.completed]
        if not pending:
            return
        t = pending[i % len(pending)]
        t.fail = t.fail or fail
        t.complete()

    @rule()
    def poll(self):
        self.tier.step()

    @rule(submit=st.booleans(), now=st.integers(0, 5).map(lambda x: x == 0))
    def inject_failure(self, submit, now):
        if not now:
            return
        if submit:
            self.driver.fail_next_submit = 1
        else:
            self.driver.fail_next_copy = 1

    @rule()
    def operator_reset(self):
        self.prefix.reset()

    @rule()
    def tighten_or_relax_budget(self):
        self.alloc.budget_slots = 4 if self.alloc.budget_slots == 6 else 6

    # ---- invariants
    @invariant()
    def budget_respected(self):
        assert self.alloc.mapped_total() <= max(self.alloc.budget_slots, self.budget)
        a = self.alloc.allocator
        a.check_invariants()  # among them: every active (mapped) slot holds a block

    @invariant()
    def references_match_running_requests(self):
        want = {g: Counter() for g in GROUPS}
        for req in self.running:
            for g in GROUPS:
                want[g].update(req.blocks[g])
        cached_total = 0
        for g in GROUPS:
            fg = self.alloc.groups[g]
            for b, r in fg.ref.items():
                assert r == want[g][b], f"{g} block {b}: ref {r}, running requests hold {want[g][b]}"
                if r == 0:
                    cached_total += 1
                    assert self.prefix.is_cached(g, b), f"{g} block {b} ref 0 but not cached"
        assert self.prefix.stats.cached_blocks == cached_total

    @invariant()
    def copies_in_flight_hold_their_blocks(self):
        for t in self.tier._inflight:
            for g, ids in t.device.items():
                for b in ids:
                    assert b in self.alloc.groups[g].ref, f"{g} block {b} freed under a copy"
                    assert self.prefix.pin_count(g, b) > 0
            if t.restores:  # a restore (its first request and any that joined it)
                for hb in t.host:
                    assert self.pool.pin_count(hb) > 0

    @invariant()
    def device_index_matches_contents(self):
        for g in GROUPS:
            grp = self.prefix._groups[g]
            for h, b in grp.hash_to_block.items():
                assert grp.block_hash[b] == h
                assert b in self.alloc.groups[g].ref
                data = self.alloc.read_block(g, b)
                assert data == _expected(self.alloc, g, Runner.payload(h)), \
                    f"{g} block {b} does not hold the KV of its hash"

    @invariant()
    def host_index_matches_contents(self):
        for h, hb in list(self.pool._index.items()):
            got = ctypes.string_at(self.pool.address(hb), self.pool.block_bytes)
            exp = b"".join(_expected(self.alloc, g, Runner.payload(h)) for g in GROUPS)
            assert got == exp, f"host block {hb} does not hold the KV of its hash"

    def teardown(self):
        for req in self.running:
            if req.restore is not None:
                req.restore.cancel()
            self.prefix.release(req.blocks)
        self.running.clear()
        self.driver.complete_all()
        self.tier.wait_all()
        self.tier.step()
        self.tier.wait_all()
        self.prefix.reset()
        for g in GROUPS:
            assert self.alloc.groups[g].ref == {}, f"{g}: blocks leaked {self.alloc.groups[g].ref}"
            assert self.alloc.groups[g].mapped == set()
        assert all(self.pool.pin_count(b) == 0 for b in range(self.pool.capacity))
        assert self.prefix.stats.cached_blocks == 0 and self.tier.in_flight == 0
        self.pool.close()


def _expected(alloc, g, payload):
    grp = alloc.spec[g]
    out = []
    for i in range(grp.tensors):
        nb = grp.tensor_block_bytes
        data = (payload * (nb // len(payload) + 1))[:nb]
        out.append(bytes((x + i) % 256 for x in data))
    return b"".join(out)


PrefixMachine.TestCase.settings = settings(
    max_examples=examples(100), stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPrefixStateful = PrefixMachine.TestCase
