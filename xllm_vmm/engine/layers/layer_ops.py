"""The fused layer ops of ``native/layer_ops.c`` (``libxllm_layer_ops.so``), called through ctypes
(the GIL is released for the call): RMS norm with an optional fused residual add (vLLM's
``fused_add_rms_norm``), ``silu(gate) * up`` and rotary embedding in place on q and k.

Each op is one pass over its rows in float32 with the roundings of the torch formula it replaces
(the C file's header states them), so float32 results equal the torch formulas to float32
rounding of a sum or an ``exp`` (tests: within 1e-6 relative) and bfloat16 results are the same
bits except where such a last float32 bit moves a bfloat16 rounding (one bfloat16 ulp).

These functions do not decide *whether* to run natively: :func:`supported` says whether a call's
tensors fit (CPU, float32 or bfloat16 throughout, unit stride inside a row, rows at one stride),
and the layers (``norm.py``, ``mlp.py``, ``rotary.py``) fall back to their torch formula when it
is False. A call that does not fit raises ``ValueError`` naming what differs.

``XLLM_VMM_LAYER_OPS=0`` turns the native ops off (torch formulas everywhere);
:func:`force_portable` switches the library to its portable C path (the one non-AVX-512 CPUs
run), for tests.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Any

from xllm_vmm.engine.native_threads import prototype as _threads_prototype
from xllm_vmm.engine.row_buckets import empty_rows_like

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

LIB_NAME = "libxllm_layer_ops.so"
ENV = "XLLM_VMM_LAYER_OPS"
"""``0``/``false``/``off`` turns the native layer ops off (the torch formulas run instead)."""
ABI_VERSION = 2

_LIB: Any = None  # the loaded library once its ABI matched
_ON: bool | None = None


_I64, _PTR, _I32, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_PROTOTYPES: dict[str, tuple[list, Any]] = {
    "xllm_layer_ops_abi": ([], _I32),
    "xllm_rms_norm": ([_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _F32, _I32, _I32], _I32),
    "xllm_silu_and_mul": ([_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I32, _I32], _I32),
    "xllm_rope": ([_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64,
                   _I32, _I32, _I32], _I32),
    "xllm_rope_out": ([_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _PTR,
                       _I64, _PTR, _PTR, _I64, _I64, _I32, _I32, _I32], _I32),
    "xllm_layer_ops_isa": ([], _I32),
    "xllm_layer_ops_set_isa": ([_I32], _I32),
    "xllm_layer_ops_use_omp": _threads_prototype(),
}


def load() -> Any:
    """The ctypes library, or None when it is not built or its ABI differs
    (:func:`xllm_vmm.vmm.native.optional_library`)."""
    global _LIB
    if _LIB is None:
        from xllm_vmm.vmm.native import optional_library

        lib = optional_library(LIB_NAME, _PROTOTYPES)
        if lib is not None and lib.xllm_layer_ops_abi() == ABI_VERSION:
            from xllm_vmm.engine import native_threads

            native_threads.attach(lib.xllm_layer_ops_use_omp)  # torch's OpenMP team by default
            _LIB = lib
            if _avx512_hidden():  # XLLM_VMM_CPU_HIDE=avx512: the portable C, as without it
                lib.xllm_layer_ops_set_isa(0)
    return _LIB


def enabled() -> bool:
    """The library is loaded and ``XLLM_VMM_LAYER_OPS`` does not turn it off (read once)."""
    global _ON
    if _ON is None:
        off = os.environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no")
        _ON = not off and load() is not None
    return _ON


def set_enabled(on: bool | None) -> None:
    """Turn the native ops on/off for this process (None: back to the environment's choice)."""
    global _ON
    _ON = None if on is None else bool(on) and load() is not None


def isa() -> str:
    """The path the library runs: ``"avx512"``, ``"portable"``, or ``"off"`` (torch formulas)."""
    if not enabled():
        return "off"
    return "avx512" if load().xllm_layer_ops_isa() == 1 else "portable"


def force_portable(on: bool) -> str:
    """Force the library's portable C path (True) or go back to the CPU's best (False; the
    portable C still where ``XLLM_VMM_CPU_HIDE`` hides ``avx512``)."""
    lib = load()
    if lib is None:
        raise ValueError(f"{LIB_NAME} is not built (python setup.py build_ext --inplace)")
    lib.xllm_layer_ops_set_isa(0 if on or _avx512_hidden() else 1)
    return isa()


def _avx512_hidden() -> bool:
    from xllm_vmm.engine import cpu_caps

    return cpu_caps.hides("avx512")


def _code(dtype: Any) -> int | None:
    import torch

    if dtype is torch.float32:
        return 0
    if dtype is torch.bfloat16:
        return 1
    return None


def _rows(t: Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of ``t`` seen as rows of its last dimension, or None when its rows
    are not at one stride with unit stride inside."""
    if t.dim() == 0 or t.stride(-1) != 1 and t.shape[-1] != 1:
        return None
    if t.is_contiguous():
        n = t.shape[-1]
        return (t.numel() // n if n else 0), n
    if t.dim() == 2:
        return t.shape[0], t.stride(0)
    return None


def supported(*tensors: Tensor) -> bool:
    """The native ops can take these tensors: on, CPU, one dtype (float32 or bfloat16), rows
    at one stride with unit stride inside."""
    if not enabled():
        return False
    dt = tensors[0].dtype
    for t in tensors:
        if t.device.type != "cpu" or t.dtype is not dt or _rows(t) is None:
            return False
    return _code(dt) is not None


def supported_heads(q: Tensor, k: Tensor) -> bool:
    """:func:`rope_` can take ``q`` (T, H, D) and ``k`` (T, Hkv, D): on, CPU, one dtype
    (float32 or bfloat16), unit stride inside a head, one head stride for both; token rows may
    sit at any stride (q/k/v as views of one fused product)."""
    if not enabled() or q.dtype is not k.dtype or _code(q.dtype) is None:
        return False
    return all(t.device.type == "cpu" and t.dim() == 3 and t.stride(2) == 1
               and t.stride(1) == q.stride(1) for t in (q, k))


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _check(what: str, *tensors: Tensor) -> int:
    if not supported(*tensors):
        desc = ", ".join(f"{tuple(t.shape)} {t.dtype} {t.device} stride {t.stride()}"
                         for t in tensors)
        raise ValueError(f"{what}: the native layer ops take CPU float32/bfloat16 tensors of one "
                         f"dtype with unit-stride rows (got {desc}; native ops "
                         f"{'on' if enabled() else 'off'})")
    return _code(tensors[0].dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, *,
             checked: bool = False) -> Tensor:
    """``weight * rms_norm(x)`` over the last dimension, a new tensor of ``x``'s shape; with
    ``residual`` (same shape): ``residual += x`` in place first and the norm is of the sum.
    ``checked``: the caller has just seen :func:`supported` hold for these tensors (the
    layers' hot path; the shapes are still checked)."""
    import torch

    if checked:
        dt = 1 if x.dtype is torch.bfloat16 else 0
    else:
        dt = _check("rms_norm", *((x, weight) if residual is None else (x, weight, residual)))
    h = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != h or (residual is not None
                                                     and residual.shape != x.shape):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} / residual "
                         f"{None if residual is None else tuple(residual.shape)} do not match "
                         f"x {tuple(x.shape)}")
    n, xs = _rows(x)
    out = empty_rows_like(x)  # padded rows for the product it feeds (row_buckets)
    if n == 0 or h == 0:
        return out
    rp, rs = (None, 0) if residual is None else (residual.data_ptr(), _rows(residual)[1])
    rc = load().xllm_rms_norm(out.data_ptr(), h, x.data_ptr(), xs, rp, rs, weight.data_ptr(),
                              n, h, float(eps), dt, _threads())
    if rc:
        raise ValueError(f"rms_norm: the native op refused x {tuple(x.shape)} (rc {rc})")
    return out


def silu_and_mul(gate: Tensor, up: Tensor, out: Tensor | None = None, *,
                 checked: bool = False) -> Tensor:
    """``silu(gate) * up`` (same shapes), into ``out`` (may be ``gate`` or ``up``; default a new
    tensor). ``checked``: :func:`supported` holds for ``gate`` and ``up`` and ``out`` is None,
    one of them, or a new contiguous tensor of their dtype (the MLP's hot path)."""
    import torch

    if out is None:  # padded rows for the down product (row_buckets)
        out = empty_rows_like(gate)
    if checked:
        dt = 1 if gate.dtype is torch.bfloat16 else 0
    else:
        dt = _check("silu_and_mul", gate, up, out)
    if gate.shape != up.shape or out.shape != gate.shape:
        raise ValueError(f"silu_and_mul: gate {tuple(gate.shape)}, up {tuple(up.shape)} and out "
                         f"{tuple(out.shape)} differ")
    n, gs = _rows(gate)
    if n == 0 or gate.shape[-1] == 0:
        return out
    rc = load().xllm_silu_and_mul(out.data_ptr(), _rows(out)[1], gate.data_ptr(), gs,
                                  up.data_ptr(), _rows(up)[1], n, gate.shape[-1], dt, _threads())
    if rc:
        raise ValueError(f"silu_and_mul: the native op refused gate {tuple(gate.shape)} (rc {rc})")
    return out


def rope_(positions: Tensor, q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor, *,
          neox: bool = True, checked: bool = False, q_out: Tensor | None = None) -> None:
    """Rotate ``q`` (T, Hq, D) and ``k`` (T, Hk, D) in place at ``positions`` (T,) int64: the
    first ``rot`` dims of every head, ``rot = cos.shape[1]`` (neox: rows hold ``rot`` entries,
    both halves read) or ``2 * cos.shape[1]`` (GPT-J: ``rot / 2`` entries, pairs ``(2i,
    2i+1)``). ``cos``/``sin`` (P, ·) contiguous tables in q's dtype; every position must be
    ``< P`` (checked unless ``checked``: the caller already knows it).

    ``q_out`` (a contiguous tensor of q's shape and dtype, not overlapping q or k): q's rotated
    heads are written there instead (dims past ``rot`` copied) and ``q`` is left as it is, one
    pass where a fused q/k/v product's strided q would otherwise be rotated and then copied for
    attention; k is still rotated in place."""
    import torch

    ts = (cos, sin)
    dt = _check("rope", *ts)
    if not (supported_heads(q, q if k is None else k) and q.dtype is cos.dtype):
        raise ValueError(f"rope: q {tuple(q.shape)} {q.dtype} stride {q.stride()} / k "
                         f"{None if k is None else (tuple(k.shape), k.dtype, k.stride())}: need "
                         f"CPU (T, H, D) tensors of the tables' dtype {cos.dtype} with unit-stride "
                         f"heads at one head stride (native ops {'on' if enabled() else 'off'})")
    if (q.dim() != 3 or (k is not None and (k.dim() != 3 or k.shape[0] != q.shape[0]
                                             or k.shape[2] != q.shape[2]
                                             or k.stride(1) != q.stride(1)))
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape != sin.shape
            or positions.dtype is not torch.int64 or not positions.is_contiguous()
            or positions.shape != (q.shape[0],) or positions.device.type != "cpu"
            or q.stride(2) != 1):
        raise ValueError(f"rope: q {tuple(q.shape)} stride {q.stride()}, k "
                         f"{None if k is None else (tuple(k.shape), k.stride())}, cos/sin "
                         f"{tuple(cos.shape)}, positions {tuple(positions.shape)} "
                         f"{positions.dtype}: need (T, H, D) q/k with one head stride, (T,) "
                         "int64 positions and contiguous tables")
    if not checked and positions.numel() and (int(positions.min()) < 0
                                              or int(positions.max()) >= cos.shape[0]):
        raise ValueError(f"rope: positions outside the cos/sin table of {cos.shape[0]} rows")
    rot = cos.shape[1] if neox else 2 * cos.shape[1]
    if rot > q.shape[2] or rot % 2:
        raise ValueError(f"rope: rotary dims {rot} do not fit head_dim {q.shape[2]}")
    if q_out is not None and (q_out.shape != q.shape or q_out.dtype is not q.dtype
                              or q_out.device.type != "cpu" or not q_out.is_contiguous()):
        raise ValueError(f"rope: q_out {tuple(q_out.shape)} {q_out.dtype} must be a contiguous "
                         f"CPU tensor of q's shape {tuple(q.shape)} and dtype {q.dtype}")
    if q.shape[0] == 0:
        return
    if q_out is not None:
        rc = load().xllm_rope_out(
            q_out.data_ptr(), q_out.stride(0), q_out.stride(1), q.data_ptr(), q.stride(0),
            q.shape[1], None if k is None else k.data_ptr(), 0 if k is None else k.stride(0),
            0 if k is None else k.shape[1], q.stride(1), q.shape[2], positions.data_ptr(),
            q.shape[0], cos.data_ptr(), sin.data_ptr(), cos.shape[1], rot, int(neox), dt,
            _threads())
        if rc:
            raise ValueError(f"rope: the native op refused q {tuple(q.shape)} (rc {rc})")
        return
    rc = load().xllm_rope(q.data_ptr(), q.stride(0), q.shape[1],
                          None if k is None else k.data_ptr(), 0 if k is None else k.stride(0),
                          0 if k is None else k.shape[1], q.stride(1), positions.data_ptr(),
                          q.shape[0], cos.data_ptr(), sin.data_ptr(), cos.shape[1], rot,
                          int(neox), dt, _threads())
    if rc:
        raise ValueError(f"rope: the native op refused q {tuple(q.shape)} (rc {rc})")


__all__ = ["ENV", "enabled", "force_portable", "isa", "load", "rms_norm", "rope_",
           "set_enabled", "silu_and_mul", "supported", "supported_heads"]
