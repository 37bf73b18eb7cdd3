"""Attention backends behind one interface (:class:`AttentionBackend`), over K/V tensors that
view the virtual KV cache (:class:`KVCacheViews`).

:func:`select_backend` picks by name and device: ``"torch"`` (CPU and CUDA: SDPA, with CPU
decodes on the native paged kernel of :mod:`.native_decode` by default, gathered for SDPA
otherwise), ``"npu"`` (torch_npu paged attention; needs an Ascend NPU), ``"auto"`` (the
device's default).
"""

from __future__ import annotations

from typing import Any

from xllm_vmm.engine.attention.base import AttentionBackend
from xllm_vmm.engine.attention.kv import (KVCacheViews, KVGeometry, KVLayoutMismatch, PagedKV,
                                          kv_torch_dtype)

BACKENDS = ("auto", "torch", "npu")


def backend_class(name: str, device_type: str) -> type[AttentionBackend]:
    """The backend class for ``name`` on a ``device_type`` ("cpu", "cuda", "npu") device."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "npu" if device_type == "npu" else "torch"
    if name == "npu":
        if device_type != "npu":
            raise ValueError(f"attention backend 'npu' needs an NPU device, not {device_type!r}")
        from xllm_vmm.engine.attention.npu import NpuPagedBackend

        return NpuPagedBackend
    from xllm_vmm.engine.attention.torch_sdpa import TorchSDPABackend

    return TorchSDPABackend


def select_backend(name: str, geometry: KVGeometry, *, num_heads: int, num_kv_heads: int,
                   head_dim: int, device: Any) -> AttentionBackend:
    import torch

    cls = backend_class(name, torch.device(device).type)
    return cls(geometry, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
               device=device)


__all__ = ["AttentionBackend", "BACKENDS", "KVCacheViews", "KVGeometry", "KVLayoutMismatch",
           "PagedKV", "backend_class", "kv_torch_dtype", "select_backend"]
