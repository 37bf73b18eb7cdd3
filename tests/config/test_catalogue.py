"""The flag catalogue against the engine's flag list, the pydantic model, and the generated docs."""

import json
from pathlib import Path

import pytest

from xllm_vmm.config.catalogue import FLAGS, GROUPS
from xllm_vmm.cli.reference import reference_text
from xllm_vmm.config.docs import REFERENCE_PATH
from xllm_vmm.config.model import config_model, toml_schema

ROOT = Path(__file__).resolve().parents[2]

# A sample of the reference list (shared/reference/xllm-flags.tsv) with defaults evaluated.
REFERENCE_SAMPLE = [
    ("max_memory_utilization", "double", 0.8, "kv_cache"),       # "0.8 | 0.55": first
    ("max_cache_size", "int64", 0, "kv_cache"),                  # "0 | 1000000": first
    ("block_size", "int32", 128, "kv_cache"),
    ("enable_prefix_cache", "bool", True, "kv_cache"),
    ("kv_cache_dtype", "string", "auto", "kv_cache"),
    ("host_blocks_factor", "double", 0.0, "kv_cache_store"),
    ("max_seqs_per_batch", "int32", 200, "scheduler"),
    ("max_tokens_per_batch", "int32", 10240, "scheduler"),
    ("enable_chunked_prefill", "bool", True, "scheduler"),
    ("speculative_algorithm", "string", "MTP", "speculative"),
    ("num_speculative_tokens", "int32", 0, "speculative"),
    ("port", "int32", 8010, "service"),
    ("xxh3_128bits_seed", "uint32", 1024, "kv_cache"),
    ("phy_page_granularity_size", "int64", 2 * 1024 * 1024, "kv_cache"),
    ("flashinfer_workspace_buffer_size", "int32", 128 * 1024 * 1024, "model"),
    ("max_global_tpot_ms", "int32", 2**31 - 1, "profile"),
    ("enable_graph_vmm_pool", "bool", True, "execution"),
    ("master_node_addr", "string", "127.0.0.1:19888", "distributed"),
    ("backend", "string", "", "model"),
]


@pytest.mark.parametrize("name,ftype,default,group", REFERENCE_SAMPLE)
def test_reference_defaults(name, ftype, default, group):
    f = FLAGS[name]
    assert (f.type, f.default, f.group) == (ftype, default, group)


def test_spec_flags_and_counts():
    for name, default in [("enable_vmm_kvcache", False), ("enable_vmm_weights", False),
                          ("vmm_elastic", False), ("vmm_memory_reserve_bytes", 0),
                          ("enable_task_pipeline", False)]:
        assert FLAGS[name].default == default and FLAGS[name].origin == "spec"
    assert len(FLAGS) == 231  # 226 engine flags + 5 from the specification
    assert FLAGS["vmm_memory_reserve_bytes"].is_bytes and FLAGS["max_cache_size"].is_bytes
    assert {f.group for f in FLAGS.values()} == set(GROUPS)
    assert FLAGS["max_memory_utilization"].platform_default == "0.55"
    assert "0.55 on some builds" in FLAGS["max_memory_utilization"].help


def test_pydantic_model_matches_catalogue():
    model = config_model()
    assert set(model.model_fields) == set(FLAGS)
    inst = model()
    for name, flag in FLAGS.items():
        assert getattr(inst, name) == flag.default
    assert model(port=9000).port == 9000
    with pytest.raises(Exception):
        model(port=70000)
    with pytest.raises(Exception):
        model(not_a_flag=1)


def test_cli_reference_is_fresh():
    assert REFERENCE_PATH == ROOT / "docs" / "cli-reference.md"
    assert REFERENCE_PATH.read_text(encoding="utf-8") == reference_text(), (
        "docs/cli-reference.md is stale: run python -m xllm_vmm.cli.reference")


def test_shipped_schema_is_fresh_and_validates_configs():
    shipped = json.loads((ROOT / "configs" / "xllm-vmm.schema.json").read_text())
    assert shipped == toml_schema(), "run: xllm-vmm schema -o configs/xllm-vmm.schema.json"
    props = shipped["properties"]
    assert props["kv_cache"]["properties"]["block_size"]["default"] == 128
    assert "anyOf" in props["model"]  # the flag `model` and the table [model]
    assert shipped["additionalProperties"] is False


CHOICES = {
    "speculative_algorithm": ("MTP", "Eagle3", "Suffix", "DFlash"),
    "instance_role": ("DEFAULT", "PREFILL", "DECODE", "MIX"),
    "kv_cache_transfer_mode": ("PUSH", "PULL"),
    "kv_cache_transfer_type": ("LlmDataDist", "Mooncake", "HCCL"),
    "backend": ("llm", "vlm", "rec", "dit"),
}


def test_fixed_value_sets_in_catalogue_help_and_schema():
    for name, values in CHOICES.items():
        assert FLAGS[name].choices == values
        assert FLAGS[name].help.endswith(
            "Values: " + ", ".join(values)
            + (" (exactly as written; empty too)." if FLAGS[name].default == "" else
               " (exactly as written)."))
        assert FLAGS[name].choice(FLAGS[name].default) or FLAGS[name].default == ""
    schema = toml_schema()
    assert schema["properties"]["speculative_algorithm"]["enum"] == list(CHOICES[
        "speculative_algorithm"])
    assert schema["properties"]["backend"]["enum"] == ["llm", "vlm", "rec", "dit", ""]
    assert {n for n, f in FLAGS.items() if f.choices} == set(CHOICES) | {"kv_cache_dtype"}


def test_kv_cache_dtype_values_are_the_planners():
    from xllm_vmm.models.dtypes import _CANONICAL

    assert set(FLAGS["kv_cache_dtype"].choices) == {"auto"} | set(_CANONICAL)
