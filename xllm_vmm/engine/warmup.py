"""Start-up warm-up: compile the CPU's oneDNN products for the row buckets before serving.

A 16-bit product on the CPU is a oneDNN primitive JIT-compiled the first time its shape is
seen (:mod:`xllm_vmm.engine.row_buckets`): ~2 ms a primitive at decode sizes here, and the
first round of requests a fresh server sees pays for every bucket it meets (236 compilations
in the first ``bench serve`` round, against 8-80 in later ones). :func:`warm_products` runs each
distinct product of the model once per bucket, smallest first (decode batches, then prefill
chunks), up to the step's token budget and within a time budget, so the first requests find
them compiled. oneDNN's primitive cache is process-wide: the engine thread then reuses what
the start-up thread compiled.

What runs: one product per distinct signature (kind, input and output features, bias, dtype),
the dense decoder's q/k/v (fused or not), o, gate/up (fused or not), down, each MoE expert's
(one signature for all), and the LM head, over zero inputs of :func:`row_buckets.empty_rows`.
Nothing the engine holds changes (no KV is written, no request exists). Skipped, with the
reason, when nothing would be compiled per shape: float32 (MKL ``sgemm``), not the CPU, row
buckets off, tensor parallelism (exact row counts there), or a zero budget
(``XLLM_VMM_WARMUP_SECONDS=0``).

The time budget (:data:`DEFAULT_BUDGET_S`, or ``XLLM_VMM_WARMUP_SECONDS``) bounds start-up on a
large model, where a big bucket's products take seconds of compute: the buckets are warmed in
increasing size until the budget is spent, and the report says how far it got.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

ENV = "XLLM_VMM_WARMUP_SECONDS"
"""Seconds ``serve`` may spend warming products up at start (``0``: none)."""

DEFAULT_BUDGET_S = 10.0
"""The warm-up's default time budget, seconds (the bench Llama's whole warm-up to 10,240 rows
took ~7 s here on 2 cores, ~2 s of it compiling)."""


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warm_products` did: ``products`` distinct products run, ``buckets`` row
    buckets warmed (all of them when ``complete``), ``max_rows`` the largest warmed,
    ``seconds`` spent; ``reason`` when nothing ran."""

    products: int
    buckets: int
    max_rows: int
    seconds: float
    complete: bool
    reason: str = ""

    def line(self) -> str:
        """One line for the start-up output."""
        if self.reason:
            return f"warm-up: skipped ({self.reason})"
        extent = "all" if self.complete else "first"
        return (f"warm-up: {self.products} products x {extent} {self.buckets} row buckets "
                f"(up to {self.max_rows} rows) compiled in {self.seconds:.1f} s")


def budget_from_env(env: Mapping[str, str] | None = None,
                    default: float = DEFAULT_BUDGET_S) -> float:
    """``XLLM_VMM_WARMUP_SECONDS`` of ``env`` (default ``os.environ``) as seconds (``default``
    when unset); ``ValueError`` naming the variable when it is not a number >= 0."""
    raw = (os.environ if env is None else env).get(ENV, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r} is not a number of seconds (use e.g. {ENV}=10, "
                         f"or 0 for no warm-up)") from None
    if not value >= 0:
        raise ValueError(f"{ENV}={raw!r} must be >= 0 seconds (0: no warm-up)")
    return value


def _signature(lin: Any) -> tuple | None:
    """(kind, in, out, bias, dtype) of a product, or None when it has no weight to run."""
    packed = getattr(lin, "packed", None)
    w = packed if packed is not None else getattr(lin, "weight", None)
    if w is None or w.dim() != 2:
        return None
    bias = getattr(lin, "bias", None)
    return ("packed" if packed is not None else "dense", int(w.shape[1]), int(w.shape[0]),
            bias is not None, w.dtype)


def _products(model: Any) -> list[tuple[tuple, Any]]:
    """One ``(signature, callable)`` per distinct product of the model."""
    from xllm_vmm.engine.models.packing import packable_linears

    found: dict[tuple, Any] = {}
    for lin in packable_linears(model):
        sig = _signature(lin)
        if sig is not None:
            found.setdefault(sig, lin)
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(head, "tp", None) is not None and head.tp.world_size == 1:
        sig = _signature(head)
        if sig is not None:
            found.setdefault(sig, head)
    return list(found.items())


def _half_as_fp32(dtype: Any) -> bool:
    from xllm_vmm.engine.cpu_caps import half_as_fp32

    return half_as_fp32(dtype)


def warm_products(model: Any, max_rows: int, budget_s: float) -> WarmupReport:
    """Run each distinct product of ``model`` once over every row bucket up to ``max_rows``,
    smallest first, until ``budget_s`` seconds are spent (module doc)."""
    import torch

    from xllm_vmm.engine import row_buckets as rb

    dtype = getattr(model, "dtype", None)
    tp = getattr(model, "tp", None)
    reason = ""
    if budget_s <= 0:
        reason = f"{ENV}=0"
    elif not rb.enabled():
        reason = f"row buckets off ({rb.ENV}=0)"
    elif dtype not in (torch.bfloat16, torch.float16):
        reason = f"{str(dtype).replace('torch.', '')}: no per-shape compilation"
    elif _half_as_fp32(dtype):
        reason = (f"{str(dtype).replace('torch.', '')} products run in float32 here: "
                  "no per-shape compilation")
    elif tp is not None and tp.world_size > 1:
        reason = "tensor parallel: exact row counts"
    else:
        embed = getattr(getattr(model, "embed", None), "weight", None)
        if embed is not None and embed.device.type != "cpu":
            reason = f"device {embed.device.type}: not the CPU's oneDNN"
    products = [] if reason else _products(model)
    if not reason and not products:
        reason = "no products to warm"
    if reason:
        return WarmupReport(0, 0, 0, 0.0, False, reason)
    buckets = sorted({rb.padded_rows(n) for n in range(1, max(1, int(max_rows)) + 1)})
    t0 = time.monotonic()
    done = 0
    with torch.inference_mode():
        for rows in buckets:
            for (_kind, k, _n, _bias, dt), lin in products:
                x = rb.empty_rows(rows, (k,), dt)
                x.zero_()
                lin(x)
            done += 1
            if time.monotonic() - t0 >= budget_s:
                break
    return WarmupReport(len(products), done, buckets[done - 1], time.monotonic() - t0,
                        done == len(buckets))


__all__ = ["DEFAULT_BUDGET_S", "ENV", "WarmupReport", "budget_from_env", "warm_products"]
