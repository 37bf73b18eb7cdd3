"""Vocabulary-parallel embedding and LM head, the one home of the vocabulary split.

Rank ``r`` of ``W`` holds rows ``[r * P, min((r + 1) * P, V))`` of the ``(V, hidden)`` table,
``P = ceil(V / W)`` (:func:`vocab_part`, :func:`vocab_range`): ``W`` need not divide ``V``
(as vLLM's ``VocabParallelEmbedding`` pads the vocabulary); only the last rank may hold fewer
than ``P`` rows, and every rank holds at least one (:func:`check_vocab`).

- embedding: ids outside this rank's rows look up row 0 and are zeroed, then the partial
  embeddings are summed over the ranks (an all-reduce): every rank ends with the full rows;
- head: each rank computes its ``(N, rows)`` slice of the logits, padded to ``(N, P)`` with
  ``-inf`` (a padded column is never a token); the slices are gathered to rank 0 only (the
  driver samples there) and cut to the ``V`` real columns — the padding is always the tail of
  the last slice; other ranks get their own (padded) slice back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.layers.parallel import TensorParallel


def vocab_part(vocab_size: int, world: int) -> int:
    """``P = ceil(V / W)``: the rows of every rank's (padded) share of the vocabulary."""
    return -(-int(vocab_size) // int(world))


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of the vocabulary rows rank ``rank`` of ``world`` holds."""
    part = vocab_part(vocab_size, world)
    return min(rank * part, vocab_size), min((rank + 1) * part, vocab_size)


def check_vocab(vocab_size: int, world: int) -> str | None:
    """Why ``world`` ranks cannot split a vocabulary of ``vocab_size`` rows (a rank would hold
    none), or None."""
    start, stop = vocab_range(vocab_size, world - 1, world)
    if stop <= start:
        return (f"{world} workers cannot split vocab_size={vocab_size}: with "
                f"{vocab_part(vocab_size, world)} rows per worker the last holds none")
    return None


def embed(ids: Tensor, weight: Tensor, start: int, tp: TensorParallel) -> Tensor:
    """Rows of ``ids`` from this rank's ``weight`` (rows ``start..``), summed over ranks."""
    import torch.nn.functional as F

    rows = weight.shape[0]
    local = ids - start
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out.masked_fill_(outside.unsqueeze(-1), 0)
    return tp.all_reduce(out)


def gather_logits(part: Tensor, tp: TensorParallel, vocab_size: int) -> Tensor:
    """``(N, V)`` on rank 0 (slices in rank order, padding cut), this rank's padded ``(N, P)``
    slice elsewhere (``V = vocab_size``)."""
    import torch
    import torch.nn.functional as F

    from xllm_vmm.engine.distributed import deadline
    from xllm_vmm.engine.distributed.comm_stats import COMM

    pad = vocab_part(vocab_size, tp.world_size) - part.shape[-1]
    part = F.pad(part, (0, pad), value=float("-inf")) if pad else part.contiguous()
    t0 = time.perf_counter()
    if tp.rank == 0:
        bufs = [torch.empty_like(part) for _ in range(tp.world_size)]
        deadline.gather(part, bufs, tp.group, tp.abort)
        out = torch.cat(bufs, dim=-1)[..., :vocab_size]
    else:
        deadline.gather(part, None, tp.group, tp.abort)
        out = part
    COMM.add("logits_gather", time.perf_counter() - t0, part.numel() * part.element_size())
    return out
