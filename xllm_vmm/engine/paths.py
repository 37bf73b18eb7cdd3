"""Which compute path each part takes on this CPU, as one record: the start-up log line of
``serve`` and ``generate``, the ``compute_paths`` field of the bench JSON, and the parser bench
serve reads the server's start-up output with. It asks the parts themselves (the packed
linear's report, :mod:`xllm_vmm.engine.cpu_caps`, the row buckets, the native attention
kernels and layer ops), so it sits above all of them."""

from __future__ import annotations

from typing import Any


def compute_paths(model: Any = None, backend: Any = None) -> dict[str, str]:
    """Which path each part takes here, for the start-up log and bench JSON: the packed linear
    (its :class:`~xllm_vmm.engine.models.packing.PackReport` when ``model`` has one), bfloat16
    compute, the row buckets, the native attention kernels (for ``model``'s dtype and head
    size) and the fused layer ops."""
    import torch

    from xllm_vmm.engine import row_buckets
    from xllm_vmm.engine.cpu_caps import bf16_compute, caps, fp16_compute
    from xllm_vmm.engine.layers import layer_ops

    c = caps()
    out: dict[str, str] = {"cpu_model": c.model, "torch_capability": c.torch_capability}
    if c.hidden:
        out["hidden"] = ",".join(sorted(c.hidden))
    rep = getattr(model, "packed", None)
    if rep is not None and hasattr(rep, "linears"):
        out["packed_linear"] = (f"on ({rep.linears} linears)" if rep.linears
                                else f"off ({rep.reason})")
    elif model is not None:  # the worker packs only plain CPU weights
        out["packed_linear"] = "off (weights in the pool, or not on the CPU)"
    mode, why = bf16_compute()
    out["bf16_compute"] = f"{mode} ({why})"
    mode, why = fp16_compute()
    out["fp16_compute"] = f"{mode} ({why})"
    out["row_buckets"] = "on" if row_buckets.enabled() else "off"
    out["layer_ops"] = layer_ops.isa()
    dtype = getattr(model, "dtype", None) or torch.bfloat16
    head_dim = getattr(getattr(model, "cfg", None), "head_dim", None) or 64
    try:
        from xllm_vmm.engine.attention import native_decode as nd
        from xllm_vmm.engine.attention import native_prefill as npf

        if nd.load() is None or nd._code(dtype) is None:
            out["attention_decode"] = out["attention_prefill"] = "torch"
        else:
            out["attention_decode"] = nd.implementation(dtype, dtype, head_dim)
            out["attention_prefill"] = npf.implementation(dtype, dtype, head_dim)
    except (ValueError, OSError, AttributeError):
        out["attention_decode"] = out["attention_prefill"] = "torch"
    name = getattr(backend, "name", None)
    if name:
        out["attention_backend"] = str(name)
    return out


def paths_line(paths: dict[str, str]) -> str:
    """One start-up line of :func:`compute_paths`."""
    return "compute paths: " + "; ".join(f"{k}={v}" for k, v in paths.items())


def parse_paths_line(line: str) -> dict[str, str] | None:
    """The :func:`compute_paths` record of a :func:`paths_line` (None when ``line`` is not one):
    bench serve reads the server's start-up output with it."""
    head = "compute paths: "
    at = line.find(head)
    if at < 0:
        return None
    out: dict[str, str] = {}
    for part in line[at + len(head):].strip().split("; "):
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value
    return out


__all__ = ["compute_paths", "parse_paths_line", "paths_line"]
