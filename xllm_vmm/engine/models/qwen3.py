"""Qwen3 (dense): per-head RMS norm of q and k before RoPE; explicit ``head_dim`` (may differ
from hidden / heads); biases only with ``attention_bias``."""

from xllm_vmm.engine.models.decoder import CausalLM


class Qwen3ForCausalLM(CausalLM):
    architectures = ("Qwen3ForCausalLM",)
    qk_norm = True
