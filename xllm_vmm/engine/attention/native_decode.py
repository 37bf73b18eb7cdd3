"""The native paged decode kernel (``native/paged_attn.c``, ``libxllm_paged_attn.so``): decode
attention that reads K/V blocks in place through the block table — no gather copy, no padding
to the longest sequence — in float32 accumulation over float32 or bfloat16 K/V, split over
(sequence, KV head) pairs between threads, called through ctypes (the GIL is released).

:func:`load` returns the library or None (not built). It is *opt-in*
(``XLLM_VMM_NATIVE_DECODE=1``, or ``TorchSDPABackend(native_decode=True)``): measured here
(bf16, 4 layers hidden 512, 128 decodes of 64-640 keys, one thread, CPU time of a whole decode
step) it made the step slower than the bucketed gather + SDPA path — 84-87 against 52-54 ms —
because torch's CPU flash attention runs its products on this CPU's AMX/AVX-512-BF16 units
while this kernel converts to float32 and takes one ``expf`` per score; it reads no copy and no
padding, and is the base for a faster one (blocked products, vectorised exp). :func:`paged_decode` checks shapes,
dtypes and the device (CPU only) and raises ``ValueError`` naming what differs; the caller
falls back on anything it does not support (:func:`supports`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

LIB_NAME = "libxllm_paged_attn.so"
ENV = "XLLM_VMM_NATIVE_DECODE"
"""``1`` turns the native decode kernel on for the torch backend's default (off otherwise)."""

_LIB: Any = None
_TRIED = False


def _path() -> Path:
    import xllm_vmm.vmm as vmm_pkg

    return Path(vmm_pkg.__file__).resolve().parent / LIB_NAME


def enabled_by_env() -> bool:
    """``ENV`` asks for the kernel (1/true/on/yes)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "on", "yes")


def load() -> Any:
    """The ctypes library, or None when it is not built."""
    global _LIB, _TRIED
    if not _TRIED:
        _TRIED = True
        p = _path()
        if p.is_file():
            lib = ctypes.CDLL(str(p))
            f = lib.xllm_paged_decode
            i64, ptr = ctypes.c_int64, ctypes.c_void_p
            f.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i64,
                          ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            f.restype = ctypes.c_int
            _LIB = lib
    return _LIB


def _code(dtype: Any) -> int | None:
    import torch

    return {torch.float32: 0, torch.bfloat16: 1}.get(dtype)


def supports(q_dtype: Any, kv_dtype: Any, device: Any, num_heads: int, num_kv_heads: int,
             head_dim: int) -> bool:
    """The kernel runs this configuration (CPU; float32/bfloat16; head_dim <= 512; at most 16
    query heads per KV head) and the library is loaded."""
    import torch

    return (load() is not None and torch.device(device).type == "cpu"
            and _code(q_dtype) is not None and _code(kv_dtype) is not None
            and head_dim <= 512 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= 16)


def paged_decode(q: Tensor, k_slots: Tensor, v_slots: Tensor, block_table: Tensor,
                 seq_lens: Tensor, *, block_size: int, blocks_per_slot: int, scale: float,
                 num_threads: int | None = None) -> Tensor:
    """Attention output ``(B, H, D)`` (q's dtype) of decode queries ``q`` ``(B, H, D)`` over
    the keys ``0 .. seq_lens[b] - 1`` of each sequence, read through ``block_table`` ``(B, nb)``
    int64 from the layer's ``slots`` views (``(S, Bps * block_size, Hkv, D)``, page stride
    ``stride(0)``). Every table entry below ``ceil(seq_lens[b] / block_size)`` must be a block
    the manager handed out (invariant 1); entries beyond are never read."""
    import torch

    lib = load()
    if lib is None:
        raise ValueError(f"the native decode kernel is not available ({LIB_NAME} is not built: "
                         "python setup.py build_ext --inplace)")
    qt, kt = _code(q.dtype), _code(k_slots.dtype)
    if qt is None or kt is None or v_slots.dtype != k_slots.dtype:
        raise ValueError(f"native decode supports float32/bfloat16, got q {q.dtype}, "
                         f"K {k_slots.dtype}, V {v_slots.dtype}")
    b, h, d = q.shape
    _, _, hkv, dk = k_slots.shape
    if dk != d or tuple(v_slots.shape) != tuple(k_slots.shape) or v_slots.stride() != k_slots.stride():
        raise ValueError(f"K/V views {tuple(k_slots.shape)}/{tuple(v_slots.shape)} do not match q "
                         f"{tuple(q.shape)}")
    if k_slots.stride()[1:] != (hkv * d, d, 1):
        raise ValueError("K/V slots views must be token-major (stride (page, Hkv*D, D, 1))")
    q = q.contiguous()
    table = block_table.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    if table.shape[0] != b or lens.shape != (b,):
        raise ValueError(f"block_table {tuple(table.shape)} / seq_lens {tuple(lens.shape)} do "
                         f"not match {b} queries")
    out = torch.empty_like(q)
    n = torch.get_num_threads() if num_threads is None else num_threads
    rc = lib.xllm_paged_decode(
        q.data_ptr(), out.data_ptr(), k_slots.data_ptr(), v_slots.data_ptr(), table.data_ptr(),
        table.shape[1], lens.data_ptr(), b, h, hkv, d, block_size, blocks_per_slot,
        k_slots.stride(0), float(scale), qt, kt, n)
    if rc != 0:
        raise ValueError(f"xllm_paged_decode refused its arguments (rc {rc}): seq_lens must be in "
                         f"[1, nb * block_size], heads {h}/{hkv}, head_dim {d}")
    return out


__all__ = ["ENV", "LIB_NAME", "enabled_by_env", "load", "paged_decode", "supports"]
