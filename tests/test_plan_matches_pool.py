"""The dry-run plan and the real pool agree: the slots that `plan` says each cache group gets
map in a fixed VMM pool on a device of the same size holding the same weights, execution peak
and resident state — and one slot more does not. A plan that promised capacity the cache cannot
map (or left a whole slot unused) would send operators to production with the wrong numbers."""

from __future__ import annotations

import pytest

from xllm_vmm.kvcache import VirtualKVCache
from xllm_vmm.models import cache_layout, load_model_spec
from xllm_vmm.planner import PlanInputs, make_plan
from xllm_vmm.planner.report import plan_to_dict
from xllm_vmm.pool import BudgetConfig, PoolCapacityError, VmmPool
from xllm_vmm.pool.budget import BudgetMode
from xllm_vmm.vmm.sim import SimDriver

GiB = 1 << 30


def _fixed_pool(device: int, worker: dict) -> VmmPool:
    drv = SimDriver(device)
    drv.set_external_use(worker["weights_bytes"] + worker["runtime_overhead_bytes"]
                         + worker["resident_bytes"])
    budget = BudgetConfig(mode=BudgetMode.FIXED, execution_peak_bytes=worker["execution_peak_bytes"])
    return VmmPool(drv, budget, 2 * device)


@pytest.mark.parametrize("model, workers", [
    ("Qwen/Qwen3-8B", 1),                       # dense GQA
    ("Qwen/Qwen3-32B", 2),                      # KV heads split across workers
    ("openai/gpt-oss-20b", 1),                  # sliding-window group beside full attention
    ("deepseek-ai/DeepSeek-V3.2-Exp", 16),      # MLA latent + index cache, replicated
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 4),    # hybrid: resident state outside the pool
])
def test_planned_slots_map_and_one_more_does_not(model, workers):
    device = 64 * GiB
    spec = load_model_spec(model)
    plan = plan_to_dict(make_plan(spec, PlanInputs(
        workers=workers, device_memory_bytes=device, enable_vmm_kvcache=True)))
    worker = plan["per_worker"][0]
    units = {g["name"]: g["units"] for g in worker["groups"]}
    assert all(n > 0 for n in units.values())
    layout = cache_layout(spec, workers=workers)

    pool = _fixed_pool(device, worker)
    cache = VirtualKVCache(pool, layout, units)
    assert pool.stats().mapped_bytes == worker["kv_pool_bytes"]
    # Every planned block can be allocated (fixed mode maps nothing more), and not one more.
    bps = {n: g.blocks_per_slot for n, g in cache.capacity().groups.items()}
    want = {n: units[n] * bps[n] for n in units}
    assert sum(len(b) for b in (cache.allocate(want) or {}).values()) == sum(want.values())
    assert cache.allocate({next(iter(units)): 1}) is None
    pool.close()

    # The plan leaves less than one slot of any group unused: one more slot does not map.
    for name in units:
        more = dict(units, **{name: units[name] + 1})
        pool = _fixed_pool(device, worker)
        with pytest.raises(PoolCapacityError, match="fixed budget allows"):
            VirtualKVCache(pool, layout, more)
        pool.close()
