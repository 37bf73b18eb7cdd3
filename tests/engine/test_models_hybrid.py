"""Qwen3-Next (Gated DeltaNet + gated full attention + MoE with a shared expert) as a hybrid
model: greedy tokens equal ``transformers.Qwen3NextForCausalLM`` on a tiny fp32 checkpoint;
only the full-attention layers' K/V are in the VMM cache, the conv/recurrent state is resident
per sequence slot outside the pool (HY-01) and admission counts the slots; chunked prefill
carries the state; prefix hits resume from the checkpoint published with the block (PC-02)."""

from __future__ import annotations

import pytest
import torch

from tests.engine import checkpoints as C
from tests.engine.managed_stack import ManagedStack
from xllm_vmm.engine.layers import linear_attention as LA
from xllm_vmm.engine.step import SeqChunk, StepInput

BS = 16
ATOL = 2e-4


@pytest.fixture(scope="module")
def qn(tmp_path_factory):
    d = C.qwen3_next_checkpoint(tmp_path_factory.mktemp("qwen3next") / "m")
    return d, C.load_hf_model(d)


_prompt = C.random_prompt


_hf_last_logits = C.hf_last_logits


@pytest.fixture
def stack(qn):
    s = ManagedStack(qn[0], block_size=BS)
    yield s
    s.close()


def test_only_full_attention_kv_is_in_the_pool(qn, stack):
    layout = stack.layout
    assert [g.name for g in layout.groups] == ["attn"]
    assert [t.name for t in layout.group("attn").tensors] == \
        ["layer1.k", "layer1.v", "layer3.k", "layer3.v"]
    state = stack.worker.runner.backend.state
    # the running cache and plan agree: bytes per sequence slot = ResidentState's
    assert state.bytes_per_seq == layout.resident.bytes_per_seq == 2 * (64 * 3 + 4 * 8 * 8) * 4
    mgr = stack.sched_mgr.state
    assert mgr.slots.capacity == 8 and state.num_slots == 8
    assert mgr.slots.reserved_bytes == state.reserved_bytes == 8 * layout.resident.bytes_per_seq
    lo, hi = stack.pool.arena_va, stack.pool.arena_va + stack.pool.arena_pages * stack.pool.page_bytes
    for t in (state.conv, state.rec):
        assert not lo <= t.data_ptr() < hi  # resident: outside the VMM arena
    assert stack.worker.model.unused_weights == []


@pytest.mark.parametrize("n", [1, 5, BS, 70])
def test_prefill_logits_match_hf(qn, stack, n):
    ids = _prompt(n)
    tab = stack.mgr.allocate("x", n, num_prompt_tokens=n)
    out = stack.worker.execute(StepInput.build([SeqChunk("x", ids, 0, tab, True, state_slot=3)],
                                               BS))
    torch.testing.assert_close(out.logits[0], _hf_last_logits(qn[1], ids), atol=ATOL, rtol=0)


def test_a_chunk_without_a_state_slot_is_refused(stack):
    tab = stack.mgr.allocate("x", 4, num_prompt_tokens=4)
    with pytest.raises(ValueError, match="no state_slot"):
        stack.worker.execute(StepInput.build([SeqChunk("x", [5, 6, 7, 8], 0, tab, True)], BS))


@pytest.mark.parametrize("vmm", [True, False], ids=["vmm", "physical"])
def test_batched_greedy_matches_hf_generate(qn, vmm):
    s = ManagedStack(qn[0], block_size=BS, vmm=vmm)
    try:
        prompts = {f"r{n}": _prompt(n, 2) for n in (1, 9, 2 * BS + 7)}
        got = s.generate(prompts, 6)
    finally:
        s.close()
    for r, ids in prompts.items():
        assert got[r] == C.hf_greedy(qn[1], ids, 6), r


def test_chunked_prefill_carries_the_state(qn):
    s = ManagedStack(qn[0], block_size=BS, max_batch_tokens=13)
    try:
        prompts = {"a": _prompt(45, 3), "b": _prompt(30, 3)}
        got = s.generate(prompts, 4)
        chunked = [c for st in s.steps for c in st.chunks if len(c.token_ids) > 1 and c.start_pos]
    finally:
        s.close()
    assert chunked
    for r, ids in prompts.items():
        assert got[r] == C.hf_greedy(qn[1], ids, 4), r


@pytest.mark.parametrize("interval,expect", [(1, 3 * BS), (2, 2 * BS)])
def test_prefix_hit_resumes_from_the_published_checkpoint(qn, interval, expect):
    """The second prompt shares 3 whole blocks; with a checkpoint every ``interval`` blocks the
    hit is cut back to the last block that has one (PC-02), and its tokens equal HF's."""
    from xllm_vmm.engine.linear_state import attach_linear_state

    s = ManagedStack(qn[0], block_size=BS, prefix=True, max_batch_tokens=20)
    try:
        s.sched_mgr, s.runner = attach_linear_state(s.mgr, s.worker, max_seqs=8,
                                                    checkpoint_interval=interval)
        s.sched.mgr = s.sched_mgr
        base = _prompt(3 * BS + 9, 4)
        first = s.generate({"a": base}, 3)["a"]
        other = base[:3 * BS + 2] + _prompt(11, 5)
        second = s.generate({"b": other}, 3)["b"]
        starts = [c.start_pos for st in s.steps for c in st.chunks if c.request_id == "b"]
        stats = s.sched_mgr.stats()
    finally:
        s.close()
    assert starts[0] == expect
    assert stats["linear_state_restores"] == 1 and stats["prefix_hit_tokens"] == expect
    assert first == C.hf_greedy(qn[1], base, 3)
    assert second == C.hf_greedy(qn[1], other, 3)


def test_admission_counts_the_state_slots(qn):
    """One state slot: the second request waits for the first to finish (never in one step),
    though the scheduler itself would run both."""
    from xllm_vmm.engine.linear_state import attach_linear_state

    s = ManagedStack(qn[0], block_size=BS)
    try:
        s.sched_mgr, s.runner = attach_linear_state(s.mgr, s.worker, max_seqs=1)
        s.sched.mgr = s.sched_mgr
        prompts = {"a": _prompt(12, 6), "b": _prompt(20, 6)}
        got = s.generate(prompts, 3)
        together = [st for st in s.steps if len({c.request_id for c in st.chunks}) > 1]
        assert s.sched_mgr.state.slots.available == 1
    finally:
        s.close()
    assert not together
    for r, ids in prompts.items():
        assert got[r] == C.hf_greedy(qn[1], ids, 3), r


@pytest.mark.parametrize("n", [1, 3, 17, 64, 100])
def test_delta_rule_forms_match_transformers(n):
    """Both the recurrent and the chunked delta rule equal transformers' reference
    implementation, from a non-zero initial state, and return its final state."""
    from transformers.models.qwen3_next import modeling_qwen3_next as M

    g = torch.Generator().manual_seed(n)
    q, k = torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
    v = torch.randn(n, 4, 8, generator=g)
    decay = -torch.rand(n, 4, generator=g)
    beta = torch.rand(n, 4, generator=g)
    s0 = torch.randn(4, 8, 8, generator=g)
    ref, ref_s = M.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], decay[None], beta[None], initial_state=s0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    for fn in (LA.recurrent_gated_delta_rule, LA.chunk_gated_delta_rule):
        out, s = fn(q, k, v, decay, beta, s0)
        torch.testing.assert_close(out, ref[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s, ref_s[0], atol=1e-4, rtol=1e-4)


def test_causal_conv_state_continues_across_pieces():
    from transformers.models.qwen3_next import modeling_qwen3_next as M

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(23, 6, generator=g), torch.randn(6, 4, generator=g)
    ref = M.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    state, outs = torch.zeros(6, 3), []
    for a, b in ((0, 1), (1, 9), (9, 10), (10, 23)):
        y, state = LA.causal_conv1d(x[a:b], state, w)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, x[-3:].t())


def test_llm_generate_runs_the_hybrid_model_with_prefix_hits(qn):
    """Through the public API (plan-sized engine, its scheduler): the same tokens as
    transformers, and a second prompt sharing two blocks resumes from a checkpoint."""
    from xllm_vmm import LLM, SamplingParams

    llm = LLM(model=str(qn[0]), enable_prefix_cache=True, block_size=BS)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        base = _prompt(2 * BS + 5, 8)
        other = base[:2 * BS + 1] + _prompt(6, 9)
        got = [list(llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids)
               for p in (base, other)]
        stats = llm.llm_engine.kv_cache_manager.stats()
        wp = llm.llm_engine.plan.workers[0]
        state = llm.llm_engine.kv_cache_manager.state
        # plan and the running engine agree: slots, bytes per slot, reserved bytes (HY-01)
        assert wp.resident_slots == state.slots.capacity > 0
        assert wp.resident_bytes_per_seq == state.cache.bytes_per_seq
        assert wp.resident_bytes == state.slots.reserved_bytes == state.cache.reserved_bytes
    finally:
        llm.llm_engine.shutdown()
    assert got == [C.hf_greedy(qn[1], base, 4), C.hf_greedy(qn[1], other, 4)]
    assert stats["linear_state_restores"] == 1 and stats["prefix_hit_tokens"] == 2 * BS


def test_batched_decode_step_equals_the_recurrent_rule():
    """The batched one-token path (decodes of several sequences) gives each sequence what the
    per-sequence recurrent rule and conv give it."""
    g = torch.Generator().manual_seed(5)
    b = 3
    q, k = torch.randn(b, 2, 8, generator=g), torch.randn(b, 2, 8, generator=g)
    v, decay = torch.randn(b, 4, 8, generator=g), -torch.rand(b, 4, generator=g)
    beta, s0 = torch.rand(b, 4, generator=g), torch.randn(b, 4, 8, 8, generator=g)
    out, s = LA.gated_delta_step(q, k, v, decay, beta, s0)
    x, cs, w = torch.randn(b, 6, generator=g), torch.randn(b, 6, 3, generator=g), torch.randn(6, 4, generator=g)
    y, ns = LA.causal_conv1d_step(x, cs, w)
    for i in range(b):
        o1, s1 = LA.recurrent_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], decay[i:i + 1],
                                               beta[i:i + 1], s0[i])
        torch.testing.assert_close(out[i], o1[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s[i], s1, atol=1e-5, rtol=1e-5)
        y1, n1 = LA.causal_conv1d(x[i:i + 1], cs[i], w)
        torch.testing.assert_close(y[i], y1[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ns[i], n1)
