"""One home for each formula: the checker, the planner and serving call the same function, so
their answers agree on every catalogue model (one source of truth, so they cannot drift)."""

from __future__ import annotations

import pytest

from xllm_vmm.config.loader import load
from xllm_vmm.config.rules import check
from xllm_vmm.kvcache.host_support import (
    host_block_bytes,
    host_pool_size,
    host_tier_unsupported_reason,
)
from xllm_vmm.models import cache_layout, catalogue_names, load_model_spec

NAMES = catalogue_names()


@pytest.mark.parametrize("name", NAMES)
def test_hk05_check_config_and_serving_agree(name):
    from xllm_vmm.kvcache import prefix_setup

    spec = load_model_spec(name)
    layout = cache_layout(spec, workers=1)
    ours = host_tier_unsupported_reason(layout, vision=spec.vision)
    assert ours == prefix_setup.host_tier_unsupported_reason(layout, vision=spec.vision)
    cfg = load(["--enable_vmm_kvcache", "--host_blocks_factor=2", f"--model={name}"])
    rep = check(cfg, spec)
    assert ("HK-05" in rep.rule_ids()) == (ours is not None)


@pytest.mark.parametrize("capacity, factor, block", [
    (1000, 2.5, 64), (8 << 30, 4, 1 << 20), (1000, 1.0, 64), (0, 3, 7), (12345, 1.01, 100),
])
def test_hk06_one_formula_for_planner_and_host_pool(capacity, factor, block):
    from xllm_vmm.kvcache.host_pool import host_pool_size as serving

    assert vars(host_pool_size(capacity, factor, block)) == vars(serving(capacity, factor, block))


def test_planner_host_pool_is_host_support_formula():
    from xllm_vmm.planner import PlanInputs, make_plan

    spec = load_model_spec("Qwen/Qwen3-8B")
    plan = make_plan(spec, PlanInputs(enable_vmm_kvcache=True, host_blocks_factor=2.5,
                                      max_cache_size=16 << 30, context_len=4096))
    w = plan.workers[0]
    layout = cache_layout(spec, workers=1)
    assert w.host_pool_bytes == host_pool_size(w.arena_bytes, 2.5, host_block_bytes(layout)).bytes


@pytest.mark.parametrize("kv, weights, elastic, quota", [
    (True, False, False, 0), (True, True, False, 40 << 30), (True, False, True, 0),
    (True, True, True, 30 << 30), (False, False, False, 0),
])
def test_planner_budget_is_the_pools_formula(kv, weights, elastic, quota):
    from xllm_vmm.planner import PlanInputs, make_plan
    from xllm_vmm.pool.budget import BudgetConfig, BudgetMode, budget_bytes

    inp = PlanInputs(enable_vmm_kvcache=kv, enable_vmm_weights=weights, vmm_elastic=elastic,
                     max_cache_size=quota, context_len=4096, execution_peak_bytes=1 << 30,
                     runtime_overhead_bytes=1 << 30, vmm_memory_reserve_bytes=1 << 29)
    w = make_plan(load_model_spec("Qwen/Qwen3-8B"), inp).workers[0]
    T, wt, P = inp.device_memory_bytes, w.weights_bytes, 1 << 30
    shared = kv and weights
    mode = BudgetMode.ELASTIC if elastic else BudgetMode.FIXED if kv else BudgetMode.PHYSICAL
    cfg = BudgetConfig(mode=mode, max_memory_utilization=0.0 if elastic else 0.8,
                       max_cache_size=quota, reserve_bytes=(1 << 29) if elastic else 0)
    free = T - wt - (1 << 30) if elastic else T - wt
    assert w.physical_budget_bytes == budget_bytes(cfg, total=T, free=free, execution_peak=P,
                                                   held=wt if shared else 0)
    # the pool's static capacity is the same formula, page-floored
    if not elastic and not shared:
        from xllm_vmm.pool.budget import static_capacity_bytes

        page = 2 << 20
        assert static_capacity_bytes(cfg, free, T, P, page) == \
            max(0, w.physical_budget_bytes) // page * page


@pytest.mark.parametrize("weights", [False, True])
def test_el06_check_config_and_plan_agree_at_the_boundary(weights):
    from xllm_vmm.planner import make_plan
    from xllm_vmm.planner.from_config import inputs_from_config

    spec = load_model_spec("Qwen/Qwen3-8B")
    base = ["--enable_vmm_kvcache", "--model=Qwen/Qwen3-8B"] + (
        ["--enable_vmm_weights"] if weights else [])
    cfg = load(base)
    layout = cache_layout(spec, workers=1)
    page = int(cfg["phy_page_granularity_size"])
    shared = -(-spec.served_weight_bytes // 1) if weights else 0
    least = layout.least_quota_bytes(page, shared)
    for quota, fires in ((least - 1, True), (least, False)):
        c = load(base + [f"--max_cache_size={quota}"])
        rule = "EL-06" in check(c, spec).rule_ids()
        plan = make_plan(spec, inputs_from_config(c, context_len=4096))
        planned = any(r.code == "EL-06" for r in plan.reasons)
        assert rule is fires and planned is fires, (quota, least)
