"""What this CPU and this torch build can run, asked once (the record of which path each part
takes is :mod:`xllm_vmm.engine.paths`).

Every CPU compute path that assumes an instruction set is chosen from :func:`caps`:

- the packed oneDNN linear (:mod:`xllm_vmm.engine.layers.packed`) and bfloat16 compute run
  only where torch's oneDNN bfloat16 kernels run here: torch's own device check
  (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: AVX-512 BW/VL/DQ or AVX-NE-CONVERT) and a
  one-shot probe of ``mkldnn._reorder_linear_weight`` on a tiny weight;
- elsewhere a bfloat16 checkpoint keeps its bfloat16 weights (in the pool, or plain) and each
  product runs in float32 over upcast copies made per call (:func:`bf16_compute` ``"fp32"``):
  measured under torch's AVX2 dispatch, a bfloat16 product there runs at 27-48 GFLOP/s and the
  per-call upcast at 97-178, about float32's own speed (``docs/engine.md``), and the weights'
  memory stays bfloat16's;
- a float16 checkpoint likewise computes in float32 over per-call upcasts where torch's oneDNN
  float16 kernels do not run (``torch.ops.mkldnn._is_mkldnn_fp16_supported``: AVX512-FP16 or
  AMX-FP16): torch's float16 gemm there measured 13-20 GFLOP/s against 55-180 for the upcast
  product, on AVX-512 CPUs without AVX512-FP16 as well as under AVX2 (:func:`fp16_compute`);
- the native attention and layer kernels (``native/paged_attn.c``, ``native/layer_ops.c``)
  dispatch on the CPU themselves; a hidden ``avx512`` makes them take their portable C, a
  hidden ``amx`` keeps the AVX-512 form of the attention scores.

``XLLM_VMM_CPU_HIDE`` (a comma list of :data:`HIDEABLE`) hides capabilities this CPU has, so
tests and comparisons run the paths of a smaller CPU on a bigger one: ``avx512`` (and with it
``avx512_bf16`` and ``amx``, which need it), ``avx512_bf16``, ``amx``, ``avx_ne_convert``.
Torch's own kernels still dispatch on torch's capability (``ATEN_CPU_CAPABILITY=avx2`` caps
them, read by torch at import). ``XLLM_VMM_BF16_COMPUTE`` (``bf16`` / ``fp32``) and
``XLLM_VMM_FP16_COMPUTE`` (``fp16`` / ``fp32``) override the 16-bit compute choices.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any

HIDE_ENV = "XLLM_VMM_CPU_HIDE"
"""Comma-separated capabilities to treat as absent (:data:`HIDEABLE`)."""

BF16_ENV = "XLLM_VMM_BF16_COMPUTE"
"""``bf16``: bfloat16 products in bfloat16; ``fp32``: in float32 over per-call upcasts;
unset/``auto``: :func:`bf16_compute`'s choice from the CPU."""

FP16_ENV = "XLLM_VMM_FP16_COMPUTE"
"""``fp16``: float16 products in float16; ``fp32``: in float32 over per-call upcasts;
unset/``auto``: :func:`fp16_compute`'s choice from the CPU."""

HIDEABLE = ("avx512", "avx512_bf16", "amx", "avx_ne_convert")
"""Capabilities :data:`HIDE_ENV` may hide."""

_IMPLIED = {"avx512": ("avx512_bf16", "amx")}  # hiding AVX-512 hides what builds on it

_FLAG_GROUPS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_tile"),
    "avx_ne_convert": ("avx_ne_convert",),
    "avx2": ("avx2", "fma"),
}


def parse_hidden(raw: str | None) -> frozenset[str]:
    """The capabilities of a :data:`HIDE_ENV` value, with the ones they imply; ``ValueError``
    naming the variable and the accepted values for anything else."""
    names = [p.strip().lower() for p in (raw or "").split(",") if p.strip()]
    bad = [n for n in names if n not in HIDEABLE]
    if bad:
        raise ValueError(f"{HIDE_ENV}={raw!r}: unknown capability {', '.join(map(repr, bad))} "
                         f"(accepted: {', '.join(HIDEABLE)}, comma-separated)")
    out = set(names)
    for n in names:
        out.update(_IMPLIED.get(n, ()))
    return frozenset(out)


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in ``/proc/cpuinfo`` (x86 ``flags``, Arm
    ``Features``); the platform's processor string and no flags where it cannot be read."""
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine() or "unknown", flags


def _torch_bf16_check() -> bool:
    """Torch's own oneDNN bfloat16 device check (False where this torch has none)."""
    import torch

    try:
        if not torch.backends.mkldnn.is_available():
            return False
        fn = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(fn()) if fn is not None else True
    except (AttributeError, RuntimeError):
        return False


def _torch_fp16_check() -> bool:
    """Torch's own oneDNN float16 device check (AVX512-FP16 or AMX-FP16; False where this torch
    has none)."""
    import torch

    try:
        if not torch.backends.mkldnn.is_available():
            return False
        fn = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
        return bool(fn()) if fn is not None else False
    except (AttributeError, RuntimeError):
        return False


def _probe_packed_bf16() -> str:
    """``""`` when oneDNN's packed bfloat16 linear runs here (a tiny weight packed), else the
    reason it does not."""
    import torch

    try:  # the reorder is where a CPU without the ISA fails; no product is compiled here
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
        if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            return "this torch has no mkldnn._linear_pointwise"
        return ""
    except (AttributeError, RuntimeError) as e:  # no such op, or the CPU lacks the ISA
        return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


@dataclass(frozen=True)
class CpuCaps:
    """What this CPU (less :data:`HIDE_ENV`'s hidden capabilities) and torch build support."""

    model: str
    flags: frozenset[str] = field(repr=False)
    torch_capability: str
    hidden: frozenset[str]
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool
    avx_ne_convert: bool
    onednn_bf16: bool
    """torch's oneDNN bfloat16 kernels (``F.linear``'s matmul, the packed linear) run here."""
    onednn_bf16_reason: str = ""
    """Why not, when ``onednn_bf16`` is False."""
    onednn_fp16: bool = False
    """torch's oneDNN float16 kernels run here (AVX512-FP16 or AMX-FP16)."""

    @property
    def native_bf16(self) -> bool:
        """The CPU does bfloat16 arithmetic in hardware (AVX-512-BF16, AMX or AVX-NE-CONVERT)."""
        return self.avx512_bf16 or self.amx or self.avx_ne_convert

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (bench output)."""
        return {"cpu_model": self.model, "torch_capability": self.torch_capability,
                "hidden": sorted(self.hidden), "avx2": self.avx2, "avx512": self.avx512,
                "avx512_bf16": self.avx512_bf16, "amx": self.amx,
                "avx_ne_convert": self.avx_ne_convert, "onednn_bf16": self.onednn_bf16,
                "onednn_fp16": self.onednn_fp16}


_CAPS: CpuCaps | None = None


def detect(hidden: frozenset[str] | None = None) -> CpuCaps:
    """Ask the CPU and torch (no cache; :func:`caps` caches). ``hidden`` None reads
    :data:`HIDE_ENV`."""
    import torch

    if hidden is None:
        hidden = parse_hidden(os.environ.get(HIDE_ENV))
    model, flags = _cpuinfo()

    def has(group: str) -> bool:
        return group not in hidden and all(f in flags for f in _FLAG_GROUPS[group])

    avx512 = has("avx512")
    ne_convert = has("avx_ne_convert")
    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        capability = "unknown"
    reason = ""
    if hidden and not (avx512 or ne_convert) and "sse2" in flags:  # x86 with them hidden
        reason = (f"no AVX-512 BW/VL/DQ or AVX-NE-CONVERT ({HIDE_ENV} hides "
                  f"{','.join(sorted(hidden))})")
    elif not _torch_bf16_check():
        reason = "torch's oneDNN bfloat16 device check fails (torch.ops.mkldnn)"
    else:
        reason = _probe_packed_bf16()
    return CpuCaps(model=model, flags=flags, torch_capability=capability, hidden=hidden,
                   avx2=has("avx2"), avx512=avx512, avx512_bf16=avx512 and has("avx512_bf16"),
                   amx=avx512 and has("amx"), avx_ne_convert=ne_convert,
                   onednn_bf16=not reason, onednn_bf16_reason=reason,
                   onednn_fp16=not hidden.intersection(("avx512",)) and _torch_fp16_check())


def caps() -> CpuCaps:
    """This process's :class:`CpuCaps` (detected once; :func:`reset` forgets it)."""
    global _CAPS
    if _CAPS is None:
        _CAPS = detect()
    return _CAPS


def reset(hidden: str | None = None) -> CpuCaps:
    """Detect again with ``hidden`` (a :data:`HIDE_ENV` value; None: the environment's) and
    refresh the choices cached from it (tests force paths this way)."""
    global _CAPS
    _CAPS = detect(None if hidden is None else parse_hidden(hidden))
    _AS_FP32.clear()
    return _CAPS


def hides(name: str) -> bool:
    """``name`` (:data:`HIDEABLE`) is hidden by :data:`HIDE_ENV` (or :func:`reset`)."""
    return name in caps().hidden


_AS_FP32: dict[Any, bool] = {}
"""Per dtype, whether its CPU products run in float32 (:func:`half_as_fp32`'s cache; the
setters force an entry, :func:`reset` clears them)."""


def _forced(env: str, native: tuple[str, ...]) -> tuple[str, str] | None:
    """The choice ``env`` forces (``native[0]`` or ``fp32``), None for unset/``auto``;
    ``ValueError`` naming the variable for anything else."""
    raw = os.environ.get(env, "").strip().lower()
    if raw in native:
        return native[0], f"{env}={raw}"
    if raw in ("fp32", "float32"):
        return "fp32", f"{env}={raw}"
    if raw not in ("", "auto"):
        raise ValueError(f"{env}={raw!r} is not one of {native[0]}, fp32, auto")
    return None


def bf16_compute() -> tuple[str, str]:
    """``("bf16" | "fp32", why)``: how a CPU product of bfloat16 operands runs. ``bf16`` where
    torch's oneDNN bfloat16 kernels run (:attr:`CpuCaps.onednn_bf16`); ``fp32`` (float32 over
    per-call upcasts of the bfloat16 weights) elsewhere, where torch's portable bfloat16 gemm
    measured 2.8-4.8x slower than that (module doc). :data:`BF16_ENV` overrides."""
    forced = _forced(BF16_ENV, ("bf16", "bfloat16"))
    if forced is not None:
        return forced
    c = caps()
    if c.onednn_bf16:
        return "bf16", "oneDNN bfloat16 kernels run on this CPU"
    return "fp32", f"no oneDNN bfloat16 here: {c.onednn_bf16_reason}"


def bf16_as_fp32() -> bool:
    """CPU bfloat16 products run in float32 (:func:`bf16_compute`; cached, :func:`reset`)."""
    import torch

    return half_as_fp32(torch.bfloat16)


def set_bf16_as_fp32(on: bool | None) -> bool | None:
    """Force the bfloat16 compute choice for this process (None: back to :func:`bf16_compute`);
    returns the old cached value."""
    import torch

    return _force(torch.bfloat16, on)


def fp16_compute() -> tuple[str, str]:
    """``("fp16" | "fp32", why)``: how a CPU product of float16 operands runs. ``fp16`` where
    torch's oneDNN float16 kernels run (:attr:`CpuCaps.onednn_fp16`: AVX512-FP16 or AMX-FP16);
    ``fp32`` (float32 over per-call upcasts of the float16 weights) elsewhere, where torch's
    float16 gemm measured 3-12x slower than that (module doc). :data:`FP16_ENV` overrides."""
    forced = _forced(FP16_ENV, ("fp16", "float16"))
    if forced is not None:
        return forced
    if caps().onednn_fp16:
        return "fp16", "oneDNN float16 kernels run on this CPU"
    return "fp32", "no oneDNN float16 here (AVX512-FP16 or AMX-FP16)"


def fp16_as_fp32() -> bool:
    """CPU float16 products run in float32 (:func:`fp16_compute`; cached, :func:`reset`)."""
    import torch

    return half_as_fp32(torch.float16)


def set_fp16_as_fp32(on: bool | None) -> bool | None:
    """Force the float16 compute choice for this process (None: back to :func:`fp16_compute`);
    returns the old cached value."""
    import torch

    return _force(torch.float16, on)


def _force(dtype: Any, on: bool | None) -> bool | None:
    old = _AS_FP32.get(dtype)
    if on is None:
        _AS_FP32.pop(dtype, None)
    else:
        _AS_FP32[dtype] = on
    return old


def half_as_fp32(dtype: Any) -> bool:
    """A CPU product of ``dtype`` operands runs in float32 over per-call upcasts: bfloat16 where
    :func:`bf16_compute` says so, float16 where :func:`fp16_compute` does; False for any other
    dtype. One dictionary lookup once cached (every dense product asks)."""
    got = _AS_FP32.get(dtype)
    if got is None:
        import torch

        if dtype is torch.bfloat16:
            got = bf16_compute()[0] == "fp32"
        elif dtype is torch.float16:
            got = fp16_compute()[0] == "fp32"
        else:
            got = False
        _AS_FP32[dtype] = got
    return got


__all__ = ["BF16_ENV", "CpuCaps", "FP16_ENV", "HIDEABLE", "HIDE_ENV", "bf16_as_fp32",
           "bf16_compute", "caps", "detect", "fp16_as_fp32", "fp16_compute", "half_as_fp32",
           "hides", "parse_hidden", "reset", "set_bf16_as_fp32", "set_fp16_as_fp32"]
