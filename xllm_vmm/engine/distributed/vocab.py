"""Vocabulary-parallel embedding and LM head (rank ``r`` of ``W`` holds rows
``[r * V / W, (r + 1) * V / W)`` of the ``(V, hidden)`` table; ``W`` divides ``V``).

- embedding: ids outside this rank's rows look up row 0 and are zeroed, then the partial
  embeddings are summed over the ranks (an all-reduce): every rank ends with the full rows;
- head: each rank computes its ``(N, V / W)`` slice of the logits; the slices are gathered to
  rank 0 only (the driver samples there); other ranks get their own slice back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.layers.parallel import TensorParallel


def embed(ids: Tensor, weight: Tensor, start: int, tp: TensorParallel) -> Tensor:
    """Rows of ``ids`` from this rank's ``weight`` (rows ``start..``), summed over ranks."""
    import torch.nn.functional as F

    rows = weight.shape[0]
    local = ids - start
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out.masked_fill_(outside.unsqueeze(-1), 0)
    return tp.all_reduce(out)


def gather_logits(part: Tensor, tp: TensorParallel) -> Tensor:
    """``(N, V)`` on rank 0 (slices in rank order), this rank's ``(N, V / W)`` elsewhere."""
    import torch

    from xllm_vmm.engine.distributed import deadline
    from xllm_vmm.engine.distributed.comm_stats import COMM

    part = part.contiguous()
    t0 = time.perf_counter()
    if tp.rank == 0:
        bufs = [torch.empty_like(part) for _ in range(tp.world_size)]
        deadline.gather(part, bufs, tp.group, tp.abort)
        out = torch.cat(bufs, dim=-1)
    else:
        deadline.gather(part, None, tp.group, tp.abort)
        out = part
    COMM.add("logits_gather", time.perf_counter() - t0, part.numel() * part.element_size())
    return out
