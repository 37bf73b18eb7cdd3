"""Token embedding and the LM head over referenced weights ``(vocab, hidden)``.

World size > 1 (issue 14): the vocabulary-parallel split of
:mod:`xllm_vmm.engine.distributed.vocab` (rows of the table per rank; masked lookup +
all-reduce for the embedding; the head's logit slices gathered to rank 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


def _vocab_rows(weight: Tensor, tp: TensorParallel) -> tuple[Tensor, int]:
    """This rank's rows of the table and the first row's token id (world size > 1)."""
    if tp.shard_hook is None:  # full table: a view of this rank's rows
        start, size = tp.shard(weight.shape[0], "vocab_size")
        return weight.narrow(0, start, size), start
    return weight, tp.rank * weight.shape[0]


class VocabEmbedding:
    def __init__(self, weight: Tensor, *, tp: TensorParallel = SINGLE) -> None:
        self.tp = tp
        self.weight = weight  # as given (a tied head reads it): the full table or this rank's rows
        if tp.world_size > 1:  # sharded path (issue 14)
            self.rows, self.vocab_start = _vocab_rows(weight, tp)

    def __call__(self, ids: Tensor) -> Tensor:
        import torch.nn.functional as F

        if self.tp.world_size > 1:
            from xllm_vmm.engine.distributed.vocab import embed

            return embed(ids, self.rows, self.vocab_start, self.tp)
        return F.embedding(ids, self.weight)


class LMHead:
    """``logits = hidden @ weight^T``; tied models pass the embedding table itself."""

    def __init__(self, weight: Tensor, *, tp: TensorParallel = SINGLE) -> None:
        self.tp = tp
        self.weight = weight
        if tp.world_size > 1:  # sharded path (issue 14)
            self.rows = _vocab_rows(weight, tp)[0]

    def __call__(self, hidden: Tensor) -> Tensor:
        import torch.nn.functional as F

        if self.tp.world_size > 1:  # full logits on rank 0 only
            from xllm_vmm.engine.distributed.vocab import gather_logits

            return gather_logits(F.linear(hidden, self.rows), self.tp)
        return F.linear(hidden, self.weight)
