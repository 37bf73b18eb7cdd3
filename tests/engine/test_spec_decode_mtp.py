"""A distilled MTP draft proposes well: acceptance measured >= 0.5 on fresh prompts, the
output still identical to greedy decoding without speculation, in fewer target passes.

The target is a tiny DeepSeek-V3 whose residual branches are scaled down (``branch_scale``),
so its next token depends mostly on the current one — a model a one-layer draft can learn in a
few hundred CPU steps; the draft is distilled in the test setup (``xllm_vmm/bench/mtp_draft.py``)
and exported in the engine's MTP directory format."""

from __future__ import annotations

import pytest
import torch

from tests.engine import checkpoints as C
from tests.engine.managed_stack import ManagedStack
from xllm_vmm.bench.mtp_draft import distill_mtp
from xllm_vmm.engine.spec_decode import SpeculativeGenerator

STEPS = 150


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_distill")
    target = C.deepseek_v3_checkpoint(root / "target", branch_scale=0.03)
    draft, losses = distill_mtp(target, root / "draft", steps=STEPS, sequences=48, batch=16,
                                gen_len=26)
    return target, draft, losses


def test_distilled_draft_is_accepted_and_the_output_unchanged(distilled):
    target, draft, losses = distilled
    assert len(losses) == STEPS and losses[-1] < 0.8 * losses[0]
    g = torch.Generator().manual_seed(77)
    prompts = {f"r{i}": torch.randint(4, 384, (6,), generator=g).tolist() for i in range(6)}
    s = ManagedStack(target, block_size=16, draft_dir=draft)
    try:
        gen = SpeculativeGenerator(s.mgr, s.worker, s.draft, num_speculative_tokens=2)
        got = gen.generate(prompts, 30)
        s.steps.clear()
        plain = s.generate(prompts, 30)
        plain_steps = len(s.steps)
    finally:
        s.close()
    assert got == plain
    st = gen.stats
    print("MTP acceptance", st.acceptance_rate, "per position", st.acceptance_per_pos,
          "tokens per target pass", st.mean_accepted_length)
    assert st.acceptance_per_pos[0] >= 0.5
    assert st.acceptance_rate >= 0.5
    assert st.mean_accepted_length >= 2.0  # tokens per verify pass, K = 2
    assert st.target_steps < 0.7 * plain_steps  # the speed-up: fewer target passes


def test_distilled_draft_in_the_engine(distilled):
    """The same distilled draft through LLMEngine's continuous batching (MtpSpeculator):
    acceptance >= 0.5 from stats()["spec_decode"], the output that of the engine without
    speculation, in fewer engine steps (target passes)."""
    from xllm_vmm import LLM, SamplingParams

    target, draft, _ = distilled
    g = torch.Generator().manual_seed(78)
    prompts = [torch.randint(4, 384, (6,), generator=g).tolist() for _ in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(block_size=16, device_memory="96MiB", enable_vmm_kvcache=True, vmm_elastic=True)
    outs, steps = {}, {}
    for key, extra in (("spec", dict(draft_model=str(draft), speculative_algorithm="MTP",
                                     num_speculative_tokens=2)), ("plain", {})):
        llm = LLM(str(target), **kw, **extra)
        try:
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
            outs[key] = [list(o.outputs[0].token_ids) for o in res]
            steps[key] = llm.llm_engine.num_steps
            if key == "spec":
                sd = llm.llm_engine.stats()["spec_decode"]
        finally:
            llm.llm_engine.shutdown()
    assert outs["spec"] == outs["plain"]
    rate = sd["num_accepted_tokens"] / sd["num_draft_tokens"]
    first = sd["num_accepted_tokens_per_pos"][0] / sd["num_drafts"]
    print("engine MTP acceptance", rate, "position 1", first)
    assert rate >= 0.5 and first >= 0.5
    assert steps["spec"] < 0.7 * steps["plain"]
