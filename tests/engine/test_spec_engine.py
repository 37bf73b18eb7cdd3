"""MTP speculative decoding inside LLMEngine's continuous batching: greedy output
token for token identical to the engine without speculation (and to transformers) with batches,
prefix hits, chunked prefill and preemption; rejected drafts' blocks returned at once; the
``spec_decode`` statistics; the hidden-state slots admission counts; sampling (temperature,
top-k, top-p, min-p) distributed as the target's, by a chi-square test with fixed seeds;
refusals at engine start."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine import checkpoints as C
from xllm_vmm.bench.mtp_draft import untrained_mtp
from xllm_vmm import LLM, SamplingParams
from xllm_vmm.config import ConfigError

BS = 16
K = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_engine")
    target = C.deepseek_v3_checkpoint(root / "target")
    draft = untrained_mtp(target, root / "draft")
    return target, draft, C.load_hf_model(target)


def make(target, draft=None, k=K, **kw):
    kw.setdefault("block_size", BS)
    kw.setdefault("device_memory", "96MiB")
    kw.setdefault("max_tokens_per_batch", 512)
    if draft is not None:
        kw.update(draft_model=str(draft), speculative_algorithm="MTP", num_speculative_tokens=k)
    return LLM(str(target), **kw)


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_greedy_identical_with_batches_prefix_hits_and_chunked_prefill(pair):
    """Elastic virtual KV, prefix cache, prompts longer than the token budget (chunked prefill
    beside speculative decodes in one step), then a second wave sharing whole blocks."""
    target, draft, hf = pair
    first = [C.random_prompt(n, 3) for n in (5, 2 * BS + 7, 1, 40)]
    second = [p[:2 * BS] + C.random_prompt(3, 9) for p in first if len(p) > 2 * BS]
    flags = dict(enable_vmm_kvcache=True, vmm_elastic=True, enable_prefix_cache=True,
                 max_tokens_per_batch=24)
    got, want = {}, {}
    for key, d in (("spec", draft), ("plain", None)):
        llm = make(target, d, **flags)
        try:
            a = run(llm, first, GREEDY)
            b = run(llm, second, GREEDY)
            st = llm.llm_engine.stats()
            assert st["prefix_cache_hits"] >= 2 * 2 * BS
            assert st["kv_live_blocks"] == 0
            if d is not None:
                sd = st["spec_decode"]
                assert sd["num_drafts"] > 0
                assert sd["num_draft_tokens"] <= K * sd["num_drafts"]
                assert llm.llm_engine.spec_slots.available == llm.llm_engine.spec_slots.capacity
            else:
                assert "spec_decode" not in st
        finally:
            llm.llm_engine.shutdown()
        got[key], want[key] = a, b
    assert got["spec"] == got["plain"]
    assert want["spec"] == want["plain"]
    for p, out in zip(first[:2], got["spec"][:2]):
        assert out == C.hf_greedy(hf, p, GREEDY.max_tokens)


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    """A latent of 2,048 values per token: one 2 MiB page per cache tensor holds 256 tokens."""
    root = tmp_path_factory.mktemp("spec_engine_wide")
    target = C.deepseek_v3_checkpoint(root / "target", kv_lora_rank=2040)
    return target, untrained_mtp(target, root / "draft")


ONE_PAGE_EACH = 3 * 2 * 1024 * 1024  # 2 target layers + the draft layer, one page each
SEQS = 8  # max_seqs_per_batch of the preemption test: its MTP hidden-state slots come first


def _mtp_slots_bytes(target) -> int:
    """What plan reserves for the MTP hidden-state slots (AD-03) before the KV cache."""
    import json

    from xllm_vmm.planner.sizing import mtp_embedding_bytes_per_seq

    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    return SEQS * mtp_embedding_bytes_per_seq(hidden, "float32")


def test_greedy_identical_under_preemption(wide_pair):
    """A pool of one page per tensor (256 tokens) for six sequences of 54 tokens: requests
    are preempted (recomputed, the draft's cache too) and the output is still the target's."""
    target, draft = wide_pair
    prompts = [C.random_prompt(n, 5) for n in (30, 28, 31, 29, 27, 30)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, pre = {}, {}
    for key, d in (("spec", draft), ("plain", None)):
        llm = make(target, d, enable_vmm_kvcache=True, vmm_elastic=True,
                   max_cache_size=(ONE_PAGE_EACH + _mtp_slots_bytes(target) if d is not None
                                   else 2 * 2 * 1024 * 1024), max_seqs_per_batch=SEQS,
                   enable_prefix_cache=False)
        try:
            outs[key] = run(llm, prompts, params)
            pre[key] = llm.llm_engine.stats()["num_preemptions"]
        finally:
            llm.llm_engine.shutdown()
    assert pre["spec"] > 0
    assert outs["spec"] == outs["plain"]


def test_rejected_drafts_blocks_go_back_at_once(pair):
    """After every verification the request's tables cover exactly its computed tokens
    (``mgr.truncate``); the draft then grows them for its proposals and the next verify."""
    target, draft, _ = pair
    llm = make(target, draft, block_size=8, k=3)
    eng = llm.llm_engine
    mgr = eng.kv_cache_manager
    if not hasattr(mgr, "truncate"):
        pytest.skip("KVCacheManager.truncate has not landed")
    sched = eng.scheduler
    update = sched.update
    seen = []

    def checked(out, *a, **kw):
        res = update(out, *a, **kw)
        for c in out.chunks:
            r = c.request
            if c.spec_token_ids and r.request_id in sched.requests:
                tabs = mgr.block_tables(r.request_id)
                need = -(-r.num_computed_tokens // 8)
                seen.append(all(len(t) == need for t in tabs.values()))
        return res

    sched.update = checked
    try:
        prompts = [C.random_prompt(n, 7) for n in (5, 11, 3, 17)]
        out = run(llm, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        released = sched.released_spec_blocks
        live = eng.stats()["kv_live_blocks"]
    finally:
        eng.shutdown()
    assert all(len(o) == 16 for o in out)
    assert seen and all(seen)
    assert released > 0  # an untrained draft is rejected: some windows crossed a block
    assert live == 0


def test_statistics_follow_the_contract(pair):
    target, draft, _ = pair
    llm = make(target, draft, k=2)
    try:
        run(llm, [C.random_prompt(6, 1), C.random_prompt(9, 2)],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        sd = llm.llm_engine.stats()["spec_decode"]
    finally:
        llm.llm_engine.shutdown()
    assert set(sd) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                       "num_accepted_tokens_per_pos"}
    assert len(sd["num_accepted_tokens_per_pos"]) == 2
    assert sum(sd["num_accepted_tokens_per_pos"]) == sd["num_accepted_tokens"]
    assert sd["num_accepted_tokens_per_pos"] == sorted(sd["num_accepted_tokens_per_pos"],
                                                       reverse=True)
    # 2 requests x 7 verified decodes each, capped by the tokens left (the last has 1 draft)
    assert sd["num_drafts"] == 2 * 6
    assert sd["num_draft_tokens"] == 2 * (5 * 2 + 1)
    assert 0 <= sd["num_accepted_tokens"] <= sd["num_draft_tokens"]


def test_hidden_state_slots_are_counted_by_admission(pair):
    """Each running request holds one MTP hidden-state slot; with none left a fresh request
    is "not now" (it waits), and every slot is back after the run."""
    target, draft, _ = pair
    llm = make(target, draft)
    eng = llm.llm_engine
    try:
        slots = eng.spec_slots
        assert slots.bytes_per_seq == 64 * 4  # one fp32 hidden vector per sequence
        held = [slots.acquire() for _ in range(slots.capacity - 1)]  # one slot left
        peak = []
        step = eng.step

        def counted():
            res = step()
            peak.append(eng.num_running)
            return res

        eng.step = counted
        out = run(llm, [C.random_prompt(n, 4) for n in (4, 6, 8)],
                  SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        for s in held:
            slots.release(s)
    finally:
        eng.shutdown()
    assert all(len(o) == 5 for o in out)
    assert max(peak) == 1  # one slot: one sequence at a time
    assert slots.available == slots.capacity


# -- sampling: the output distribution is the target's -------------------------------------
def _chi2_threshold(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.719: p = 1e-4."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def _target_joint(hf, prompt, params):
    """Exact P(t1, t2) of sampling the target with ``params`` (the sampler's processing)."""
    from xllm_vmm.engine.sampler import Sampler

    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].float()
    p1 = Sampler.probabilities(logits.unsqueeze(0), [params])[0].double()
    joint = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        with torch.no_grad():
            l2 = hf(torch.tensor([prompt + [t1]])).logits[0, -1].float()
        p2 = Sampler.probabilities(l2.unsqueeze(0), [params])[0].double()
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


@pytest.mark.parametrize("knobs", [dict(top_k=3), dict(top_p=0.9, min_p=0.1),
                                   dict(top_k=4, top_p=0.9, temperature=1.5)],
                         ids=["top_k", "top_p+min_p", "all"])
def test_sampling_is_distributed_as_the_target(pair, knobs):
    """400 seeded samples of (t1, t2) — t2 comes from verification (a draft accepted by the
    rejection rule or the residual resample) — fit the target's exact joint distribution
    (chi-square, p = 1e-4 threshold; fixed seeds make the test deterministic)."""
    target, draft, hf = pair
    prompt = C.random_prompt(7, 11)
    kw = dict(temperature=1.0) | knobs
    n = 400
    params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=1234 + i, **kw)
              for i in range(n)]
    llm = make(target, draft, k=1, max_seqs_per_batch=200)
    try:
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
        sd = llm.llm_engine.stats()["spec_decode"]
    finally:
        llm.llm_engine.shutdown()
    # every sample verified a draft for its second token (one whose prefill chunk stopped a
    # token short of the prompt's end also for its first)
    assert sd["num_drafts"] >= n
    # the untrained draft's proposals lie mostly outside the target's support: this run
    # checks the residual resample (test_verification_... below checks acceptance too)
    assert sd["num_accepted_tokens"] < sd["num_draft_tokens"]
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    joint = _target_joint(hf, prompt, SamplingParams(**kw))
    assert all(p in joint for p in pairs), "a token outside the processed support"
    # cells with expected count >= 5; the rest pooled
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * n >= 5]
    obs = [sum(p == c for p in pairs) for c in big]
    exp = [joint[c] * n for c in big]
    rest_e = n - sum(exp)
    if rest_e >= 5:
        obs.append(n - sum(obs))
        exp.append(rest_e)
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(exp) - 1
    assert df >= 2
    assert chi2 < _chi2_threshold(df), (chi2, df, obs, exp)


@pytest.mark.parametrize("knobs", [dict(top_k=5), dict(top_p=0.85, min_p=0.08),
                                   dict(top_k=6, top_p=0.95, min_p=0.02, temperature=0.8)],
                         ids=["top_k", "top_p+min_p", "all"])
def test_verification_keeps_the_processed_target_distribution(knobs):
    """The engine's verification (``MtpSpeculator.sample``) over a tiny vocabulary (8), a
    draft close to the target (so drafts are accepted and rejected): the first emitted token
    is distributed as the target's processed distribution at the first position, the second
    (given the first draft accepted) as the one at the second; chi-square, fixed seeds."""
    from types import SimpleNamespace

    from xllm_vmm.engine.request import Request
    from xllm_vmm.engine.scheduler import ScheduledChunk, SchedulerOutput
    from xllm_vmm.engine.sampler import Sampler
    from xllm_vmm.engine.spec_decode.speculator import MtpSpeculator
    from xllm_vmm.engine.step import SeqChunk, StepInput, StepOutput

    g = torch.Generator().manual_seed(5)
    vocab, k, n = 8, 2, 3000
    target = torch.randn(k + 1, vocab, generator=g)
    draft = target[:k] + 0.8 * torch.randn(k, vocab, generator=g)
    kw = dict(temperature=1.0) | knobs
    spec = MtpSpeculator(SimpleNamespace(group_names=("mla", "draft"), block_size=16), None,
                         num_speculative_tokens=k, max_model_len=64, seed=0)
    p = Sampler.probabilities(target, [SamplingParams(**kw)] * (k + 1)).double()
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for i in range(n):
        req = Request(f"r{i}", [5, 6], SamplingParams(max_tokens=8, seed=i, **kw))
        picks = [spec._pick(req, draft[j]) for j in range(k)]
        req.spec_token_ids = [t for t, _ in picks]
        req.spec_draft_probs = torch.stack([q for _, q in picks])
        chunk = ScheduledChunk(req, 1, 1, True, list(req.spec_token_ids))
        step = StepInput.build([SeqChunk(req.request_id, [6, *req.spec_token_ids], 1,
                                         {"mla": [0]}, True)], 16)
        toks, _ = spec.sample(SchedulerOutput([chunk], step), StepOutput(logits=target), None)
        emitted = toks[0]
        first[emitted[0]] += 1
        if emitted[0] == req.spec_token_ids[0]:  # the first draft was accepted
            second[emitted[1]] += 1
    st = spec.stats
    assert 0.2 < st.num_accepted_tokens / st.num_draft_tokens < 0.95  # both branches ran
    for obs, dist in ((first, p[0]), (second, p[1])):
        m = float(obs.sum())
        assert bool((obs[dist == 0] == 0).all()), "a token outside the processed support"
        keep = dist * m >= 5
        e, o = dist[keep] * m, obs[keep].double()
        if float(m - e.sum()) >= 5:
            e, o = torch.cat([e, (m - e.sum()).reshape(1)]), torch.cat([o, (m - o.sum()).reshape(1)])
        chi2 = float(((o - e) ** 2 / e).sum())
        assert chi2 < _chi2_threshold(len(e) - 1), (chi2, o.tolist(), e.tolist())


def test_greedy_and_sampled_requests_mix_in_one_batch(pair):
    """Speculating and plain requests (penalties) in one batch: greedy ones keep their
    output, a penalised one decodes without drafts."""
    target, draft, _ = pair
    prompts = [C.random_prompt(n, 8) for n in (4, 9)]
    pen = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    res = {}
    for key, d in (("spec", draft), ("plain", None)):
        llm = make(target, d)
        sched = llm.llm_engine.scheduler
        update, verified = sched.update, []

        def seen(out, *a, **kw):
            verified.extend(c.request.params.has_penalties for c in out.chunks
                            if c.spec_token_ids)
            return update(out, *a, **kw)

        sched.update = seen
        try:
            outs = llm.generate([{"prompt_token_ids": prompts[0]},
                                 {"prompt_token_ids": prompts[1]}], [GREEDY, pen])
            res[key] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.llm_engine.shutdown()
        if d is not None:
            assert verified and not any(verified)  # drafts for the greedy request only
    assert res["spec"] == res["plain"]


# -- refusals at engine start ---------------------------------------------------------------
def test_refused_at_engine_start(pair, tmp_path):
    target, draft, _ = pair
    cases = [
        (dict(speculative_algorithm="Eagle3", num_speculative_tokens=2,
              enable_vmm_kvcache=True), "SD-02"),
        (dict(speculative_algorithm="MTP", draft_model=str(draft), num_speculative_tokens=2,
              enable_vmm_kvcache=True, enable_disagg_pd=True), "SD-03"),
        (dict(speculative_algorithm="MTP", num_speculative_tokens=2), "SD-05"),
        (dict(speculative_algorithm="Suffix", num_speculative_tokens=2), "MTP"),
        (dict(speculative_algorithm="MTP", draft_model=str(target), num_speculative_tokens=2),
         "draft_model"),
    ]
    for flags, needle in cases:
        with pytest.raises(ConfigError) as e:
            make(target, **flags)
        assert needle in str(e.value), (flags, str(e.value))


def test_sleep_wake_and_fork_keep_speculating(pair):
    """Weights in the pool: light and deep sleep release the KV cache of both groups, the
    output after wake-up is the same; a fork gets its own draft and counters."""
    target, draft, _ = pair
    llm = make(target, draft, enable_vmm_kvcache=True, vmm_elastic=True,
               enable_vmm_weights=True, enable_prefix_cache=True)
    eng = llm.llm_engine
    prompts = [C.random_prompt(n, 2) for n in (5, 20, 40)]
    try:
        first = run(llm, prompts, GREEDY)
        for level in (1, 2):
            eng.sleep(level)
            eng.wake_up()
            assert run(llm, prompts, GREEDY) == first, level
        child = eng.fork()
        assert child.stats()["spec_decode"]["num_drafts"] == 0
        assert eng.stats()["spec_decode"]["num_drafts"] > 0
    finally:
        eng.shutdown()


def test_prompt_logprobs_with_speculation_equal_the_plain_engine(pair):
    """prompt_logprobs are gathered on the speculative step path too (chunked prefill beside
    verify chunks): the same positions, token ids and values as the engine without a draft."""
    target, draft, _ = pair
    prompts = [C.random_prompt(n, 5) for n in (9, 30)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    got = {}
    for key, d in (("spec", draft), ("plain", None)):
        llm = make(target, d, enable_prefix_cache=False, max_tokens_per_batch=24)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        finally:
            llm.llm_engine.shutdown()
        got[key] = [o.prompt_logprobs for o in outs]
    for p, spec_lps, plain_lps in zip(prompts, got["spec"], got["plain"]):
        assert spec_lps is not None and len(spec_lps) == len(p)
        assert spec_lps[0] is None
        for pos in range(1, len(p)):
            a, b = spec_lps[pos], plain_lps[pos]
            assert p[pos] in a and set(a) == set(b)
            for tid in a:
                assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-4)
