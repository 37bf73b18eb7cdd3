"""Qwen2 / Qwen2.5: Llama's shape with q/k/v biases (always present), often tied embeddings."""

from xllm_vmm.engine.models.decoder import CausalLM


class Qwen2ForCausalLM(CausalLM):
    architectures = ("Qwen2ForCausalLM",)
    qkv_bias = True
