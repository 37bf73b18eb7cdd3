"""Fused projections: q/k/v (and gate/up) as one matrix product over weights that lie back to
back in memory, never a copy of the weights the model was given.

Two halves:

- :func:`adjacent_rows` sees whether tensors of one storage follow each other with no gap
  (same dtype, device and trailing shape, contiguous) and returns one view over all of them;
  :class:`~xllm_vmm.engine.layers.linear.MergedColumnLinear` runs one ``linear`` over such a
  view and returns each part's output as a view of the product. Works on any weights,
  pool-backed ones included: the pool's image places each group together in product order,
  512-byte aligned (:func:`xllm_vmm.weights.image.placement_order`), so q/k/v and gate/up are
  adjacent whenever each part's bytes are a multiple of 512.
- :func:`colocate_projections` (plain weights only: never the pool's, which sleep / wakeup /
  fork refer to by address) re-lays each group — ``*.q_proj/k_proj/v_proj.{weight,bias}``,
  ``*.gate_proj/up_proj.{weight,bias}`` — into one new buffer and points the *same tensor
  objects* at their rows of it (``Tensor.set_``): the mapping still holds every name with the
  same values, the old separate buffers are freed (nothing is held twice), and byte counts do
  not change.

``XLLM_VMM_FUSED_PROJ=0`` turns both off (the separate products run: the reference in tests).
Families that name their projections differently (MLA's ``q_a_proj``/``kv_a_proj``, Qwen3-Next's
gated ``q_proj``) keep their separate products.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Sequence

# The grouping's one home is the weights image, which places the same groups together.
from xllm_vmm.weights.image import projection_groups

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

ENV = "XLLM_VMM_FUSED_PROJ"
"""``0``/``false``/``off``/``no``: separate q/k/v and gate/up products, no re-layout."""


def enabled() -> bool:
    """Fusion is on unless ``XLLM_VMM_FUSED_PROJ`` turns it off (read at each model build)."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "off", "no")


def adjacent_rows(parts: Sequence[Tensor]) -> Tensor | None:
    """One view of shape ``(sum of parts' dim 0, *trailing)`` over ``parts`` when they are
    contiguous tensors of one storage, dtype, device and trailing shape, each starting where
    the previous one ends; else None. Never copies."""
    if not parts:
        return None
    first = parts[0]
    ptr = first.data_ptr()
    base = first.untyped_storage().data_ptr()
    for p in parts:
        if (p.dtype != first.dtype or p.device != first.device or p.dim() != first.dim()
                or p.dim() == 0 or p.shape[1:] != first.shape[1:] or not p.is_contiguous()
                or p.requires_grad or p.untyped_storage().data_ptr() != base
                or p.data_ptr() != ptr):
            return None
        ptr += p.numel() * p.element_size()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def colocate_projections(weights: Mapping[str, Tensor]) -> int:
    """Re-lay every fusable group of *plain* tensors in ``weights`` into one buffer (module doc)
    and return the bytes moved. Groups already adjacent, of mixed dtypes / devices / trailing
    shapes, or holding a tensor that needs grad are left as they are. The caller guarantees the
    tensors are not pool-backed (the pool's addresses must not change)."""
    import torch

    if not enabled():
        return 0
    moved = 0
    with torch.no_grad():
        for names in projection_groups(list(weights)):
            parts = [weights[n] for n in names]
            first = parts[0]
            if adjacent_rows(parts) is not None or any(
                    p.dtype != first.dtype or p.device != first.device or p.dim() != first.dim()
                    or p.dim() == 0 or p.shape[1:] != first.shape[1:] or p.requires_grad
                    for p in parts):
                continue
            fused = torch.cat([p.reshape(p.shape[0], -1) for p in parts]).reshape(
                sum(p.shape[0] for p in parts), *first.shape[1:])
            storage, row = fused.untyped_storage(), first[0].numel() if first.dim() > 1 else 1
            offset = 0
            for p in parts:
                shape = tuple(p.shape)
                p.set_(storage, offset, shape, fused.stride())
                offset += shape[0] * row
                moved += p.numel() * p.element_size()
    return moved


__all__ = ["ENV", "adjacent_rows", "colocate_projections", "enabled", "projection_groups"]
