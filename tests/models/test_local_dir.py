"""load_model_spec on local directories: config.json, safetensors headers, clear errors."""

import json
import struct

import pytest

from xllm_vmm.models import ModelConfigError, cache_layout, load_model_spec
from xllm_vmm.models.catalogue import read_catalogue_config


def _write_safetensors(path, tensors):
    """A real safetensors file; tensor data is zeros (never read by the reader)."""
    header, offset = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


@pytest.fixture
def qwen_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(read_catalogue_config("Qwen/Qwen3-8B")))
    return tmp_path


def test_directory_without_weights_uses_estimate(qwen_dir):
    s = load_model_spec(str(qwen_dir))
    assert s.name == str(qwen_dir) and s.weight_bytes is None
    assert s.served_weight_bytes == 2 * 8_190_735_360
    assert cache_layout(s).bytes_per_token == 147_456


def test_safetensors_headers_give_exact_bytes(qwen_dir):
    _write_safetensors(qwen_dir / "model-00001-of-00002.safetensors",
                       {"a": ("BF16", [4, 8], 64), "b": ("F32", [3], 12)})
    _write_safetensors(qwen_dir / "model-00002-of-00002.safetensors",
                       {"c": ("F8_E4M3", [10, 10], 100)})
    s = load_model_spec(str(qwen_dir))
    assert s.weight_bytes == 176 and s.served_weight_bytes == 176 and s.weight_bytes_exact
    assert s.extra["safetensors"].params == 32 + 3 + 100
    assert s.extra["safetensors"].files == 2


def test_config_json_file_path(qwen_dir):
    assert load_model_spec(str(qwen_dir / "config.json")).num_layers == 36


def test_no_config_json(tmp_path):
    with pytest.raises(ModelConfigError) as err:
        load_model_spec(str(tmp_path))
    assert "no config.json in the model directory" in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_invalid_json_names_line_and_column(tmp_path):
    (tmp_path / "config.json").write_text('{\n  "num_hidden_layers": 2,\n  oops\n}')
    with pytest.raises(ModelConfigError) as err:
        load_model_spec(str(tmp_path))
    assert "not valid JSON" in str(err.value) and "line 3 column 3" in str(err.value)
    assert str(tmp_path / "config.json") in str(err.value)


@pytest.mark.parametrize("patch,message", [
    ({"num_hidden_layers": None}, "config.json has no field 'num_hidden_layers'"),
    ({"num_key_value_heads": "eight"}, "'num_key_value_heads' must be an integer, got 'eight'"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be >= 1, got 0"),
    ({"torch_dtype": "float12"}, "'torch_dtype' is 'float12'"),
    ({"layer_types": ["full_attention"]}, "one type per layer"),
])
def test_bad_fields_are_named(qwen_dir, patch, message):
    cfg = read_catalogue_config("Qwen/Qwen3-8B")
    for k, v in patch.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (qwen_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError) as err:
        load_model_spec(str(qwen_dir))
    assert message in str(err.value)
    assert str(qwen_dir / "config.json") in str(err.value)


def test_truncated_safetensors_keeps_the_estimate_and_says_why(qwen_dir):
    (qwen_dir / "model.safetensors").write_bytes(struct.pack("<Q", 10_000) + b"{}")
    s = load_model_spec(str(qwen_dir))
    assert s.weight_bytes is None and s.served_weight_bytes == s.estimated_weight_bytes
    assert s.num_layers == 36
    assert "header length 10000 does not fit the file (10 bytes)" in s.weights_warning
    assert str(qwen_dir / "model.safetensors") in s.weights_warning


def test_read_weights_false_reads_only_config_json(qwen_dir):
    _write_safetensors(qwen_dir / "model.safetensors", {"w": ("BF16", [4, 4], 32)})
    assert load_model_spec(str(qwen_dir)).weight_bytes == 32
    s = load_model_spec(str(qwen_dir), read_weights=False)
    assert s.weight_bytes is None and s.weights_warning is None
    (qwen_dir / "model.safetensors").write_bytes(b"garbage")
    assert load_model_spec(str(qwen_dir), read_weights=False).weights_warning is None


def test_nested_text_config_and_sliding_window_keys(tmp_path):
    cfg = {"architectures": ["X"], "model_type": "mistral", "vision_config": {"depth": 1},
           "text_config": {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
                           "num_key_value_heads": 2, "sliding_window": 64,
                           "max_position_embeddings": 4096, "torch_dtype": "float16"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = load_model_spec(str(tmp_path))
    assert s.vision and s.head_dim == 64 and s.dtype == "float16"
    layout = cache_layout(s)
    assert [g.name for g in layout.groups] == ["sliding"]
    assert layout.groups[0].max_tokens_per_seq == 64


def _raw_safetensors(path, header_text, data_bytes):
    raw = header_text.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)


def test_deeply_nested_config_json_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelConfigError) as err:
        load_model_spec(str(tmp_path))
    assert "config.json is nested too deeply to read" in str(err.value)
    assert str(tmp_path / "config.json") in str(err.value)


@pytest.mark.parametrize("header, data, message", [
    ('{"w": {"dtype": "BF16", "shape": [1e400], "data_offsets": [0, 2]}}', 8,
     "entry 'w' has no valid data_offsets/shape (non-negative integers expected)"),
    ('{"w": {"dtype": "BF16", "shape": [-4], "data_offsets": [0, 2]}}', 8,
     "entry 'w' has no valid data_offsets/shape (non-negative integers expected)"),
    ('{"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 1e308]}}', 56,
     "entry 'w' has no valid data_offsets/shape (non-negative integers expected)"),
    ('{"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 100000000]}}', 64,
     "entry 'w' has data_offsets [0, 100000000] beyond the file's data section "
     "(64 bytes after the header)"),
    ('{"a": ' * 50_000 + '1' + '}' * 50_000, 0,
     "safetensors header is nested too deeply to read"),
])
def test_damaged_safetensors_header_keeps_the_estimate(qwen_dir, header, data, message):
    _raw_safetensors(qwen_dir / "model.safetensors", header, data)
    s = load_model_spec(str(qwen_dir))
    assert s.weight_bytes is None
    assert s.served_weight_bytes == 2 * 8_190_735_360
    assert message in s.weights_warning
