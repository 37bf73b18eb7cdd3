"""ModelSpec from the catalogue: layer kinds, dims, dtype, MoE, MTP, VLM, parameter estimates.

Parameter counts are checked against hand counts (Qwen3-8B, exact) and the model cards."""

import pytest

from xllm_vmm.models import LayerKind, load_model_spec


def test_qwen3_8b_fields():
    s = load_model_spec("Qwen/Qwen3-8B")
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.dtype) == (36, 8, 128, "bfloat16")
    assert s.layer_kinds == (LayerKind.FULL,) * 36
    assert s.max_position_embeddings == 40960
    assert s.backend == "llm" and not s.is_hybrid and not s.has_grouped_caches
    assert s.weight_bytes is None and not s.weight_bytes_exact


def test_qwen3_8b_parameter_count_by_hand():
    # per layer: q,o 4096x4096 each; k,v 4096x1024 each; q/k norm 128 each;
    # MLP 3 x 4096 x 12288; 2 layer norms of 4096.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096
    total = 36 * layer + 4096 + 2 * 151936 * 4096
    s = load_model_spec("Qwen/Qwen3-8B")
    assert s.param_count == total == 8_190_735_360
    assert s.estimated_weight_bytes == 2 * total
    assert s.served_weight_bytes == 2 * total


@pytest.mark.parametrize("name,card_params", [
    ("Qwen/Qwen3-32B", 32.8e9), ("Qwen/Qwen3-30B-A3B", 30.5e9), ("Qwen/Qwen3-235B-A22B", 235e9),
    ("meta-llama/Llama-3.1-8B-Instruct", 8.03e9), ("meta-llama/Llama-3.1-70B-Instruct", 70.6e9),
    ("deepseek-ai/DeepSeek-V3", 671e9), ("Qwen/Qwen3-Next-80B-A3B-Instruct", 80e9),
    ("zai-org/GLM-4.5-Air", 106e9), ("Qwen/Qwen2.5-7B-Instruct", 7.61e9),
    ("openai/gpt-oss-20b", 21e9),
])
def test_parameter_estimate_within_one_percent_of_card(name, card_params):
    s = load_model_spec(name)
    assert abs(s.param_count - card_params) / card_params < 0.01, s.param_count


def test_deepseek_v3_mla_mtp_fp8():
    s = load_model_spec("deepseek-ai/DeepSeek-V3")
    assert s.layer_kinds == (LayerKind.MLA,) * 61
    assert (s.mla.kv_lora_rank, s.mla.qk_rope_head_dim, s.mla.index_head_dim) == (512, 64, None)
    assert s.mtp_layers == 1 and s.quantization == "fp8"
    assert (s.num_experts, s.num_experts_per_tok, s.num_shared_experts) == (256, 8, 1)
    # fp8: about one byte per parameter (plus block scales and bf16 embeddings/norms/routers).
    assert 1.0 < s.estimated_weight_bytes / s.param_count < 1.01
    # Total with the MTP module is the 685B Hugging Face lists, within 1.5%.
    assert abs(s.param_count + s.mtp_param_count + 129280 * 7168 * 2 - 685e9) / 685e9 < 0.015


def test_deepseek_v32_index():
    s = load_model_spec("deepseek-ai/DeepSeek-V3.2-Exp")
    assert s.mla.index_head_dim == 128 and s.mla.index_n_heads == 64


def test_qwen3_next_hybrid():
    s = load_model_spec("Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert s.is_hybrid
    assert [i for i, k in enumerate(s.layer_kinds) if k == LayerKind.FULL] == list(range(3, 48, 4))
    assert s.count(LayerKind.LINEAR) == 36
    assert (s.linear_state.recurrent_elems, s.linear_state.conv_elems) == (524_288, 24_576)


def test_gpt_oss_sliding_mxfp4_no_dtype():
    s = load_model_spec("openai/gpt-oss-20b")
    assert s.layer_kinds[:2] == (LayerKind.SLIDING, LayerKind.FULL)
    assert s.count(LayerKind.SLIDING) == 12 and s.count(LayerKind.FULL) == 12
    assert s.sliding_window == 128 and s.has_grouped_caches
    assert s.dtype == "bfloat16" and "no torch_dtype" in s.extra["dtype_from"]
    assert s.quantization == "mxfp4" and s.num_experts == 32
    # MXFP4 experts: ~4.25 bits per expert weight; 12.8-14 GB in all (the checkpoint is 13.8 GB).
    assert 12.8e9 < s.estimated_weight_bytes < 14e9


def test_qwen25_vl_is_vlm_and_counts_the_vision_tower():
    vl = load_model_spec("Qwen/Qwen2.5-VL-7B-Instruct")
    text = load_model_spec("Qwen/Qwen2.5-7B-Instruct")
    assert vl.vision and vl.backend == "vlm"
    assert abs(vl.param_count - 8.29e9) / 8.29e9 < 0.005  # Hugging Face lists 8.29B
    assert vl.param_count - text.param_count > 0.6e9


def test_glm_air_mtp_and_moe():
    s = load_model_spec("zai-org/GLM-4.5-Air")
    assert s.mtp_layers == 1 and s.num_experts == 128 and s.num_shared_experts == 1
    assert s.head_dim == 128 and s.num_attention_heads == 96
