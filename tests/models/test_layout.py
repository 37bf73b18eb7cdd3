"""cache_layout: hand-checked bytes per token for every catalogue model, TP splits,
replication, dtypes, the MTP draft group (SD-01) and hybrid resident state (HY-01)."""

import dataclasses

import pytest

from xllm_vmm.models import LayoutError, cache_layout, load_model_spec

# README figures (bf16, one worker, no draft): all non-capped groups together.
README_KV_PER_TOKEN = {
    "Qwen/Qwen3-8B": 147_456, "Qwen/Qwen3-32B": 262_144, "Qwen/Qwen3-30B-A3B": 98_304,
    "Qwen/Qwen3-235B-A22B": 192_512, "meta-llama/Llama-3.1-8B-Instruct": 131_072,
    "meta-llama/Llama-3.1-70B-Instruct": 327_680, "deepseek-ai/DeepSeek-V3": 70_272,
    "deepseek-ai/DeepSeek-V3.2-Exp": 85_888, "Qwen/Qwen3-Next-80B-A3B-Instruct": 24_576,
    "Qwen/Qwen2.5-VL-7B-Instruct": 57_344, "zai-org/GLM-4.5-Air": 188_416,
    "Qwen/Qwen2.5-7B-Instruct": 57_344, "openai/gpt-oss-20b": 24_576,
}


@pytest.mark.parametrize("name,expected", sorted(README_KV_PER_TOKEN.items()))
def test_kv_bytes_per_token_matches_readme(name, expected):
    assert cache_layout(load_model_spec(name)).bytes_per_token == expected


def test_qwen3_8b_groups_and_5_625_gib_at_40960_tokens():
    layout = cache_layout(load_model_spec("Qwen/Qwen3-8B"))
    (g,) = layout.groups
    assert g.name == "attn" and len(g.tensors) == 72
    assert g.tensors[0].name == "layer0.k" and g.tensors[1].name == "layer0.v"
    assert g.tensor_bytes_per_token == 8 * 128 * 2 == 2048
    assert g.tensor_block_bytes == 2048 * 128 == 262_144
    assert g.block_bytes == 147_456 * 128
    assert g.blocks_per_page(2 * 1024 * 1024) == 8
    assert g.slot_bytes(2 * 1024 * 1024) == 72 * 2 * 1024 * 1024
    assert 147_456 * 40_960 == int(5.625 * 1024 ** 3)


@pytest.mark.parametrize("workers,per_token", [(1, 147_456), (2, 73_728), (4, 36_864),
                                               (8, 18_432), (16, 18_432), (32, 18_432)])
def test_tp_split_and_replication(workers, per_token):
    layout = cache_layout(load_model_spec("Qwen/Qwen3-8B"), workers=workers)
    assert layout.workers == workers and layout.bytes_per_token == per_token


@pytest.mark.parametrize("workers", [3, 6, 12])
def test_workers_that_cannot_split_kv_heads(workers):
    # GLM-4.5-Air: 96 attention heads (divisible by these), 8 KV heads (not).
    with pytest.raises(LayoutError) as err:
        cache_layout(load_model_spec("zai-org/GLM-4.5-Air"), workers=workers)
    assert "8 KV heads of zai-org/GLM-4.5-Air" in str(err.value)
    assert "nnodes x devices / dp_size" in str(err.value)


def test_workers_must_divide_attention_heads():
    # 64 is a multiple of the 8 KV heads, but does not divide the 32 attention heads.
    with pytest.raises(LayoutError) as err:
        cache_layout(load_model_spec("Qwen/Qwen3-8B"), workers=64)
    assert "64 workers cannot split the 32 attention heads of Qwen/Qwen3-8B" in str(err.value)


def test_mla_is_replicated_across_workers():
    spec = load_model_spec("deepseek-ai/DeepSeek-V3")
    for w in (1, 8, 16):
        layout = cache_layout(spec, workers=w)
        assert [g.name for g in layout.groups] == ["mla"]
        assert layout.groups[0].tensor_bytes_per_token == 576 * 2
        assert layout.bytes_per_token == 70_272


def test_mla_index_groups():
    layout = cache_layout(load_model_spec("deepseek-ai/DeepSeek-V3.2-Exp"), workers=8)
    assert [(g.name, len(g.tensors), g.tensor_bytes_per_token) for g in layout.groups] == [
        ("mla", 61, 1152), ("index", 61, 256)]
    assert layout.group("index").bytes_per_token == 15_616
    assert layout.groups[1].tensors[60].name == "layer60.index"


def test_mtp_draft_group_sd01():
    glm = cache_layout(load_model_spec("zai-org/GLM-4.5-Air"), draft=True)
    assert [g.name for g in glm.groups] == ["attn", "draft"]
    assert glm.group("draft").bytes_per_token == 4096
    assert glm.bytes_per_token == 192_512  # README: with the MTP layer
    ds = cache_layout(load_model_spec("deepseek-ai/DeepSeek-V3"), draft=True)
    assert ds.group("draft").tensors[0].name == "mtp0.latent"
    assert ds.bytes_per_token == 71_424
    v32 = cache_layout(load_model_spec("deepseek-ai/DeepSeek-V3.2-Exp"), draft=True)
    assert [g.name for g in v32.groups] == ["mla", "index", "draft", "draft_index"]
    # No MTP layers: draft=True adds nothing.
    assert [g.name for g in cache_layout(load_model_spec("Qwen/Qwen3-8B"), draft=True).groups] \
        == ["attn"]
    # GLM with 16 workers: 8 KV heads replicated, draft follows the target's split.
    glm16 = cache_layout(load_model_spec("zai-org/GLM-4.5-Air"), workers=16, draft=True)
    assert glm16.group("draft").tensor_bytes_per_token == 128 * 2


def test_hybrid_resident_state_hy01():
    spec = load_model_spec("Qwen/Qwen3-Next-80B-A3B-Instruct")
    layout = cache_layout(spec)
    assert [g.name for g in layout.groups] == ["attn"] and len(layout.groups[0].tensors) == 24
    assert layout.resident.recurrent_bytes_per_seq == 37_748_736
    assert layout.resident.conv_bytes_per_seq == 1_769_472
    assert layout.resident.bytes_per_seq == 39_518_208
    f32 = cache_layout(spec, state_dtype="float32")
    assert f32.resident.recurrent_bytes_per_seq == 75_497_472
    two = cache_layout(spec, workers=2)
    assert two.resident.bytes_per_seq == 39_518_208 // 2
    assert two.bytes_per_token == 12_288
    # 4 workers > 2 KV heads: attention replicated (1 head), linear heads split 4 ways.
    four = cache_layout(spec, workers=4)
    assert four.bytes_per_token == 12_288 and four.resident.bytes_per_seq == 39_518_208 // 4
    with pytest.raises(LayoutError, match="16 attention heads"):
        cache_layout(spec, workers=32)
    wide = dataclasses.replace(spec, num_attention_heads=64, num_kv_heads=32)
    with pytest.raises(LayoutError, match=r"linear-attention heads of .* \(16 key heads, 32 value heads\)"):
        cache_layout(wide, workers=32)


def test_sliding_group_is_capped():
    layout = cache_layout(load_model_spec("openai/gpt-oss-20b"))
    sliding = layout.group("sliding")
    assert sliding.max_tokens_per_seq == 128 and sliding.bytes_per_token == 24_576
    assert sliding.bytes_per_token * sliding.max_tokens_per_seq == 3_145_728
    assert layout.group("attn").max_tokens_per_seq is None


@pytest.mark.parametrize("kv_dtype,per_token", [("auto", 147_456), ("bfloat16", 147_456),
                                                ("fp16", 147_456), ("float32", 294_912),
                                                ("int8", 73_728), ("fp8", 73_728),
                                                ("fp8_e5m2", 73_728)])
def test_kv_dtypes(kv_dtype, per_token):
    layout = cache_layout(load_model_spec("Qwen/Qwen3-8B"), kv_dtype=kv_dtype)
    assert layout.bytes_per_token == per_token


def test_bad_layout_arguments():
    spec = load_model_spec("Qwen/Qwen3-8B")
    with pytest.raises(LayoutError, match="kv_cache_dtype 'int3'"):
        cache_layout(spec, kv_dtype="int3")
    with pytest.raises(LayoutError, match="block_size"):
        cache_layout(spec, block_size=0)
    with pytest.raises(LayoutError, match="workers"):
        cache_layout(spec, workers=0)
