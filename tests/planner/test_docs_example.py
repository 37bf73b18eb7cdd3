"""docs/sizing.md's worked example is what the planner computes."""

from pathlib import Path

import pytest

from xllm_vmm.models import load_model_spec
from xllm_vmm.planner import PlanInputs, make_plan

DOC = Path(__file__).resolve().parents[2] / "docs" / "sizing.md"


@pytest.mark.skipif(not DOC.is_file(), reason="docs not in this checkout")
def test_worked_example_figures_are_in_the_doc():
    text = DOC.read_text()
    spec = load_model_spec("Qwen/Qwen3-8B")
    fixed = make_plan(spec, PlanInputs(enable_vmm_kvcache=True)).workers[0]
    phys = make_plan(spec, PlanInputs()).workers[0]
    elastic = make_plan(spec, PlanInputs(enable_vmm_kvcache=True, vmm_elastic=True,
                                         vmm_memory_reserve_bytes=1 << 30)).workers[0]
    for value in (fixed.execution_peak_bytes, fixed.physical_budget_bytes, fixed.arena_bytes,
                  fixed.kv_capacity_tokens, phys.kv_capacity_tokens,
                  elastic.physical_budget_bytes, elastic.kv_capacity_tokens,
                  elastic.arena_bytes, elastic.elastic_max_bytes):
        assert f"{value:,}" in text, value
    assert fixed.max_concurrency == 6 and elastic.max_concurrency == 8
