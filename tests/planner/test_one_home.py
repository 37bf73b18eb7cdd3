"""One home for each formula: the checker, the planner and serving call the same function, so
their answers agree on every catalogue model (issue 9: they had drifted)."""

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
