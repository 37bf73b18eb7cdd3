"""The built-in catalogue: names, lookup, and the exact published values it ships."""

import json
from pathlib import Path

import pytest

from xllm_vmm.models import ModelConfigError, catalogue_names, load_model_spec
from xllm_vmm.models.catalogue import closest_names, resolve_name

REFERENCE = Path("/work/shared/reference/model-configs")

EXPECTED = [
    "deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3.2-Exp",
    "meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
    "openai/gpt-oss-20b", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct",
    "Qwen/Qwen3-235B-A22B", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-32B", "Qwen/Qwen3-8B",
    "Qwen/Qwen3-Next-80B-A3B-Instruct", "zai-org/GLM-4.5-Air",
]


def test_catalogue_lists_every_reference_model_sorted():
    assert catalogue_names() == EXPECTED


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="shared reference not present")
def test_catalogue_files_equal_the_reference_files():
    from importlib import resources
    root = resources.files("xllm_vmm.models") / "catalogue"
    for ref in REFERENCE.glob("*.json"):
        assert json.loads((root / ref.name).read_text()) == json.loads(ref.read_text())


@pytest.mark.parametrize("ref", ["Qwen/Qwen3-8B", "qwen/qwen3-8b", "Qwen__Qwen3-8B",
                                 "QWEN__QWEN3-8B", " Qwen/Qwen3-8B ", "Qwen3-8B"])
def test_lookup_forms(ref):
    assert resolve_name(ref) == "Qwen/Qwen3-8B"
    assert load_model_spec(ref).name == "Qwen/Qwen3-8B"


def test_unknown_name_suggests_closest():
    with pytest.raises(ModelConfigError) as err:
        load_model_spec("Qwen/Qwen3-9B")
    text = str(err.value)
    assert "unknown model 'Qwen/Qwen3-9B'" in text
    assert "did you mean Qwen/Qwen3-8B" in text
    assert "--list-models" in text
    assert closest_names("deepseek-v3")[0] == "deepseek-ai/DeepSeek-V3"


def test_missing_path_is_reported_as_a_path(tmp_path):
    with pytest.raises(ModelConfigError) as err:
        load_model_spec(str(tmp_path / "nope" / "model"))
    assert "model directory does not exist" in str(err.value)
    assert str(tmp_path / "nope" / "model") in str(err.value)
