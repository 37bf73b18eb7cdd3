"""The engine: requests, sampling, the continuous-batching scheduler, workers, the offline API.

One way in: :class:`LLMEngine` (driver side: scheduler + KV cache manager + worker) and the
offline :class:`LLM`. Names are resolved lazily so that importing a light module of this package
(``sampling_params``, ``step``) does not build the rest.

Public API: ``LLMEngine``, ``LLM``, ``SamplingParams``, ``RequestOutput``, ``CompletionOutput``,
``EngineOutput``, ``OutputProcessor``, ``RequestError``, ``SeqChunk``, ``StepInput``, ``StepOutput``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SeqChunk": "xllm_vmm.engine.step",
    "StepInput": "xllm_vmm.engine.step",
    "StepOutput": "xllm_vmm.engine.step",
    "SamplingParams": "xllm_vmm.engine.sampling_params",
    "RequestError": "xllm_vmm.engine.request_error",
    "Request": "xllm_vmm.engine.request",
    "RequestStatus": "xllm_vmm.engine.request",
    "EngineOutput": "xllm_vmm.engine.output",
    "RequestOutput": "xllm_vmm.engine.output",
    "CompletionOutput": "xllm_vmm.engine.output",
    "OutputProcessor": "xllm_vmm.engine.output",
    "Scheduler": "xllm_vmm.engine.scheduler",
    "Sampler": "xllm_vmm.engine.sampler",
    "LLMEngine": "xllm_vmm.engine.llm_engine",
    "LLM": "xllm_vmm.engine.llm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'xllm_vmm.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
