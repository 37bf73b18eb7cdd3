"""oneDNN-prepacked linear weights for the CPU bfloat16 path.

``torch.ops.mkldnn._reorder_linear_weight`` lays a ``(out, in)`` weight out in oneDNN's blocked
format once; ``torch.ops.mkldnn._linear_pointwise`` then runs ``x W^T + b`` without the reorder
every call pays otherwise. Measured here (torch 2.13, 2 threads, CPU time per call, bf16, the
bench Llama's shapes): at 128 rows (a decode step) packed takes 0.61-0.69 of ``F.linear``
(fused q/k/v 197 -> 122 µs, gate/up 609 -> 373, down 277 -> 188, o 110 -> 68, the LM head
409 -> 281); at 2,048 rows (a prefill step) 0.90-1.04 (about equal). The results are the same
bits as ``F.linear``'s on every shape measured, so bf16 outputs do not move. float32 is not
packed: there it was 0.62-1.05 of ``F.linear`` and rounds differently (1e-6 relative), which
would move fp32's token-for-token equality with transformers.

The pass that packs a model's projections and releases the originals is
:func:`xllm_vmm.engine.models.packing.pack_model` (it walks the decoder's layers, so it lives
above them); this module holds the primitive ops the layers call.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

ENV = "XLLM_VMM_PACKED_LINEAR"
"""``0``/``false``/``off``/``no``: no packing (``F.linear`` over the weights as loaded)."""


def disabled_reason() -> str:
    """Why nothing is packed here (``""`` when packing runs): ``XLLM_VMM_PACKED_LINEAR=0``,
    bfloat16 products computed in float32 (:func:`~xllm_vmm.engine.cpu_caps.bf16_compute`), or
    oneDNN's bfloat16 linear not running on this CPU / torch build (torch's device check and a
    one-shot probe of the ops: :func:`~xllm_vmm.engine.cpu_caps.caps`)."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return f"{ENV}=0"
    from xllm_vmm.engine import cpu_caps

    c = cpu_caps.caps()
    if not c.onednn_bf16:
        return f"oneDNN bfloat16 linear unavailable: {c.onednn_bf16_reason}"
    if cpu_caps.bf16_as_fp32():
        return "bfloat16 products run in float32 (cpu_caps.bf16_compute)"
    return ""


def enabled() -> bool:
    """oneDNN's bfloat16 linear runs here and ``XLLM_VMM_PACKED_LINEAR`` allows it."""
    return not disabled_reason()


def packable(w: Tensor | None) -> bool:
    """A CPU bfloat16 2-D weight with rows and columns."""
    import torch

    return (w is not None and w.device.type == "cpu" and w.dtype is torch.bfloat16
            and w.dim() == 2 and w.numel() > 0 and not w.requires_grad)


def pack(w: Tensor) -> Tensor:
    """oneDNN's packed copy of ``w`` (``(out, in)``), for :func:`linear`."""
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ W^T + bias`` over a :func:`pack`\\ed ``W`` (``x`` ``(T, in)``; a new tensor, or the
    first ``T`` rows of one over ``x``'s padded rows: :mod:`xllm_vmm.engine.row_buckets`)."""
    from xllm_vmm.engine.row_buckets import on_padded_rows

    # over the producer's padded rows: one primitive per row bucket
    return on_padded_rows(_pointwise, x if x.is_contiguous() else x.contiguous(), packed, bias)


def _pointwise(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


__all__ = ["ENV", "disabled_reason", "enabled", "linear", "pack", "packable"]
