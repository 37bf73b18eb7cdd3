"""RMS normalisation, computed in float32 as Hugging Face's ``LlamaRMSNorm`` does:
``w * (x / sqrt(mean(x^2) + eps))``, the product taken in the input dtype; and vLLM's
``fused_add_rms_norm`` (``residual += x``, then the norm of the sum), the pre-norm decoder's
residual pattern.

Both run as one native pass (``layer_ops``, ``native/layer_ops.c``) when the tensors fit it
(CPU, float32/bfloat16, the weight in the activations' dtype), else as the torch formula below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xllm_vmm.engine.layers import layer_ops

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The torch formula (the reference of the native op, and the fallback)."""
    import torch

    import torch.nn.functional as F

    dtype = x.dtype
    # torch's fused rms_norm over the float32 copy: bit-identical to
    # h * rsqrt(mean(h^2) + eps) (tests/engine/test_models_layers.py), one pass
    h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps)
    return weight * h.to(dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalise the last dimension of ``x``; the result has ``x``'s dtype (a new tensor)."""
    if layer_ops.supported(x, weight):
        return layer_ops.rms_norm(x, weight, eps, checked=True)
    if x.dim() > 2 and x.stride(-1) == 1 and not x.is_contiguous():
        # heads of a fused q/k/v product (token rows at the product's stride): one copy, then
        # the same native pass the separate products' contiguous q/k take
        xc = x.contiguous()
        if layer_ops.supported(xc, weight):
            return layer_ops.rms_norm(xc, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``residual += x`` (in place, rounded to the dtype as ``x + residual`` is), then
    :func:`rms_norm` of the new ``residual`` (a new tensor)."""
    if layer_ops.supported(x, weight, residual) and x.shape == residual.shape:
        return layer_ops.rms_norm(x, weight, eps, residual=residual, checked=True)
    residual.add_(x)
    return rms_norm(residual, weight, eps)


class RMSNorm:
    """:func:`rms_norm` bound to a referenced weight (hidden norms, and Qwen3's per-head q/k
    norms over ``head_dim``)."""

    def __init__(self, weight: Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = eps

    def __call__(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: Tensor, residual: Tensor) -> Tensor:
        """:func:`add_rms_norm`: ``residual += x`` in place, returns the norm of the sum."""
        return add_rms_norm(x, residual, self.weight, self.eps)
