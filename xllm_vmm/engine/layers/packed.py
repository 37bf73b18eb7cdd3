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

What is packed (:func:`pack_model`): the dense decoder's projections (q/k/v or their fused
product, o, gate/up or fused, down; each MoE expert's), and an untied LM head, of a model on
the CPU in bfloat16 at tensor-parallel world size 1, when oneDNN is available
and runs bfloat16 on this CPU (:func:`disabled_reason`: asked once of torch and a probe, never
assumed; AVX2-only x86 has no oneDNN bfloat16 linear) and ``XLLM_VMM_PACKED_LINEAR`` is not
``0``. Only
plain weights: the caller (``Worker.create``) never packs pool weights (a packed copy is not
the pool's memory; sleep / wakeup / fork refer to the pool's addresses).

The packed copy *replaces* the original: the layer drops its weight (``weight`` None) and every
tensor of the weights mapping over the same memory is pointed at an empty storage
(``Tensor.set_``), so the process holds each weight once. The mapping then no longer holds
those tensors' values (their names stay, as empty tensors); nothing reads them after the build
(plain weights cannot sleep or fork). oneDNN's blocked size is the weight's bytes rounded up to
its blocks (``packed_bytes`` reports the originals' bytes; measured RSS growth of a pack:
1.00-1.03 × for the bench's shapes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

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


@dataclass(frozen=True)
class PackReport:
    """What :func:`pack_model` did: ``linears`` packed, ``weight_bytes`` their original bytes
    (each now held once, packed); ``reason`` when nothing was packed."""

    linears: int
    weight_bytes: int
    reason: str = ""


def _linears(model: Any) -> list[Any]:
    """The packable linear objects of a dense decoder (``decoder.Attention`` + ``GatedMLP`` /
    ``SparseMoE`` layers); others families' layers are left alone."""
    from xllm_vmm.engine.layers.linear import MergedColumnLinear, ReplicatedLinear
    from xllm_vmm.engine.layers.mlp import GatedMLP
    from xllm_vmm.engine.layers.moe import SparseMoE
    from xllm_vmm.engine.models.decoder import Attention

    out: list[Any] = []
    for layer in getattr(model, "layers", ()):
        attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
        if type(attn) is not Attention:
            continue
        out.extend([attn.qkv] if attn.qkv is not None else [attn.q_proj, attn.k_proj,
                                                              attn.v_proj])
        out.append(attn.o_proj)
        mlps = [mlp] if isinstance(mlp, GatedMLP) else (
            [e for e in mlp.experts if e is not None] if isinstance(mlp, SparseMoE) else [])
        for m in mlps:
            out.extend([m.gate_up] if m.gate_up is not None else [m.gate, m.up])
            out.append(m.down)
    return [lin for lin in out if isinstance(lin, (ReplicatedLinear, MergedColumnLinear))]


def pack_model(model: Any, weights: Mapping[str, Tensor]) -> PackReport:
    """Pack ``model``'s projections (module doc) whose weights are plain tensors of
    ``weights`` (the caller guarantees they are not the pool's), and release the originals."""
    import torch

    reason = disabled_reason()
    if reason:
        return PackReport(0, 0, reason)
    tp = getattr(model, "tp", None)
    if tp is not None and tp.world_size != 1:
        return PackReport(0, 0, "tensor parallel world size > 1: not packed")
    lins = [lin for lin in _linears(model) if packable(lin.weight)]
    head = getattr(model, "lm_head", None)
    if (head is not None and packable(head.weight) and head.tp.world_size == 1
            and head.weight.data_ptr() != model.embed.weight.data_ptr()):  # untied only
        lins.append(head)
    if not lins:
        return PackReport(0, 0, "no CPU bfloat16 projections")
    released: set[int] = set()
    nbytes = 0
    for lin in lins:
        w = lin.weight
        lin.packed = pack(w)
        released.add(w.untyped_storage().data_ptr())
        nbytes += w.numel() * w.element_size()
        lin.weight = None
    del w
    for lin in _parts_of(model):  # separate parts of fused products: drop their views too
        if lin.weight is not None and lin.weight.untyped_storage().data_ptr() in released:
            lin.weight = None
    empty = {}
    with torch.no_grad():
        for t in weights.values():
            if t.numel() and t.untyped_storage().data_ptr() in released:
                t.set_(empty.setdefault(t.dtype, torch.empty(0, dtype=t.dtype)))
    return PackReport(len(lins), nbytes)


def _parts_of(model: Any) -> list[Any]:
    """The separate part linears that a fused product stands for (q/k/v_proj, gate, up)."""
    from xllm_vmm.engine.layers.mlp import GatedMLP
    from xllm_vmm.engine.layers.moe import SparseMoE
    from xllm_vmm.engine.models.decoder import Attention

    out: list[Any] = []
    for layer in getattr(model, "layers", ()):
        attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
        if type(attn) is Attention:
            out += [attn.q_proj, attn.k_proj, attn.v_proj]
        mlps = [mlp] if isinstance(mlp, GatedMLP) else (
            [e for e in mlp.experts if e is not None] if isinstance(mlp, SparseMoE) else [])
        for m in mlps:
            out += [m.gate, m.up]
    return out


__all__ = ["ENV", "PackReport", "disabled_reason", "enabled", "linear", "pack", "pack_model",
           "packable"]
