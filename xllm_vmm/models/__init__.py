"""Model specifications, the built-in model catalogue and per-worker cache layouts.

Public API (no torch import anywhere in this package):

- :func:`load_model_spec` (a model directory or a catalogue name -> :class:`ModelSpec`),
- :func:`cache_layout` (a :class:`ModelSpec` and a worker count -> :class:`CacheLayout`),
- :func:`catalogue_names`,
- :class:`ModelConfigError` (and its subclass :class:`LayoutError`).
"""

from xllm_vmm.models.catalogue import catalogue_names
from xllm_vmm.models.dtypes import dtype_bytes, resolve_kv_dtype
from xllm_vmm.models.errors import LayoutError, ModelConfigError
from xllm_vmm.models.layout import cache_layout, kv_heads_per_worker
from xllm_vmm.models.loader import load_model_spec
from xllm_vmm.models.spec import (CacheGroup, CacheLayout, CacheTensor, LayerKind,
                                  LinearStateDims, MlaDims, ModelSpec, ResidentState)

__all__ = [
    "CacheGroup", "CacheLayout", "CacheTensor", "LayerKind", "LayoutError", "LinearStateDims",
    "MlaDims", "ModelConfigError", "ModelSpec", "ResidentState", "cache_layout",
    "catalogue_names", "dtype_bytes", "kv_heads_per_worker", "load_model_spec",
    "resolve_kv_dtype",
]
