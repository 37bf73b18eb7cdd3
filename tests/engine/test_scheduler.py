"""The scheduler over a real KVCacheManager on a tiny pool: exact chunking, admission and
preemption orders, prefix hits, cancellation, parallel samples sharing the prompt's blocks.

Tiny cache: 4 tokens per block, 4 blocks per 2 MiB page (a slot = one page each of K and V);
the elastic pool's quota is ``budget_slots`` slots, so ``budget_slots=1`` leaves 4 blocks =
16 tokens of KV in all. The "worker" is the test: every sampled token is ``TOK``."""

from __future__ import annotations

import pytest

from tests.kvcache.conftest import PAGE, toy_layout
from tests.pool.drivers import make_driver
from xllm_vmm.engine.request import Request, RequestStatus
from xllm_vmm.engine.sampling_params import SamplingParams
from xllm_vmm.engine.scheduler import Scheduler
from xllm_vmm.kvcache import build_kv_cache_manager
from xllm_vmm.pool import BudgetConfig, VmmPool

BS = 4
SLOT = 2 * PAGE
TOK = 5


class Env:
    def __init__(self, *, budget_slots=1, slots=4, prefix=False, tokens=64, seqs=8,
                 chunked=True, max_model_len=1000):
        self.driver = make_driver("sim", 64 << 20)
        self.pool = VmmPool(self.driver, BudgetConfig(max_cache_size=budget_slots * SLOT,
                                                      execution_peak_bytes=0), slots * SLOT)
        self.mgr = build_kv_cache_manager(self.pool, toy_layout(layers=1, blocks_per_page=4, block_size=BS),
                                          enable_prefix_cache=prefix, max_tokens=slots * 4 * BS,
                                          compact=False)
        self.s = Scheduler(self.mgr, max_tokens_per_batch=tokens, max_seqs_per_batch=seqs,
                           max_model_len=max_model_len, enable_chunked_prefill=chunked, pool=self.pool)

    def add(self, rid, n_prompt, max_tokens=4, parent=None, base=0, **kw):
        r = Request(rid, [base + i for i in range(n_prompt)],
                    SamplingParams(temperature=0, max_tokens=max_tokens, **kw), parent_id=parent)
        self.s.add_request(r)
        return r

    def step(self, peak=0):
        out = self.s.schedule()
        plan = [(c.request.request_id, c.start_pos, c.num_tokens, c.sample) for c in out.chunks]
        res = self.s.update(out, [TOK] * len(out.sampled), None, peak)
        return plan, out, res

    def close(self):
        self.mgr.close()
        self.pool.close()
        self.driver.close()


@pytest.fixture
def env():
    made = []

    def make(**kw):
        e = Env(**kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_chunked_prefill_then_decode(env):
    e = env(budget_slots=4, tokens=6)
    e.add("a", 10, max_tokens=2)
    assert e.step()[0] == [("a", 0, 6, False)]
    plan, _, res = e.step()
    assert plan == [("a", 6, 4, True)]
    assert [(r.request_id, r.new_token_ids, r.finished) for r in res] == [("a", [TOK], False)]
    plan, _, res = e.step()
    assert plan == [("a", 10, 1, True)]
    assert res[0].finished and res[0].finish_reason == "length"
    assert not e.s.has_unfinished() and e.mgr.num_requests == 0


def test_decodes_first_then_prefill_within_the_token_budget(env):
    e = env(budget_slots=4, tokens=5)
    e.add("a", 3, max_tokens=5)
    e.step()
    e.add("b", 9)
    e.add("c", 2)
    # a decodes (1 token), b takes the rest of the budget (4 of 9), c waits (budget spent)
    assert e.step()[0] == [("a", 3, 1, True), ("b", 0, 4, False)]
    assert e.step()[0] == [("a", 4, 1, True), ("b", 4, 4, False)]
    assert e.step()[0] == [("a", 5, 1, True), ("b", 8, 1, True), ("c", 0, 2, True)]


def test_max_seqs_per_batch_bounds_running(env):
    e = env(budget_slots=4, seqs=2)
    for r in "abc":
        e.add(r, 2)
    plan, out, _ = e.step()
    assert [p[0] for p in plan] == ["a", "b"] and e.s.num_waiting == 1


def test_admission_by_live_memory_against_the_whole_prompt(env):
    # 16 tokens of KV: a takes 3 blocks (9-token prompt); b's 3-block prompt does not fit now,
    # even with chunks of 2 tokens (admitted on its whole footprint, not its first chunk)
    e = env(budget_slots=1, tokens=12)
    e.add("a", 9, max_tokens=3)
    e.add("b", 9)
    plan, out, _ = e.step()
    assert plan == [("a", 0, 9, True)] and out.admitted == ["a"]
    assert e.s.num_waiting == 1
    e.step()
    plan, out, res = e.step()                 # a's last token; a finishes and frees its blocks
    assert res[0].finished
    plan, out, _ = e.step()
    assert out.admitted == ["b"] and plan == [("b", 0, 9, True)]


def test_preemption_newest_first_by_recompute(env):
    # a and b: 7-token prompts = 2 blocks each: the pool (4 blocks) is full. Their second
    # decode needs a 3rd block each: a (older) gets it by preempting b.
    e = env(budget_slots=1)
    a = e.add("a", 7, max_tokens=3)
    b = e.add("b", 7, max_tokens=3, base=100)
    assert e.step()[0] == [("a", 0, 7, True), ("b", 0, 7, True)]
    assert e.step()[0] == [("a", 7, 1, True), ("b", 7, 1, True)]   # position 7: still block 2
    plan, out, res = e.step()
    assert out.preempted == ["b"] and plan == [("a", 8, 1, True)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert res[0].request_id == "a" and res[0].finished                 # a: 3 tokens, done
    assert e.s.num_preemptions == 1
    # b comes back first, recomputing prompt + its 2 outputs (9 tokens), then decodes on
    plan, out, res = e.step()
    assert out.admitted == ["b"] and plan == [("b", 0, 9, True)]
    assert b.output_token_ids == [TOK] * 3 and res[0].finished
    assert e.mgr.num_requests == 0 and e.mgr.stats()["live_blocks"] == 0


def test_older_request_growth_preempts_the_newest(env):
    e = env(budget_slots=1)
    e.add("b", 3, max_tokens=8, base=100)
    e.step()                                   # b: 1 block
    e.add("a", 11, max_tokens=8)
    plan, out, _ = e.step()                    # a: 3 blocks; the pool is full
    assert plan == [("b", 3, 1, True), ("a", 0, 11, True)]
    plan, out, _ = e.step()                    # b at pos 4 needs a block: a (newest) goes
    assert out.preempted == ["a"] and plan == [("b", 4, 1, True)]


def test_newest_request_preempts_itself_after_older_ones_are_scheduled(env):
    # a: 1 block, b: 2 blocks, 1 free. Both cross a block boundary in the same step: a (older)
    # takes the free block, b is the newest, so it preempts itself (nothing else is touched).
    e = env(budget_slots=1)
    e.add("a", 3, max_tokens=8)
    e.add("b", 7, max_tokens=8, base=100)
    e.step()
    assert e.step()[0] == [("a", 3, 1, True), ("b", 7, 1, True)]
    plan, out, _ = e.step()
    assert out.preempted == ["b"] and plan == [("a", 4, 1, True)]
    assert out.admitted == []                  # no admission in a step that preempted


def test_prefix_hit_skips_its_blocks(env):
    e = env(budget_slots=4, prefix=True)
    e.add("a", 9, max_tokens=1)
    assert e.step()[0] == [("a", 0, 9, True)]
    r = e.add("b", 9, max_tokens=1)
    plan, out, res = e.step()
    assert plan == [("b", 8, 1, True)]         # 2 cached blocks, the last token computed
    assert r.num_cached_tokens == 8 and res[0].num_cached_tokens == 8
    st = e.mgr.stats()
    assert st["prefix_hit_tokens"] == 8


def test_abort_frees_everything(env):
    e = env(budget_slots=4, tokens=4)
    e.add("a", 10)
    e.add("b", 3)
    e.step()
    assert e.mgr.num_requests >= 1
    assert e.s.abort("a").status is RequestStatus.FINISHED_ABORTED
    assert e.s.abort("b").finish_reason == "abort"
    assert e.s.abort("zzz") is None
    assert e.mgr.num_requests == 0 and e.mgr.stats()["live_blocks"] == 0
    assert not e.s.has_unfinished()


def test_parallel_samples_share_the_prompt_blocks(env):
    e = env(budget_slots=4, prefix=True)
    e.add("p#0", 9, max_tokens=2, parent="p")
    e.add("p#1", 9, max_tokens=2, parent="p")
    plan, out, _ = e.step()
    assert plan == [("p#0", 0, 9, True)]       # p#1 waits for its sibling's prompt blocks
    plan, out, _ = e.step()
    assert plan == [("p#0", 9, 1, True), ("p#1", 8, 1, True)]
    assert e.s.requests["p#1"].num_cached_tokens == 8


def test_prompt_beyond_kv_capacity_finishes_with_length(env):
    e = env(budget_slots=1, slots=1)          # 16 tokens in all
    e.add("big", 20)
    plan, out, res = e.step()
    assert plan == [] and [(r.request_id, r.finish_reason) for r in res] == [("big", "length")]
    assert not e.s.has_unfinished()


def test_lone_request_reaching_kv_capacity_finishes_with_length(env):
    e = env(budget_slots=1, slots=1)
    e.add("a", 14, max_tokens=10)
    e.step()                                    # 14 tokens, 4 blocks
    e.step()                                    # computes pos 14
    e.step()                                    # pos 15
    plan, out, res = e.step()                   # pos 16 needs a 5th block: none left
    assert plan == [] and res[0].finish_reason == "length" and e.s.capacity_finished == 1
    assert e.mgr.num_requests == 0


def test_execution_peak_reported_to_the_pool(env):
    e = env(budget_slots=4)
    e.add("a", 3)
    e.step(peak=4096)
    assert e.s.execution_peak_bytes == 4096
    assert e.pool.execution_peak.bytes >= 4096


def test_no_chunked_prefill_waits_for_the_whole_prompt(env):
    e = env(budget_slots=4, tokens=6, chunked=False)
    e.add("a", 3, max_tokens=5)
    e.add("b", 5)
    assert e.step()[0] == [("a", 0, 3, True)]          # b (5 > 3 left) not chunked: waits
    assert e.step()[0] == [("a", 3, 1, True), ("b", 0, 5, True)]


def test_no_chunked_prefill_recomputes_a_long_preempted_request_in_chunks(env):
    # prompt + outputs (5 + 3 = 8) exceed the 6-token budget after preemption: chunked anyway
    e = env(budget_slots=4, tokens=6, chunked=False)
    r = e.add("a", 5, max_tokens=8)
    e.step()
    e.step()
    e.step()                                   # 5 prompt + 2 outputs computed, 3 outputs
    e.s._preempt(r)                            # as a full pool would
    plan, out, _ = e.step()
    assert plan == [("a", 0, 6, False)]
    assert e.step()[0] == [("a", 6, 2, True)]


def test_update_keeps_rows_aligned_when_a_sampled_request_was_aborted_meanwhile(env):
    """``token_ids[i]`` belongs to the i-th sampled chunk even when an earlier sampled request
    was aborted between ``schedule`` and ``update`` (the server cancels from another thread)."""
    e = env(budget_slots=4, tokens=16)
    for r in "abc":
        e.add(r, 2, max_tokens=3)
    e.step()
    out = e.s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a", "b", "c"]
    e.s.abort("a")
    res = e.s.update(out, [11, 22, 33])
    assert [(r.request_id, r.new_token_ids) for r in res] == [("b", [22]), ("c", [33])]
    assert e.s.requests["b"].output_token_ids == [TOK, 22]
    assert e.s.generation_tokens == 3 + 2


def test_a_prefix_being_prefilled_is_shared_not_prefilled_twice(env):
    """Two prompts with the same first 8 tokens arrive together: the second waits while the
    first prefills them, then is admitted on the two published blocks (8 hit tokens) and
    prefills only its own tail; a third, unrelated prompt behind it is not held up."""
    e = env(budget_slots=4, prefix=True)
    e.add("a", 9, max_tokens=3)
    b = e.add("b", 11, max_tokens=2)  # tokens 0..10: shares a's first two blocks
    e.add("c", 5, max_tokens=2, base=100)
    plan, _, _ = e.step()
    assert plan == [("a", 0, 9, True), ("c", 0, 5, True)]
    assert [r.request_id for r in e.s.waiting] == ["b"]
    plan, _, _ = e.step()
    assert plan == [("a", 9, 1, True), ("c", 5, 1, True), ("b", 8, 3, True)]
    assert b.num_cached_tokens == 8
    assert e.mgr.block_tables("b")["attn"][:2] == e.mgr.block_tables("a")["attn"][:2]


def test_a_chunked_prefill_holds_back_a_request_on_its_prefix_until_it_is_published(env):
    e = env(budget_slots=4, prefix=True, tokens=6)
    e.add("a", 13, max_tokens=1)
    b = e.add("b", 13, max_tokens=1)  # the same prompt
    assert e.step()[0] == [("a", 0, 6, False)]  # b waits: a computes its first block now
    assert e.step()[0] == [("a", 6, 6, False)]  # a's block 0 is published; b's next one is not
    plan, _, _ = e.step()
    assert plan == [("a", 12, 1, True), ("b", 12, 1, True)]  # b hits a's three blocks
    assert b.num_cached_tokens == 12


def test_no_prefix_cache_no_waiting_on_a_shared_prefix(env):
    e = env(budget_slots=4, prefix=False)
    e.add("a", 9, max_tokens=1)
    e.add("b", 9, max_tokens=1)
    assert e.step()[0] == [("a", 0, 9, True), ("b", 0, 9, True)]
