"""Sizing arithmetic against hand-computed figures (bytes, blocks, slots, tokens), every mode."""

import dataclasses

import pytest

from xllm_vmm.models import load_model_spec
from xllm_vmm.planner import PlanInputs, make_plan
from xllm_vmm.planner.devices import DeviceError

GiB = 1 << 30
MiB = 1 << 20
T64 = 64 * GiB  # ascend-910b-64g
QWEN_W = 16_381_470_720  # Qwen3-8B weights, 2 B x 8,190,735,360 params
SLOT = 72 * 2 * MiB  # Qwen3-8B attn slot: one 2 MiB page in each of 72 tensors
BLOCK = 147_456 * 128  # Qwen3-8B block, all 72 tensors


@pytest.fixture(scope="module")
def qwen():
    return load_model_spec("Qwen/Qwen3-8B")


def base(**kw):
    kw.setdefault("execution_peak_bytes", GiB)
    return PlanInputs(**kw)


def test_physical_qwen3_8b(qwen):
    p = make_plan(qwen, base())
    w = p.workers[0]
    budget = 54_975_581_388 - QWEN_W - GiB  # floor(64 GiB x 0.8) - weights - peak
    assert w.physical_budget_bytes == budget == 37_520_368_844
    assert w.kv_capacity_blocks == budget // BLOCK == 1987
    assert w.kv_capacity_tokens == 1987 * 128
    assert w.max_concurrency == 1987 // 320 == 6  # 40,960 tokens = 320 blocks
    assert w.arena_bytes == 0 and w.elastic_min_bytes is None
    assert p.verdict == "fits" and p.mode == "physical"
    assert p.max_context_len == 1987 * 128


def test_fixed_vmm_qwen3_8b(qwen):
    p = make_plan(qwen, base(enable_vmm_kvcache=True))
    w = p.workers[0]
    slots = 37_520_368_844 // SLOT
    assert slots == 248
    assert w.kv_capacity_blocks == 248 * 8 and w.kv_capacity_tokens == 253_952
    assert w.arena_bytes == w.kv_pool_bytes == 248 * SLOT
    assert w.max_concurrency == 248 // 40 == 6
    assert w.groups[0].blocks_per_page == 8 and w.groups[0].slot_bytes == SLOT
    assert p.mode == "fixed_vmm"


def test_elastic_vmm_ignores_utilization(qwen):
    inp = base(enable_vmm_kvcache=True, vmm_elastic=True, vmm_memory_reserve_bytes=GiB,
               max_memory_utilization=0.5)
    p = make_plan(qwen, inp)
    w = p.workers[0]
    free = T64 - QWEN_W - GiB  # runtime overhead default 1 GiB
    budget = free - GiB - GiB  # - execution peak - reserve
    assert w.physical_budget_bytes == budget == 49_116_780_544
    assert w.kv_capacity_tokens == (budget // SLOT) * 8 * 128 == 325 * 1024
    assert w.elastic_min_bytes == SLOT
    assert w.elastic_max_bytes == 325 * SLOT
    assert w.arena_bytes == ((T64 - QWEN_W) // SLOT) * SLOT == 346 * SLOT
    assert w.runtime_overhead_bytes == GiB
    same = make_plan(qwen, dataclasses.replace(inp, max_memory_utilization=0.9))
    assert same.workers[0].physical_budget_bytes == budget
    other = make_plan(qwen, dataclasses.replace(inp, runtime_overhead_bytes=0))
    assert other.workers[0].physical_budget_bytes == budget + GiB


def test_quota_caps_every_mode(qwen):
    for kw in ({}, {"enable_vmm_kvcache": True},
               {"enable_vmm_kvcache": True, "vmm_elastic": True}):
        w = make_plan(qwen, base(max_cache_size=10 * GiB, **kw)).workers[0]
        assert w.physical_budget_bytes == 10 * GiB
    w = make_plan(qwen, base(max_cache_size=10 * GiB, enable_vmm_kvcache=True)).workers[0]
    assert w.kv_capacity_tokens == (10 * GiB // SLOT) * 1024 == 71 * 1024


def test_shared_pool_quota_includes_weights(qwen):
    inp = base(enable_vmm_kvcache=True, enable_vmm_weights=True, vmm_elastic=True,
               max_cache_size=20 * GiB)
    w = make_plan(qwen, inp).workers[0]
    q = 20 * GiB - QWEN_W
    assert w.physical_budget_bytes == q == 5_093_365_760
    assert w.arena_bytes == (q // SLOT) * SLOT + QWEN_W
    bad = make_plan(qwen, dataclasses.replace(inp, max_cache_size=10 * GiB))
    assert bad.verdict == "does_not_fit"
    assert [r.code for r in bad.reasons if r.severity == "error"][0] == "QUOTA"


def test_el06_quota_below_one_slot(qwen):
    p = make_plan(qwen, base(enable_vmm_kvcache=True, max_cache_size=100 * MiB))
    el06 = [r for r in p.reasons if r.code == "EL-06"]
    assert el06 and "150,994,944" in el06[0].message and p.verdict == "does_not_fit"
    assert "at least 150,994,944" in el06[0].hint


def test_context_that_does_not_fit_gives_exact_largest(qwen):
    inp = base(device_memory_bytes=40_536 * MiB, context_len=300_000)  # a100-40g
    p = make_plan(qwen, inp)
    budget = int(40_536 * MiB * 0.8) - QWEN_W - GiB
    n = budget // BLOCK
    assert p.verdict == "does_not_fit" and p.workers[0].max_concurrency == 0
    assert p.max_context_len == n * 128 == 112_128
    ctx = [r for r in p.reasons if r.code == "CONTEXT"][0]
    assert "one request of 300,000 tokens" in ctx.message
    assert "at most 112,128" in ctx.hint
    assert make_plan(qwen, dataclasses.replace(inp, context_len=112_128)).fits
    assert not make_plan(qwen, dataclasses.replace(inp, context_len=112_129)).fits


def test_weights_do_not_fit_suggests_workers():
    spec = load_model_spec("deepseek-ai/DeepSeek-V3")
    p = make_plan(spec, PlanInputs(workers=8))
    assert p.verdict == "does_not_fit"
    assert p.reasons[0].code == "MEMORY" and "weights" in p.reasons[0].message
    assert p.suggested_workers == 16
    assert make_plan(spec, PlanInputs(workers=16)).fits


def test_tensor_parallel_split(qwen):
    p = make_plan(qwen, base(workers=2, enable_vmm_kvcache=True))
    w = p.workers[0]
    assert len(p.workers) == 2 and w.weights_bytes == QWEN_W // 2
    assert w.groups[0].tensor_bytes_per_token == 1024 and w.groups[0].blocks_per_page == 16
    budget = 54_975_581_388 - QWEN_W // 2 - GiB
    assert w.kv_capacity_blocks == (budget // SLOT) * 16


def test_mla_replicated_index_and_mtp_draft():
    spec = load_model_spec("deepseek-ai/DeepSeek-V3.2-Exp")
    p = make_plan(spec, PlanInputs(workers=16, device_name="h200",
                                   device_memory_bytes=143_156 * MiB, enable_vmm_kvcache=True,
                                   num_speculative_tokens=1))
    names = [g.name for g in p.workers[0].groups]
    assert names == ["mla", "index", "draft", "draft_index"]
    mla = p.workers[0].groups[0]
    assert mla.tensor_bytes_per_token == 1152 and mla.blocks_per_page == 2097152 // (1152 * 128)
    assert p.workers[0].weights_bytes == -(-spec.served_weight_bytes // 16) + \
        -(-spec.mtp_weight_bytes // 16)


def test_glm_mtp_draft_group_and_weights():
    spec = load_model_spec("zai-org/GLM-4.5-Air")
    inp = PlanInputs(workers=4, enable_vmm_kvcache=True, num_speculative_tokens=3,
                     context_len=8192)
    p = make_plan(spec, inp)
    draft = [g for g in p.workers[0].groups if g.name == "draft"][0]
    assert draft.tensors == 2 and draft.bytes_per_token == 1024  # 2 heads x 128 x 2 B x 2
    without = make_plan(spec, dataclasses.replace(inp, num_speculative_tokens=0))
    assert [g.name for g in without.workers[0].groups] == ["attn"]
    assert p.workers[0].weights_bytes - without.workers[0].weights_bytes == \
        -(-spec.mtp_weight_bytes // 4)


def test_hybrid_state_slots_are_exact():
    spec = load_model_spec("Qwen/Qwen3-Next-80B-A3B-Instruct")
    p = make_plan(spec, PlanInputs(workers=4, device_memory_bytes=143_156 * MiB,
                                   enable_vmm_kvcache=True, vmm_elastic=True))
    w = p.workers[0]
    r = 39_518_208 // 4
    assert w.resident_bytes_per_seq == r
    slot = 24 * 2 * MiB  # 24 tensors; 1 KV head/worker x 256 x 2 B = 512 B/token
    per_seq_slots = 262_144 // 128 // 32  # 2048 blocks, 32 per page
    budget = w.physical_budget_bytes
    s = min(200, max(c for c in range(0, 400) if c * (per_seq_slots * slot + r) <= budget))
    assert w.resident_slots == s and w.resident_bytes == s * r
    assert w.max_concurrency == s


def test_sliding_window_blocks():
    spec = load_model_spec("openai/gpt-oss-20b")
    p = make_plan(spec, PlanInputs(workers=1, max_seqs_per_batch=100, context_len=4096,
                                   execution_peak_bytes=GiB))
    groups = {g.name: g for g in p.workers[0].groups}
    # physical: a unit is one block; 100 sequences x 2 blocks (window 128 spans <= 2 blocks),
    # plus the prefill chunk in flight: min(10240, 4096) = 4096 tokens after the 127 before it
    # span min(32, ceil((127 + 4096 + 127) / 128) = 34) = 32 blocks, 30 beyond the window
    assert groups["sliding"].blocks == 200 + 30
    w = p.workers[0]
    rest = w.physical_budget_bytes - 230 * groups["sliding"].block_bytes
    assert groups["attn"].blocks == rest // groups["attn"].block_bytes == w.kv_capacity_blocks


def test_sliding_window_prefill_chunk_sizes():
    spec = load_model_spec("openai/gpt-oss-20b")
    base_inp = PlanInputs(workers=1, max_seqs_per_batch=100, context_len=4096,
                          execution_peak_bytes=GiB)

    def sliding(**kw):
        p = make_plan(spec, dataclasses.replace(base_inp, **kw))
        return {g.name: g for g in p.workers[0].groups}["sliding"].blocks

    # a 256-token chunk: 127 + 256 tokens span ceil((383 + 127) / 128) = 4 blocks, 2 extra
    assert sliding(max_tokens_per_batch=256) == 200 + 2
    # a 1-token chunk (pure decode) needs nothing beyond the window
    assert sliding(max_tokens_per_batch=1) == 200
    # without chunked prefill the whole 4096-token prompt is resident while it prefills
    assert sliding(enable_chunked_prefill=False, max_tokens_per_batch=256) == 200 + 30


def test_host_pool_and_hk07(qwen):
    inp = base(enable_vmm_kvcache=True, host_blocks_factor=2.0, workers=2,
               host_memory_bytes=64 * GiB)
    p = make_plan(qwen, inp)
    w = p.workers[0]
    assert w.host_pool_bytes == 2 * w.arena_bytes
    hk = [r for r in p.reasons if r.code == "HK-07"]
    assert hk and hk[0].severity == "warning" and p.fits
    assert f"{2 * w.host_pool_bytes:,}" in hk[0].message
    off = make_plan(qwen, dataclasses.replace(inp, enable_prefix_cache=False))
    assert off.workers[0].host_pool_bytes == 0
    assert make_plan(qwen, dataclasses.replace(inp, host_blocks_factor=1.0)).workers[0] \
        .host_pool_bytes == 0


def test_default_execution_peak_formula(qwen):
    p = make_plan(qwen, PlanInputs())
    assert p.workers[0].execution_peak_bytes == \
        10_240 * 2 * (4 * 4096 + 2 * 12_288) + 200 * 151_936 * 4 == 960_409_600


@pytest.mark.parametrize("field,value", [
    ("workers", 0), ("device_memory_bytes", 0), ("context_len", 0), ("max_cache_size", -1),
    ("vmm_memory_reserve_bytes", -5), ("host_blocks_factor", -1.0),
    ("max_memory_utilization", 1.5), ("max_memory_utilization", 0.0),
])
def test_impossible_inputs_are_errors(qwen, field, value):
    with pytest.raises(DeviceError) as err:
        make_plan(qwen, PlanInputs(**{field: value}))
    assert "must be" in str(err.value)


def test_elastic_accepts_zero_utilization(qwen):
    assert make_plan(qwen, PlanInputs(enable_vmm_kvcache=True, vmm_elastic=True,
                                      max_memory_utilization=0.0)).fits
