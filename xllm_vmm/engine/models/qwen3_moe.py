"""Qwen3-MoE: Qwen3's attention (q/k norm) with sparse top-k experts in every layer that
``decoder_sparse_step`` / ``mlp_only_layers`` make sparse (dense gated MLP elsewhere)."""

from xllm_vmm.engine.models.decoder import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    architectures = ("Qwen3MoeForCausalLM",)
    qk_norm = True
    sparse = True
