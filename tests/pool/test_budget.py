"""BudgetConfig validation and the static (physical / fixed) capacity formula."""

from __future__ import annotations

import pytest

from xllm_vmm.pool import BudgetConfig, BudgetConfigError, BudgetMode, ExecutionPeak
from xllm_vmm.pool import static_capacity_bytes

MiB = 1 << 20


@pytest.mark.parametrize("mode", ["physical", "fixed"])
@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_ratio_outside_0_1_is_refused_for_physical_and_fixed(mode, ratio):
    with pytest.raises(BudgetConfigError, match=rf"max_memory_utilization={ratio} is outside "
                                                r"\(0, 1\] \(EL-03\)"):
        BudgetConfig(mode=mode, max_memory_utilization=ratio)


def test_elastic_accepts_zero_ratio_but_not_outside_0_1():
    assert BudgetConfig(mode="elastic", max_memory_utilization=0.0).mode is BudgetMode.ELASTIC
    with pytest.raises(BudgetConfigError, match=r"outside \[0, 1\] \(EL-04\).*max_cache_size"):
        BudgetConfig(mode="elastic", max_memory_utilization=1.2)


def test_negative_quota_and_reserve_are_refused_by_name():
    with pytest.raises(BudgetConfigError, match=r"max_cache_size=-1 is negative \(EL-05\)"):
        BudgetConfig(max_cache_size=-1)
    with pytest.raises(BudgetConfigError, match=r"vmm_memory_reserve_bytes=-5 is negative"):
        BudgetConfig(reserve_bytes=-5)
    with pytest.raises(BudgetConfigError, match="budget mode 'bogus'"):
        BudgetConfig(mode="bogus")


def test_static_capacity_is_ratio_of_total_minus_used_minus_peak_in_whole_pages():
    cfg = BudgetConfig(mode="fixed", max_memory_utilization=0.9)
    # total 1000 MiB, 200 MiB in use, peak 51 MiB: 900 - 200 - 51 = 649 MiB -> 648 MiB (pages)
    assert static_capacity_bytes(cfg, 800 * MiB, 1000 * MiB, 51 * MiB, 2 * MiB) == 648 * MiB
    capped = BudgetConfig(mode="fixed", max_memory_utilization=0.9, max_cache_size=301 * MiB)
    assert static_capacity_bytes(capped, 800 * MiB, 1000 * MiB, 51 * MiB, 2 * MiB) == 300 * MiB
    assert static_capacity_bytes(cfg, 100 * MiB, 1000 * MiB, 0, 2 * MiB) == 0


def test_execution_peak_is_a_watermark_with_a_default_until_observed():
    p = ExecutionPeak(default=100)
    assert (p.bytes, p.observed) == (100, False)
    p.observe(30)
    assert (p.bytes, p.observed) == (30, True)
    p.observe(20)
    assert p.bytes == 30
    p.reset(10)
    assert p.bytes == 10
    with pytest.raises(ValueError, match="must be >= 0 bytes"):
        p.observe(-1)


@pytest.mark.parametrize("mode", list(BudgetMode))
def test_slots_outside_the_pool_come_off_the_budget_after_the_quota(mode):
    """``outside_bytes`` (MTP hidden-state slots, AD-03) is taken off the live budget in every
    mode, after the quota, as ``plan`` takes ``M x m`` off its budget."""
    from xllm_vmm.pool.budget import budget_bytes

    MiB = 1 << 20
    kw = dict(total=1000 * MiB, free=800 * MiB, execution_peak=50 * MiB, held=10 * MiB)
    for quota in (0, 100 * MiB):  # no quota, a binding quota
        base = BudgetConfig(mode=mode, max_memory_utilization=0.9, max_cache_size=quota,
                            reserve_bytes=5 * MiB)
        with_slots = BudgetConfig(mode=mode, max_memory_utilization=0.9, max_cache_size=quota,
                                  reserve_bytes=5 * MiB, outside_bytes=3 * MiB)
        assert budget_bytes(with_slots, **kw) == budget_bytes(base, **kw) - 3 * MiB
    with pytest.raises(BudgetConfigError, match="outside_bytes=-1"):
        BudgetConfig(mode=mode, outside_bytes=-1)
