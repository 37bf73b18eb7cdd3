"""Layer kernels the engine's speed work changed keep their numerics: the torch RMS norm (the
fallback of the native op) is bit-identical to ``h * rsqrt(mean(h^2) + eps)`` in float32 and
bfloat16 (hidden rows and per-head rows), and RoPE's per-step cos/sin lookup is reused only for the
same positions tensor. The native ops are tested in ``test_layers_native.py``."""

from __future__ import annotations

import pytest
import torch

from xllm_vmm.engine.layers.norm import rms_norm_torch as rms_norm
from xllm_vmm.engine.layers.rotary import RotaryEmbedding


def _reference(x, w, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 512), (64, 8, 64), (1, 96)])
def test_rms_norm_bit_identical(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), _reference(x, w, 1e-6))


def test_rotary_lookup_reused_per_positions_tensor():
    rope = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}, 64)
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    p1 = torch.tensor([0, 1, 2, 3, 4])
    a = rope.cos_sin(p1, torch.float32)
    assert rope.cos_sin(p1, torch.float32) is a
    p2 = torch.tensor([9, 8, 7, 6, 200])  # another tensor (and beyond the table: it grows)
    b = rope.cos_sin(p2, torch.float32)
    assert b is not a and torch.equal(b[0][0], rope._cos[9][None])
    fresh = RotaryEmbedding(16, {"rope_type": "default", "rope_theta": 10000.0}, 64)
    for x, y in zip(rope(p2, q, k), fresh(p2.clone(), q, k)):
        assert torch.equal(x, y)
