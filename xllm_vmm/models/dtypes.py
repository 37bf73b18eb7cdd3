"""Element sizes of weight, KV-cache and state dtypes, in bytes.

Names follow ``torch_dtype`` in ``config.json`` and the engine's ``kv_cache_dtype`` flag; short
aliases (``bf16``, ``fp16``, ``fp8``, ...) are accepted. ``auto`` is resolved by the caller (it
follows the model's dtype).
"""

from __future__ import annotations

from xllm_vmm.models.errors import LayoutError

_CANONICAL = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float64": "float64",
    "int8": "int8",
    "uint8": "uint8",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e4m3fn": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "float8_e5m2": "float8_e5m2",
}

_SIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

#: Element sizes of the dtypes a safetensors header may name (bytes per element).
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


def canonical_dtype(name: str) -> str | None:
    """The canonical name of ``name`` (``"bf16"`` -> ``"bfloat16"``), or None if unknown."""
    key = str(name).strip().lower()
    if key.startswith("torch."):
        key = key[len("torch."):]
    return _CANONICAL.get(key)


def dtype_bytes(name: str, *, what: str = "dtype") -> int:
    """Bytes per element of ``name``. Raises :class:`LayoutError` naming ``what`` if unknown."""
    canon = canonical_dtype(name)
    if canon is None:
        known = ", ".join(sorted(set(_CANONICAL)))
        raise LayoutError(f"unknown {what} {name!r}", hint=f"use one of: auto, {known}")
    return _SIZE[canon]


def resolve_kv_dtype(kv_dtype: str, model_dtype: str) -> str:
    """``kv_cache_dtype`` as a canonical dtype name: ``auto`` follows the model's dtype."""
    if str(kv_dtype).strip().lower() in ("auto", ""):
        return canonical_dtype(model_dtype) or model_dtype
    canon = canonical_dtype(kv_dtype)
    if canon is None:
        dtype_bytes(kv_dtype, what="kv_cache_dtype")  # raises with the list of known names
    return canon  # type: ignore[return-value]
