"""Tensor parallelism as the layers see it: a rank, a world size, and the collectives.

World size 1 is the only configuration that runs today (every collective is the identity).
The sharded path is marked where it lives: column-parallel layers take rows
``[rank * n / world, (rank + 1) * n / world)`` of a weight as a *view* (no copy; the weight
tensor may view the arena), row-parallel layers take the matching columns and all-reduce their
output over ``group`` (``torch.distributed``: gloo on CPU, NCCL on CUDA, HCCL on NPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorParallel:
    """``rank`` of ``world_size`` tensor-parallel workers; ``group`` is the process group
    (None: the default group) used by :meth:`all_reduce` when ``world_size > 1``."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    shard_hook: Any = None
    """The ``shard(name, shape)`` hook the weights were loaded with
    (:func:`xllm_vmm.engine.distributed.sharding.shard_hook`): the layers' tensors are already
    this rank's part and are used as they are. None: full tensors, narrowed by the layers."""
    ep_size: int = 1
    """Expert-parallel groups (``ep_size``): rank ``r`` holds the routed experts of group
    ``r // (world_size / ep_size)`` only (:meth:`expert_range`; their weights come sharded by
    ``shard_hook``, which is required when ``ep_size > 1``)."""
    vocab_size: int = 0
    """The model's full vocabulary when ``shard_hook`` splits the embedding and head tables
    (:func:`xllm_vmm.engine.distributed.vocab.vocab_range`); 0: unknown (full tables)."""
    abort: Any = None
    """Rank 0 of a worker set: the runtime's ``threading.Event`` set when a worker is lost;
    a collective waiting on a silent worker then ends at once
    (:mod:`xllm_vmm.engine.distributed.deadline`). None: wait as ``torch.distributed`` does."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor parallel rank {self.rank} of world size {self.world_size}: "
                             "need world_size >= 1 and 0 <= rank < world_size")
        if self.ep_size < 1 or self.world_size % self.ep_size or (
                self.ep_size > 1 and self.shard_hook is None):
            raise ValueError(f"ep_size {self.ep_size} must divide the world size "
                             f"{self.world_size} (and ep_size > 1 needs the shard hook)")

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """``(start, size)`` of this rank's share of ``n`` (heads, rows, experts); ``what``
        names the split dimension in the error when ``world_size`` does not divide ``n``."""
        if n % self.world_size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor parallel size "
                             f"{self.world_size}")
        size = n // self.world_size
        return self.rank * size, size

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """``[first, stop)`` of the routed experts this rank holds (all at ``ep_size`` 1)."""
        if self.ep_size == 1:
            return 0, num_experts
        from xllm_vmm.engine.distributed.sharding import expert_range

        return expert_range(num_experts, self.rank, self.world_size, self.ep_size)

    def held_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this rank holds of tensor ``name`` whose full shape is ``shape``."""
        if self.shard_hook is None:
            return tuple(shape)
        from xllm_vmm.engine.distributed.sharding import held_shape

        return held_shape(self.shard_hook, name, shape)

    def all_reduce(self, x):
        """Sum ``x`` over the ranks in place (identity at world size 1)."""
        if self.world_size == 1:
            return x
        from xllm_vmm.engine.distributed import deadline  # sharded path
        from xllm_vmm.engine.distributed.comm_stats import COMM

        t0 = time.perf_counter()
        deadline.all_reduce(x, self.group, self.abort)
        COMM.add("all_reduce", time.perf_counter() - t0, x.numel() * x.element_size())
        return x


SINGLE = TensorParallel()
"""World size 1: the default of every layer."""
