"""Llama (1/2/3/3.1, llama3 rope scaling via :mod:`~xllm_vmm.engine.layers.rotary`): q/k/v/o
biases only when ``attention_bias`` put them in the checkpoint."""

from xllm_vmm.engine.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    architectures = ("LlamaForCausalLM",)
