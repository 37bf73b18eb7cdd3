"""MTP speculative decoding: the draft directory format, target + draft caches in one manager
(SD-01), greedy output identical to decoding without speculation (and to transformers), the
rejection rule's output distribution, acceptance statistics per position."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine import checkpoints as C
from tests.engine.managed_stack import ManagedStack
from xllm_vmm.bench.mtp_draft import untrained_mtp
from xllm_vmm.engine.spec_decode import (MtpDraft, SpeculativeGenerator, greedy_verify,
                                         rejection_sample)
from xllm_vmm.engine.step import SeqChunk, StepInput

BS = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    target = C.deepseek_v3_checkpoint(root / "target")
    draft = untrained_mtp(target, root / "draft")
    return target, draft, C.load_hf_model(target)


_prompt = C.random_prompt


def test_draft_directory_is_the_export_format(pair):
    cfg = json.loads((pair[1] / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekMTPForCausalLM"]
    assert cfg["model_type"] == "deepseek_v3_mtp"
    assert cfg["num_hidden_layers"] == cfg["num_nextn_predict_layers"] == 1
    assert cfg["first_k_dense_replace"] == 0
    index = json.loads((pair[1] / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {"mtp_layer_parameters.safetensors"}
    assert {"model.enorm.weight", "model.hnorm.weight", "model.eh_proj.weight",
            "model.shared_head.head.weight", "model.layers.0.self_attn.kv_b_proj.weight",
            "model.layers.0.mlp.experts.7.down_proj.weight"} <= set(index)


def test_target_and_draft_share_one_manager(pair):
    """The layout has the draft's own latent group; one allocate maps both, the draft writes
    its latents into its group's blocks in the arena, free returns both."""
    s = ManagedStack(pair[0], block_size=BS, draft_dir=pair[1])
    try:
        assert [g.name for g in s.layout.groups] == ["mla", "draft"]
        assert [t.name for t in s.layout.group("draft").tensors] == ["draft.layer0.latent"]
        assert s.draft.unused_weights == []
        ids = _prompt(21)
        tab = s.mgr.allocate("x", len(ids), num_prompt_tokens=len(ids))
        assert len(tab["mla"]) == len(tab["draft"]) == 2
        hidden = torch.randn(len(ids), 64)
        s.draft.forward(StepInput.build([SeqChunk("x", ids, 0, tab, True)], BS), hidden)
        views, geo = s.draft.views, s.mgr.cache.geometry["draft"]
        bps = views.geometry.blocks_per_slot
        b = tab["draft"][1]
        block = views.layers[0].blocks[b // bps, b % bps]
        assert block.data_ptr() == geo.block_va(0, b)
        assert bool((block[:5] != 0).any()) and bool((block[5:] == 0).all())
        del block, views  # views of the arena must be gone before it is released
        s.mgr.free("x")
        assert s.mgr.stats()["live_blocks"] == 0
    finally:
        s.close()


def test_greedy_is_identical_to_no_speculation(pair):
    """An untrained draft proposes badly (acceptance near 0): the output is still the target's
    greedy continuation, token for token (no speculation, and transformers)."""
    k = 3
    s = ManagedStack(pair[0], block_size=BS, draft_dir=pair[1])
    try:
        prompts = {"a": _prompt(5, 1), "b": _prompt(BS + 3, 1), "c": _prompt(1, 1)}
        gen = SpeculativeGenerator(s.mgr, s.worker, s.draft, num_speculative_tokens=k)
        got = gen.generate(prompts, 12)
        plain = s.generate(prompts, 12)
        stats = gen.stats
        assert s.mgr.stats()["live_blocks"] == 0  # every block of both groups given back
    finally:
        s.close()
    assert got == plain
    for r in ("a", "b"):
        assert got[r] == C.hf_greedy(pair[2], prompts[r], 12), r
    assert stats.num_draft_tokens == k * stats.num_drafts
    assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)
    assert stats.emitted_tokens == 3 * 12 - 3  # the first token of each comes from the prefill
    d = stats.as_dict()
    assert d["spec_decode_num_drafts"] == stats.num_drafts
    assert len(d["spec_decode_num_accepted_tokens_per_pos"]) == k


def test_prefix_hits_keep_the_output(pair):
    """A prompt sharing whole blocks with an earlier one starts from the prefix cache (target
    and draft blocks both cached); the draft's cache there is the earlier request's, which may
    only cost acceptance: the output is still the target's greedy continuation."""
    s = ManagedStack(pair[0], block_size=BS, draft_dir=pair[1], prefix=True)
    try:
        gen = SpeculativeGenerator(s.mgr, s.worker, s.draft, num_speculative_tokens=2)
        base = _prompt(2 * BS + 3, 4)
        first = gen.generate({"a": base}, 8)["a"]
        other = base[:2 * BS + 1] + _prompt(4, 5)
        second = gen.generate({"b": other}, 8)["b"]
        hits = s.mgr.stats()["prefix_hit_tokens"]
    finally:
        s.close()
    assert hits == 2 * BS
    assert first == C.hf_greedy(pair[2], base, 8)
    assert second == C.hf_greedy(pair[2], other, 8)


def test_hidden_state_slots_bound_the_running_sequences(pair):
    """One MTP hidden-state slot: the three prompts run one after another (every verify step
    holds one sequence), with the same output."""
    s = ManagedStack(pair[0], block_size=BS, draft_dir=pair[1])
    try:
        prompts = {"a": _prompt(5, 6), "b": _prompt(9, 6), "c": _prompt(3, 6)}
        seen = []
        gen = SpeculativeGenerator(s.mgr, s.worker, s.draft, num_speculative_tokens=2,
                                   max_seqs=1)
        assert gen.slots.bytes_per_seq == 64 * 4  # one fp32 hidden vector per sequence
        run = gen._target
        gen._target = lambda chunks: (seen.append(len(chunks)), run(chunks))[1]
        got = gen.generate(prompts, 6)
        plain = s.generate(prompts, 6)
        assert gen.slots.available == 1
    finally:
        s.close()
    assert got == plain
    assert set(seen) == {1}


def test_sampling_runs_with_a_seed_and_is_reproducible(pair):
    s = ManagedStack(pair[0], block_size=BS, draft_dir=pair[1])
    try:
        gen = SpeculativeGenerator(s.mgr, s.worker, s.draft, num_speculative_tokens=2)
        a = gen.generate({"a": _prompt(7, 2)}, 10, temperature=0.9, seed=3)
        b = gen.generate({"a": _prompt(7, 2)}, 10, temperature=0.9, seed=3)
    finally:
        s.close()
    assert a == b and len(a["a"]) == 10


def test_greedy_verify_accepts_the_matching_prefix():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 9]):
        logits[row, best] = 1.0
    assert greedy_verify([3, 5, 7], logits) == (3, [3, 5, 7, 9])
    assert greedy_verify([3, 4, 7], logits) == (1, [3, 5])
    assert greedy_verify([0, 5, 7], logits) == (0, [3])


def test_rejection_sampling_emits_the_target_distribution():
    """Whatever the draft distribution, the first emitted token is distributed as the
    target's (total variation within sampling noise), and so is the bonus token when every
    draft is accepted."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 5, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(1, 5, generator=g, dtype=torch.float64) * 2, -1)
    n = 20000
    first = torch.zeros(5, dtype=torch.float64)
    accepted = 0
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=g))
        a, out = rejection_sample([d], q, p, g)
        first[out[0]] += 1
        accepted += a
    tv = 0.5 * float((first / n - p[0]).abs().sum())
    assert tv < 0.02, (first / n, p[0])
    expected = float(torch.minimum(p[0], q[0]).sum())  # P(accept) = sum min(p, q)
    assert abs(accepted / n - expected) < 0.02
    # identical distributions: always accepted
    assert rejection_sample([2], p[:1], torch.cat([p[:1], p[1:]]), g)[0] == 1


def test_bad_inputs_are_named(pair, tmp_path):
    s = ManagedStack(pair[0], block_size=BS)
    try:
        with pytest.raises(ValueError, match="no 'draft' group"):
            SpeculativeGenerator(s.mgr, s.worker, None, num_speculative_tokens=2)
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            SpeculativeGenerator(s.mgr, s.worker, None, num_speculative_tokens=0)
    finally:
        s.close()
    from xllm_vmm.models.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match="not an MTP module"):
        MtpDraft.load(pair[0], None)
