"""The OpenAI-compatible HTTP server over the virtual-memory engine.

One way in: :func:`build_app` over an :class:`AsyncEngine` (the asynchronous front of one
``LLMEngine``: the HTTP event loop never waits on model execution), served by
:func:`serve_async` / :class:`RunningServer` (uvicorn; graceful SIGINT/SIGTERM). Modules:
``front`` (threads, queues, admission limits, sleep), ``protocol`` (request bodies),
``openai_routes`` (completions, chat, models, tokenize), ``admin`` (sleep/wakeup/fork/VMM
status), ``metrics`` (Prometheus, vLLM names + ``xllm_vmm_*``), ``errors`` (OpenAI error
bodies), ``launch`` (uvicorn). fastapi/uvicorn/prometheus-client are the ``server`` extra;
torch is imported only by the engine.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "AsyncEngine": "xllm_vmm.server.front",
    "Delta": "xllm_vmm.server.front",
    "APIError": "xllm_vmm.server.errors",
    "ServerSettings": "xllm_vmm.server.app",
    "build_app": "xllm_vmm.server.app",
    "Metrics": "xllm_vmm.server.metrics",
    "RunningServer": "xllm_vmm.server.launch",
    "serve_async": "xllm_vmm.server.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    import importlib

    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'xllm_vmm.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
