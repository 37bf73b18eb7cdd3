"""MTP hidden-state ("embedding") slots (AD-03) in ``plan``: ``max_seqs_per_batch`` slots of
``hidden x e`` bytes reserved outside the page pool, the KV budget lowered by exactly their
bytes, the figures in the JSON report; and the running engine (a tiny DeepSeek-V3 with an
MTP draft directory) holding exactly the slots and bytes ``plan`` counts, with the KV capacity
``plan`` gives."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from xllm_vmm.models import load_model_spec
from xllm_vmm.planner import PlanInputs, make_plan
from xllm_vmm.planner.report import plan_to_dict, render_table
from xllm_vmm.planner.sizing import mtp_embedding_bytes_per_seq

MiB = 1 << 20


def _formula(plan, name):
    return next(f.value for f in plan.formulas if f.figure == name)


@pytest.mark.parametrize("mode", ["physical", "fixed", "elastic"])
def test_plan_reserves_max_seqs_slots_of_hidden_bytes(mode):
    spec = load_model_spec("deepseek-ai/DeepSeek-V3")
    inp = PlanInputs(workers=16, device_name="h200", device_memory_bytes=143_156 * MiB,
                     enable_vmm_kvcache=mode != "physical", vmm_elastic=mode == "elastic",
                     num_speculative_tokens=2, max_seqs_per_batch=96, context_len=8192)
    p = make_plan(spec, inp)
    w = p.workers[0]
    m = 7168 * 2  # hidden 7,168 in bfloat16
    assert w.mtp_embedding_bytes_per_seq == m == mtp_embedding_bytes_per_seq(7168, "bfloat16")
    assert w.mtp_embedding_slots == 96 and w.mtp_embedding_bytes == 96 * m
    assert _formula(p, "KV budget B_kv") == w.physical_budget_bytes - 96 * m
    # the same plan without the slots' reservation gives back exactly their bytes
    no_spec = make_plan(spec, dataclasses.replace(inp, num_speculative_tokens=0))
    assert no_spec.workers[0].mtp_embedding_slots == 0
    assert no_spec.workers[0].mtp_embedding_bytes == 0
    assert _formula(no_spec, "KV budget B_kv") == no_spec.workers[0].physical_budget_bytes
    d = json.loads(json.dumps(plan_to_dict(p)))
    jw = d["per_worker"][0]
    assert (jw["mtp_embedding_slots"], jw["mtp_embedding_bytes_per_seq"],
            jw["mtp_embedding_bytes"]) == (96, m, 96 * m)
    text = io.StringIO()
    render_table(p, text)
    assert "MTP embedding slots (AD-03)" in text.getvalue() and "96 x" in text.getvalue()


def test_no_mtp_no_slots():
    spec = load_model_spec("Qwen/Qwen3-8B")  # no MTP layers, no draft directory
    p = make_plan(spec, PlanInputs(enable_vmm_kvcache=True, num_speculative_tokens=3,
                                   execution_peak_bytes=1 << 30))
    assert p.workers[0].mtp_embedding_slots == 0
    assert "DRAFT" in [r.code for r in p.reasons]


def test_running_engine_holds_the_slots_plan_counts(tmp_path):
    """plan and the running cache agree on every MTP figure: slots, bytes per slot, bytes in
    all, and the KV capacity plan gave after reserving them (fixed VMM: the cache maps the
    plan's capacity)."""
    pytest.importorskip("transformers")
    from tests.engine import checkpoints as C
    from xllm_vmm.bench.mtp_draft import untrained_mtp
    from xllm_vmm import LLM

    target = C.deepseek_v3_checkpoint(tmp_path / "target")
    draft = untrained_mtp(target, tmp_path / "draft")
    llm = LLM(str(target), draft_model=str(draft), speculative_algorithm="MTP",
              num_speculative_tokens=2, block_size=16, device_memory="96MiB",
              enable_vmm_kvcache=True, max_seqs_per_batch=7, max_tokens_per_batch=256)
    eng = llm.llm_engine
    try:
        w = eng.plan.workers[0]
        slots = eng.spec_slots
        hidden = json.loads((target / "config.json").read_text())["hidden_size"]
        assert w.mtp_embedding_slots == slots.capacity == 7
        assert w.mtp_embedding_bytes_per_seq == slots.bytes_per_seq == hidden * 4  # fp32
        assert w.mtp_embedding_bytes == slots.reserved_bytes
        assert eng.sizing["running"]["kv_capacity_tokens"] == w.kv_capacity_tokens
        assert _formula(eng.plan, "KV budget B_kv") == \
            w.physical_budget_bytes - slots.reserved_bytes
    finally:
        eng.shutdown()


def test_elastic_pool_budget_is_plans_kv_budget(tmp_path):
    """Elastic VMM with MTP: the running pool's live budget before any request is exactly
    plan's KV budget (B less the slots' M x m bytes): the pool keeps the slots' bytes
    outside it as plan does."""
    pytest.importorskip("transformers")
    from tests.engine import checkpoints as C
    from xllm_vmm.bench.mtp_draft import untrained_mtp
    from xllm_vmm import LLM

    target = C.deepseek_v3_checkpoint(tmp_path / "target")
    draft = untrained_mtp(target, tmp_path / "draft")
    llm = LLM(str(target), draft_model=str(draft), speculative_algorithm="MTP",
              num_speculative_tokens=2, block_size=16, device_memory="96MiB",
              enable_vmm_kvcache=True, vmm_elastic=True, max_seqs_per_batch=7,
              max_tokens_per_batch=256)
    eng = llm.llm_engine
    try:
        w = eng.plan.workers[0]
        slots = eng.spec_slots.reserved_bytes
        assert slots == w.mtp_embedding_bytes > 0
        assert eng.pool.budget.outside_bytes == slots
        assert eng.pool.stats().held_bytes == 0  # nothing mapped yet: the whole budget is left
        assert eng.pool.growth_left_bytes() == _formula(eng.plan, "KV budget B_kv") \
            == w.physical_budget_bytes - slots
    finally:
        eng.shutdown()
