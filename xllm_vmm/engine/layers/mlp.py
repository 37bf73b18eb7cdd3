"""The SiLU-gated feed-forward of Llama / Qwen: ``down(silu(gate(x)) * up(x))``.

Gate and up are one product when their weights lie back to back
(:class:`~.linear.MergedColumnLinear`; plain weights are re-laid so at load), two otherwise.

``silu(g) * u`` is one native pass into ``g``'s memory (``layer_ops.silu_and_mul``) when the
tensors fit it, else torch's in-place ``silu_`` then ``mul_`` (the same roundings)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xllm_vmm.engine.layers import layer_ops
from xllm_vmm.engine.layers.linear import (ColumnParallelLinear, MergedColumnLinear,
                                           RowParallelLinear)
from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

ACTIVATIONS = ("silu",)


def check_activation(name: str) -> None:
    """Only SiLU gating is implemented; anything else is named with what is supported."""
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")


class GatedMLP:
    """Gate and up are column-parallel, down is row-parallel (intermediate features split)."""

    def __init__(self, gate: Tensor, up: Tensor, down: Tensor, *, tp: TensorParallel = SINGLE,
                 gate_bias: Tensor | None = None, up_bias: Tensor | None = None,
                 down_bias: Tensor | None = None, reduce: bool = True) -> None:
        self.gate = ColumnParallelLinear(gate, gate_bias, tp=tp, what="intermediate_size")
        self.up = ColumnParallelLinear(up, up_bias, tp=tp, what="intermediate_size")
        self.down = RowParallelLinear(down, down_bias, tp=tp, what="intermediate_size",
                                      reduce=reduce)
        self.gate_up = MergedColumnLinear.of([self.gate, self.up])  # None: two products

    def __call__(self, x: Tensor) -> Tensor:
        import torch.nn.functional as F

        if self.gate_up is not None:  # g, u: views of one (T, 2 * I) product
            g, u = self.gate_up(x)
            if layer_ops.supported(g, u):  # into a new contiguous (T, I) for the down product
                return self.down(layer_ops.silu_and_mul(g, u, checked=True))
            return self.down(F.silu(g).mul_(u))
        g, u = self.gate(x), self.up(x)
        if layer_ops.supported(g, u):
            return self.down(layer_ops.silu_and_mul(g, u, out=g, checked=True))
        # in place: no extra (T, intermediate) temporaries
        return self.down(F.silu(g, inplace=True).mul_(u))
