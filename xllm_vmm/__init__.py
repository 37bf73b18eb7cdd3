"""xllm-vmm: an LLM server whose KV cache and weights live in a virtual-memory (VMM) pool.

Importing the package is cheap: nothing here imports torch, pydantic or the native libraries.
``LLM`` and ``SamplingParams`` (the offline API, :mod:`xllm_vmm.engine`) are resolved on first
use, so ``import xllm_vmm`` stays torch-free.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {"LLM": "xllm_vmm.engine.llm", "SamplingParams": "xllm_vmm.engine.sampling_params"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'xllm_vmm' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


__all__ = ["LLM", "SamplingParams", "__version__"]
