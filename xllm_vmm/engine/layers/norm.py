"""RMS normalisation, computed in float32 as Hugging Face's ``LlamaRMSNorm`` does:
``w * (x / sqrt(mean(x^2) + eps))``, the product taken in the input dtype."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalise the last dimension of ``x``; the result has ``x``'s dtype."""
    import torch

    import torch.nn.functional as F

    dtype = x.dtype
    # torch's fused rms_norm over the float32 copy: bit-identical to
    # h * rsqrt(mean(h^2) + eps) (tests/engine/test_models_layers.py), one pass
    h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps)
    return weight * h.to(dtype)


class RMSNorm:
    """:func:`rms_norm` bound to a referenced weight (hidden norms, and Qwen3's per-head q/k
    norms over ``head_dim``)."""

    def __init__(self, weight: Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = eps

    def __call__(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)
