"""Model families: one compact class per architecture over the shared layers.

:func:`model_class` maps a ``config.json`` architecture to its class; :func:`build_model`
builds one from a :class:`ModelConfig` and a mapping of referenced weight tensors.
"""

from __future__ import annotations

from typing import Any, Mapping

from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel
from xllm_vmm.engine.models.config import ModelConfig
from xllm_vmm.engine.models.decoder import CausalLM, WeightsMismatch
from xllm_vmm.engine.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM
from xllm_vmm.engine.models.llama import LlamaForCausalLM
from xllm_vmm.engine.models.qwen2 import Qwen2ForCausalLM
from xllm_vmm.engine.models.qwen3 import Qwen3ForCausalLM
from xllm_vmm.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from xllm_vmm.engine.models.qwen3_next import Qwen3NextForCausalLM
from xllm_vmm.models.errors import ModelConfigError

FAMILIES: tuple[type[CausalLM], ...] = (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
                                       Qwen3MoeForCausalLM, DeepseekV3ForCausalLM,
                                       DeepseekV32ForCausalLM, Qwen3NextForCausalLM)
ARCHITECTURES: dict[str, type[CausalLM]] = {a: f for f in FAMILIES for a in f.architectures}


def model_class(architecture: str) -> type[CausalLM]:
    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        raise ModelConfigError(
            f"architecture {architecture!r} is not supported by the engine",
            hint=f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return cls


def build_model(cfg: ModelConfig, weights: Mapping[str, Any], *, tp: TensorParallel = SINGLE,
                device: Any = None) -> CausalLM:
    return model_class(cfg.architecture)(cfg, weights, tp=tp, device=device)


__all__ = ["ARCHITECTURES", "CausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM",
           "FAMILIES", "LlamaForCausalLM", "ModelConfig",
           "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
           "WeightsMismatch",
           "build_model", "model_class"]
