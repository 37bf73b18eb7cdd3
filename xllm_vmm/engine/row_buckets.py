"""Row counts rounded up to a bounded set of sizes, so the CPU's oneDNN products see few shapes.

Why: on the CPU a bfloat16/float16 product (``mkldnn._linear_pointwise`` over a packed weight,
or ``F.linear``'s oneDNN matmul) is a oneDNN primitive made for one exact shape. A new row
count ``M`` means a new primitive, JIT-compiled (measured here, bench Llama, 2 threads: 1-1.5 ms
at 128 rows, ~20 ms at 3,000) into fresh ``mmap``\\ed code pages, and oneDNN's primitive cache
keeps 1,024 of them. A server's steps have any number of tokens: over four rounds of
``bench serve`` the engine made 1,424 distinct product shapes (330 row counts), so the cache
overflowed and kept re-compiling: 366-435 primitives per round after the first, ~1 s of the
round's ~9.5 s of CPU, plus the kernel's page zeroing for the code and scratch pages (the
system time of the "bad rounds" in ``docs/benchmarks.md``).

What this module does: :func:`padded_rows` rounds a row count up to one of 8 sizes per octave
(exact up to 16; above, multiples of a power of two: at most 1/8 more rows, 96 sizes up to
16,384 tokens). The step's producers of a product's input (the RMS norms, SiLU-and-mul,
attention's output, a MoE expert's gathered rows) allocate that many rows
(:func:`empty_rows`) and hand on a view of the first ``n``; the products (:func:`on_padded_rows`)
run over the padded rows and return the first ``n`` rows of the result. The extra rows hold
whatever the allocator left there: a product's rows are independent, so they never reach a
real row, and they are dropped. Measured here, the padded rows cost 0-5 % of a product's CPU
(no copy is made); the bits of the real rows are unchanged (``tests/engine/test_row_buckets``).

Only CPU tensors of a 16-bit float dtype are padded: float32 products are MKL's ``sgemm``
(no per-shape JIT), and padding them could change which kernel runs and so their rounding;
nor are 16-bit ones where they run in float32 (:func:`~xllm_vmm.engine.cpu_caps.half_as_fp32`).
``XLLM_VMM_ROW_BUCKETS=0`` (or ``false``/``off``/``no``) switches padding off (for A/B runs).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

ENV = "XLLM_VMM_ROW_BUCKETS"
"""``0``/``false``/``off``/``no``: products run at the exact row count (no padding)."""

EXACT_UP_TO = 16
"""Row counts up to this are kept as they are (decode batches of a few sequences)."""

PER_OCTAVE = 8
"""Sizes per doubling above :data:`EXACT_UP_TO`: a padded count is at most ``1/8`` larger."""

_OCTAVE_BITS = PER_OCTAVE.bit_length() - 1  # log2(PER_OCTAVE)
_ON = os.environ.get(ENV, "").strip().lower() not in ("0", "false", "off", "no")
_PADDED_DTYPES: tuple[Any, ...] | None = None


def enabled() -> bool:
    """Padding is on (the default; ``XLLM_VMM_ROW_BUCKETS=0`` or :func:`set_enabled` off)."""
    return _ON


def set_enabled(on: bool) -> bool:
    """Switch padding on or off for this process (tests, A/B runs); returns the old setting."""
    global _ON
    old, _ON = _ON, bool(on)
    return old


def padded_rows(n: int) -> int:
    """``n`` rounded up to the next of the bounded sizes: ``n`` itself up to
    :data:`EXACT_UP_TO`, else a multiple of ``2**(k - 3)`` where ``2**k < n <= 2**(k + 1)``
    (8 sizes per octave; ``padded_rows(n) - n < n / 8``). Monotone and idempotent."""
    if n <= EXACT_UP_TO:
        return n
    step = 1 << ((n - 1).bit_length() - 1 - _OCTAVE_BITS)  # (n - 1).bit_length() = k + 1
    return -(-n // step) * step


def _padded_dtype(dtype: Any, device: Any) -> bool:
    global _PADDED_DTYPES
    if _PADDED_DTYPES is None:
        import torch

        _PADDED_DTYPES = (torch.bfloat16, torch.float16)
    if not (_ON and dtype in _PADDED_DTYPES and (device is None or str(device) == "cpu")):
        return False
    from xllm_vmm.engine.cpu_caps import half_as_fp32

    return not half_as_fp32(dtype)  # not where the dtype's products run in float32


def empty_rows(n: int, tail: tuple[int, ...], dtype: Any, device: Any = None) -> Tensor:
    """An uninitialised ``(n, *tail)`` tensor; for a padded dtype on the CPU it is the first
    ``n`` rows of a ``(padded_rows(n), *tail)`` one, so a product can run over its padded rows
    (:func:`on_padded_rows`) without a copy. Contiguous, storage offset 0, either way."""
    import torch

    rows = padded_rows(n) if _padded_dtype(dtype, device) else n
    t = torch.empty((rows, *tail), dtype=dtype, device=device)
    return t if rows == n else t[:n]


def empty_rows_like(x: Tensor) -> Tensor:
    """:func:`empty_rows` of ``x``'s shape (rows = its first dimension), dtype and device."""
    return empty_rows(x.shape[0], tuple(x.shape[1:]), x.dtype, x.device)


def widen(x: Tensor) -> Tensor:
    """``x`` (``(n, k)`` rows) seen over ``padded_rows(n)`` rows when it is a contiguous CPU
    16-bit tensor at storage offset 0 whose storage holds that many rows (an
    :func:`empty_rows` tensor or a product of one), else ``x`` itself."""
    n = x.shape[0]
    if x.dim() != 2 or not _padded_dtype(x.dtype, x.device):
        return x
    rows = padded_rows(n)
    if rows == n or x.storage_offset() != 0 or not x.is_contiguous():
        return x
    k = x.shape[1]
    if x.untyped_storage().nbytes() < rows * k * x.element_size():
        return x
    return x.as_strided((rows, k), (k, 1))


def on_padded_rows(fn: Callable[..., Tensor], x: Tensor, *args: Any) -> Tensor:
    """``fn(x, *args)`` (a row-wise product such as ``F.linear``) run over :func:`widen`\\ ``(x)``;
    returns the first ``x.shape[0]`` rows of the result (a contiguous view)."""
    xp = widen(x)
    y = fn(xp, *args)
    return y if xp is x else y[: x.shape[0]]


__all__ = ["ENV", "EXACT_UP_TO", "PER_OCTAVE", "empty_rows", "empty_rows_like", "enabled",
           "on_padded_rows", "padded_rows", "set_enabled", "widen"]
