"""Bad input to the compute side is a clear error naming what was wrong and what to do."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.engine import checkpoints as C
from tests.engine.paged_stack import PagedStack
from xllm_vmm.engine.attention.kv import KVCacheViews, KVLayoutMismatch
from xllm_vmm.engine.layers.rotary import RopeConfigError, RotaryEmbedding
from xllm_vmm.engine.models import ModelConfig, WeightsMismatch, build_model
from xllm_vmm.engine.step import StepInput
from xllm_vmm.engine.worker import resolve_dtype
from xllm_vmm.models.errors import ModelConfigError


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return C.llama_checkpoint(tmp_path_factory.mktemp("err") / "m")


def _cfg(d, **patch):
    raw = json.loads((d / "config.json").read_text())
    raw.update(patch)
    return ModelConfig.from_dict(raw, str(d / "config.json"))


def test_unsupported_architecture_lists_the_supported(llama):
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel.*not supported") as e:
        build_model(_cfg(llama, architectures=["GPT2LMHeadModel"]), {})
    assert "LlamaForCausalLM" in str(e.value) and "Qwen3MoeForCausalLM" in str(e.value)


def test_missing_and_misshapen_tensors_are_named(llama):
    w = load_file(str(llama / "model.safetensors"))
    cfg = _cfg(llama)
    broken = dict(w)
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightsMismatch, match="'model.layers.1.mlp.up_proj.weight'"):
        build_model(cfg, broken)
    with pytest.raises(WeightsMismatch, match=r"q_proj.weight' has shape \(64, 64\).*\(128, 64\)"):
        build_model(_cfg(llama, num_attention_heads=8), w)
    del broken["lm_head.weight"]
    broken["model.layers.1.mlp.up_proj.weight"] = w["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightsMismatch, match="'lm_head.weight'"):
        build_model(cfg, broken)  # untied without a head


def test_config_errors_name_the_field(llama, tmp_path):
    with pytest.raises(ModelConfigError, match="'hidden_size'"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4})
    (tmp_path / "config.json").write_text("{ nope")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ModelConfigError, match="use_sliding_window"):
        build_model(_cfg(llama, use_sliding_window=True, sliding_window=32),
                    load_file(str(llama / "model.safetensors")))
    with pytest.raises(RopeConfigError, match="rope_type 'longrope' is not supported"):
        RotaryEmbedding(16, {"rope_type": "longrope", "rope_theta": 1e4}, 64)
    with pytest.raises(RopeConfigError, match="'low_freq_factor'"):
        RotaryEmbedding(16, {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, 64)


def test_dtype_and_backend_names(llama):
    assert resolve_dtype("auto", "bfloat16") is torch.bfloat16
    assert resolve_dtype("bf16", "float32") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'float8'.*auto, float32, bfloat16 or float16"):
        resolve_dtype("float8", "float32")
    with pytest.raises(ValueError, match="attention backend 'fast' is not one of auto, torch, npu"):
        PagedStack(llama, backend="fast")


def test_kv_cache_of_another_model_is_refused(llama, tmp_path):
    other = C.llama_checkpoint(tmp_path / "o", num_hidden_layers=1)
    s = PagedStack(other)
    try:
        with pytest.raises(KVLayoutMismatch, match="no tensor 'layer1.k'.*1 layers, this one has 2"):
            KVCacheViews(s.cache, num_layers=2, num_kv_heads=2, head_dim=16,
                         compute_dtype=torch.float32)
        with pytest.raises(KVLayoutMismatch, match="not a multiple of 3 KV heads"):
            KVCacheViews(s.cache, num_layers=1, num_kv_heads=3, head_dim=16,
                         compute_dtype=torch.float32)
    finally:
        s.close()


def test_rope_table_grows_on_demand():
    r = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 1e4}, 1 << 20)
    assert r._cos.shape[0] == 8192  # not the whole 1M-position table up front
    cos, _ = r.cos_sin(torch.tensor([20000]), torch.float32)
    assert r._cos.shape[0] >= 20001
    assert cos.shape == (1, 1, 16)
    inv = r.inv_freq
    torch.testing.assert_close(cos[0, 0, :8], torch.cos(20000 * inv), atol=1e-4, rtol=0)


def test_closed_worker_says_so(llama):
    s = PagedStack(llama)
    chunk = s.chunk("a", [5, 6])
    s.close()
    with pytest.raises(RuntimeError, match="worker was closed"):
        s.worker.execute(StepInput.build([chunk], s.block_size))


def test_execution_peak_counts_dense_and_expert_intermediates(tmp_path):
    from xllm_vmm.engine.runner import execution_peak_estimate

    class _Backend:
        def workspace_bytes(self, meta, elem):
            return 0

    d = C.qwen3_moe_checkpoint(tmp_path / "m", num_hidden_layers=2, mlp_only_layers=[0],
                               moe_intermediate_size=16)
    w = load_file(str(d / "model.safetensors"))
    mixed = build_model(ModelConfig.from_dir(d), w)
    cfg = mixed.config
    per_token = execution_peak_estimate(mixed, _Backend(), None, 1, 0)
    width = cfg.intermediate_size  # the dense layer 0 is wider than top-2 experts of 16
    assert width > cfg.moe_intermediate_size * cfg.num_experts_per_tok
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    assert per_token == (2 * cfg.hidden_size + qkv + cfg.num_heads * cfg.head_dim
                         + 3 * width) * 4
