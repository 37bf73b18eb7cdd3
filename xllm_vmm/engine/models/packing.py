"""oneDNN-prepacked linear weights, model by model (the ops: :mod:`xllm_vmm.engine.layers.packed`).

What is packed (:func:`pack_model`): the dense decoder's projections (q/k/v or their fused
product, o, gate/up or fused, down; each MoE expert's), and an untied LM head, of a model on
the CPU in bfloat16 at tensor-parallel world size 1, when oneDNN is available
and runs bfloat16 on this CPU (:func:`~xllm_vmm.engine.layers.packed.disabled_reason`: asked once of torch and a probe, never
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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from xllm_vmm.engine.layers.packed import disabled_reason, pack, packable

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


@dataclass(frozen=True)
class PackReport:
    """What :func:`pack_model` did: ``linears`` packed, ``weight_bytes`` their original bytes
    (each now held once, packed); ``reason`` when nothing was packed."""

    linears: int
    weight_bytes: int
    reason: str = ""


def packable_linears(model: Any) -> list[Any]:
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
    lins = [lin for lin in packable_linears(model) if packable(lin.weight)]
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


__all__ = ["PackReport", "pack_model", "packable_linears"]
