"""JSON schema (stable field names), TOML, and a plan for every catalogue model in every mode."""

import json
import tomllib

import pytest

from xllm_vmm.models import catalogue_names, load_model_spec
from xllm_vmm.planner import PlanInputs, make_plan
from xllm_vmm.planner.report import plan_to_dict, plan_to_toml, render_table

MODES = {
    "physical": {},
    "fixed_vmm": {"enable_vmm_kvcache": True},
    "elastic_vmm": {"enable_vmm_kvcache": True, "vmm_elastic": True},
}
H200 = 143_156 * 1024 * 1024


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", catalogue_names())
def test_every_catalogue_model_in_every_mode(name, mode):
    spec = load_model_spec(name)
    workers = 16 if "DeepSeek" in name else 4 if "Qwen2.5" in name else 8
    p = make_plan(spec, PlanInputs(workers=workers,
                                   device_memory_bytes=H200, device_name="h200",
                                   context_len=32_768, **MODES[mode]))
    d = plan_to_dict(p)
    assert d["mode"] == mode and d["verdict"] == "fits", d["reasons"]
    w = d["per_worker"][0]
    for key in ("weights_bytes", "kv_bytes_per_token", "block_bytes", "page_bytes",
                "blocks_per_page", "arena_bytes", "physical_budget_bytes", "host_pool_bytes",
                "kv_capacity_tokens", "max_concurrency"):
        assert key in w
    assert w["kv_capacity_tokens"] >= 32_768 and w["max_concurrency"] >= 1
    assert (w["arena_bytes"] > 0) == (mode != "physical")
    assert json.loads(json.dumps(d)) == d
    assert tomllib.loads(plan_to_toml(p))["verdict"] == "fits"
    assert set(w["block_bytes"]) == {g["name"] for g in w["groups"]}


def test_json_top_level_fields_are_stable():
    d = plan_to_dict(make_plan(load_model_spec("Qwen/Qwen3-8B"), PlanInputs()))
    assert list(d) == ["schema_version", "model", "workers", "mode", "device",
                       "host_memory_bytes", "context_len", "verdict", "serve_refuses", "reasons",
                       "max_context_len", "suggested_workers", "inputs", "per_worker", "totals",
                       "formulas", "config_findings"]
    assert d["schema_version"] == 1 and d["workers"] == 1
    w = d["per_worker"][0]
    assert w["kv_bytes_per_token"] == 147_456
    assert w["block_bytes"] == {"attn": 147_456 * 128}
    assert w["blocks_per_page"] == {"attn": 8} and w["page_bytes"] == 2 * 1024 * 1024
    assert d["totals"]["kv_capacity_tokens"] == w["kv_capacity_tokens"]


def test_table_and_explain_render(tmp_path):
    import io

    p = make_plan(load_model_spec("Qwen/Qwen3-Next-80B-A3B-Instruct"),
                  PlanInputs(workers=4, enable_vmm_kvcache=True, vmm_elastic=True))
    buf = io.StringIO()
    render_table(p, buf, explain=True)
    text = buf.getvalue()
    assert "resident state (HY-01)" in text
    assert "free - execution peak - vmm_memory_reserve_bytes" in text
    assert "elastic range" in text and "worker 3 |" in text


def test_tables_at_80_columns_print_every_number_in_full():
    """At 80 columns no number is cut ("127,926,2…") or wrapped: each figure of the cache-group
    and memory tables appears whole, equal to the JSON's."""
    import io
    import re

    from xllm_vmm.models import load_model_spec
    from xllm_vmm.planner import PlanInputs, make_plan
    from xllm_vmm.planner.report import human, plan_to_dict, render_table

    cases = [("deepseek-ai/DeepSeek-V3.2-Exp", PlanInputs(workers=8, enable_vmm_kvcache=True)),
             ("openai/gpt-oss-20b", PlanInputs(device_memory_bytes=150_117_449_728,
                                               device_name="h200", enable_vmm_kvcache=True,
                                               vmm_elastic=True))]
    for name, inp in cases:
        plan = make_plan(load_model_spec(name), inp)
        buf = io.StringIO()
        render_table(plan, buf, width=80)
        text = buf.getvalue()
        assert "…" not in text
        assert max(len(line) for line in text.splitlines() if line[:1] in "┏┃┡│└┌") <= 80
        rows = {}
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip("│").split("│")]
            if len(cells) == 7 and cells[1].isdigit():
                rows.setdefault(cells[0], cells[1:])
        w = plan_to_dict(plan)["per_worker"][0]
        for g in w["groups"]:
            cells = next(v for k, v in rows.items() if g["name"].startswith(k.split(" ")[0]))
            assert cells == [f"{g['tensors']:,}", f"{g['bytes_per_token']:,}",
                             f"{g['block_bytes']:,}", f"{g['blocks_per_page']:,}",
                             f"{g['slot_bytes']:,}", f"{g['blocks']:,}"]
        for figure in ("weights_bytes", "kv_pool_bytes", "arena_bytes"):
            assert re.search(rf"│\s+{re.escape(human(w[figure]))} │", text), figure
        assert f"{w['kv_capacity_tokens']:,} tokens" in text
