"""Fixtures for the configuration tests: tiny model directories (only config.json)."""

import json

import pytest

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "torch_dtype": "bfloat16", "vocab_size": 100,
        "intermediate_size": 128}

VARIANTS = {
    "dense": {},
    "hybrid": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
               "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "linear_key_head_dim": 16,
               "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4},
    "vlm": {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "vision_config": {"depth": 2}},
    "sliding": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 128},
}


@pytest.fixture
def model_dir(tmp_path):
    """``model_dir(kind)`` → path of a directory holding a tiny config.json of that kind."""

    def make(kind: str) -> str:
        d = tmp_path / f"model-{kind}"
        d.mkdir(exist_ok=True)
        cfg = dict(BASE)
        cfg.update(VARIANTS[kind])
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    return make
