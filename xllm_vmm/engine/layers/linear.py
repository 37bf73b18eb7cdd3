"""Linear layers over referenced weights, column- and row-parallel (``y = x W^T + b``).

A weight is ``(out_features, in_features)`` as Hugging Face stores it. Nothing is copied: a
shard (world size > 1) is a ``narrow`` view of the full tensor, which may view the
VMM arena.

Every dense product goes through :func:`dense`: ``F.linear``, except a CPU 16-bit product where
this CPU has no oneDNN kernels for that dtype (:func:`~xllm_vmm.engine.cpu_caps.bf16_compute`,
:func:`~xllm_vmm.engine.cpu_caps.fp16_compute`): that one runs in float32 over upcast copies
made per call and is rounded back to the 16-bit dtype, so the weights stay 16-bit (in the pool
or plain) and the product runs at float32's speed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xllm_vmm.engine.cpu_caps import half_as_fp32
from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel
from xllm_vmm.engine.row_buckets import on_padded_rows

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


def dense(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight^T + bias``: ``F.linear``, or in float32 over per-call upcasts for a CPU
    16-bit product where that dtype's products run in float32 (module doc)."""
    import torch.nn.functional as F

    if x.device.type == "cpu" and half_as_fp32(x.dtype):
        return F.linear(x.float(), weight.float(),
                        None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


class ReplicatedLinear:
    """The full weight on every rank (routers, small projections)."""

    packed: Tensor | None = None
    """oneDNN's packed copy when :func:`~xllm_vmm.engine.models.packing.pack_model` replaced the
    weight by it (``weight`` is then None)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            from xllm_vmm.engine.layers.packed import linear

            return linear(x, self.packed, self.bias)
        return on_padded_rows(dense, x, self.weight, self.bias)


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split across ranks: this rank computes rows
    ``[rank * out / world, (rank + 1) * out / world)`` of the weight (and bias).

    ``splits`` (e.g. ``(q_rows, k_rows, v_rows)`` of a fused projection) shards each part
    separately; unfused weights (the Hugging Face layout) use one part.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *,
                 tp: TensorParallel = SINGLE, what: str = "output features") -> None:
        if tp.world_size > 1 and tp.shard_hook is None:  # sharded path: a view of this rank's rows
            start, size = tp.shard(weight.shape[0], what)
            weight = weight.narrow(0, start, size)
            bias = bias.narrow(0, start, size) if bias is not None else None
        super().__init__(weight, bias)


class RowParallelLinear(ReplicatedLinear):
    """Input features split across ranks; partial outputs are summed with an all-reduce (the
    bias is added once, after the reduction). ``reduce=False`` leaves the partial sum to the
    caller (a MoE layer reduces once over all its experts)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *,
                 tp: TensorParallel = SINGLE, what: str = "input features",
                 reduce: bool = True) -> None:
        self.tp = tp
        self.reduce = reduce
        if tp.world_size > 1 and tp.shard_hook is None:  # sharded path: a (strided) view of this rank's columns
            start, size = tp.shard(weight.shape[1], what)
            weight = weight.narrow(1, start, size)
        super().__init__(weight, bias)

    def __call__(self, x: Tensor) -> Tensor:
        if self.tp.world_size == 1:
            return ReplicatedLinear.__call__(self, x)
        y = dense(x, self.weight)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class MergedColumnLinear:
    """Column-parallel projections of one input (q/k/v, gate/up) as one product:
    ``weight`` is a view over the parts' weights lying back to back
    (:func:`~xllm_vmm.engine.layers.fusion.adjacent_rows`), ``bias`` the same over their biases
    (or None); ``__call__`` returns each part's output, a view of one ``(T, sum(sizes))``
    product, in order. Build with :meth:`of`."""

    packed: Tensor | None = None  # as ReplicatedLinear.packed

    def __init__(self, weight: Tensor, bias: Tensor | None, sizes: tuple[int, ...]) -> None:
        self.weight = weight
        self.bias = bias
        self.sizes = sizes

    @classmethod
    def of(cls, parts: list[ReplicatedLinear]) -> MergedColumnLinear | None:
        """The fused form of ``parts`` (already this rank's shards), or None when their
        weights (or biases) are not adjacent in memory, only some have a bias, or fusion is
        off (``XLLM_VMM_FUSED_PROJ=0``): the caller then runs the parts one by one."""
        from xllm_vmm.engine.layers import fusion

        if not fusion.enabled():
            return None
        weight = fusion.adjacent_rows([p.weight for p in parts])
        if weight is None:
            return None
        biases = [p.bias for p in parts]
        bias = None
        if any(b is not None for b in biases):
            if any(b is None for b in biases):
                return None
            bias = fusion.adjacent_rows(biases)
            if bias is None:
                return None
        return cls(weight, bias, tuple(p.weight.shape[0] for p in parts))

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        if self.packed is not None:
            from xllm_vmm.engine.layers.packed import linear

            return linear(x, self.packed, self.bias).split(self.sizes, dim=-1)
        return on_padded_rows(dense, x, self.weight, self.bias).split(self.sizes, dim=-1)
