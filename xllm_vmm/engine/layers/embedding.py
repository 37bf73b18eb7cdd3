"""Token embedding and the LM head over referenced weights ``(vocab, hidden)``.

World size > 1: the vocabulary-parallel split of
:mod:`xllm_vmm.engine.distributed.vocab` (``ceil(V / W)`` rows of the table per rank, the last
rank's share shorter when ``W`` does not divide ``V``; masked lookup + all-reduce for the
embedding; the head's padded logit slices gathered to rank 0 and cut to ``V``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


def _vocab_rows(weight: Tensor, tp: TensorParallel) -> tuple[Tensor, int, int]:
    """This rank's rows of the table, the first row's token id and the full vocabulary size
    (world size > 1). A sharded table (``tp.shard_hook``) is this rank's rows already; its
    vocabulary size is ``tp.vocab_size``."""
    from xllm_vmm.engine.distributed.vocab import vocab_range

    if tp.shard_hook is None:  # full table: a view of this rank's rows
        vocab = weight.shape[0]
        start, stop = vocab_range(vocab, tp.rank, tp.world_size)
        return weight.narrow(0, start, stop - start), start, vocab
    vocab = tp.vocab_size
    if not vocab:
        raise ValueError("a sharded vocabulary table needs TensorParallel.vocab_size (the "
                         "model's vocab_size)")
    start, stop = vocab_range(vocab, tp.rank, tp.world_size)
    if weight.shape[0] != stop - start:
        raise ValueError(f"rank {tp.rank} holds {weight.shape[0]} vocabulary rows, the split "
                         f"of vocab_size={vocab} over {tp.world_size} gives it {stop - start}")
    return weight, start, vocab


class VocabEmbedding:
    def __init__(self, weight: Tensor, *, tp: TensorParallel = SINGLE) -> None:
        self.tp = tp
        self.weight = weight  # as given (a tied head reads it): the full table or this rank's rows
        if tp.world_size > 1:  # sharded path
            self.rows, self.vocab_start, _ = _vocab_rows(weight, tp)

    def __call__(self, ids: Tensor) -> Tensor:
        import torch.nn.functional as F

        if self.tp.world_size > 1:
            from xllm_vmm.engine.distributed.vocab import embed

            return embed(ids, self.rows, self.vocab_start, self.tp)
        return F.embedding(ids, self.weight)


class LMHead:
    """``logits = hidden @ weight^T``; tied models pass the embedding table itself. An untied
    head may be replaced by oneDNN's packed copy (``packed``; ``weight`` None then:
    :func:`~xllm_vmm.engine.models.packing.pack_model`)."""

    packed = None

    def __init__(self, weight: Tensor, *, tp: TensorParallel = SINGLE) -> None:
        self.tp = tp
        self.weight = weight
        if tp.world_size > 1:  # sharded path
            self.rows, _, self.vocab_size = _vocab_rows(weight, tp)

    def __call__(self, hidden: Tensor) -> Tensor:
        from xllm_vmm.engine.layers.linear import dense

        if self.tp.world_size > 1:  # full logits on rank 0 only
            from xllm_vmm.engine.distributed.vocab import gather_logits

            return gather_logits(dense(hidden, self.rows), self.tp, self.vocab_size)
        if self.packed is not None:
            from xllm_vmm.engine.layers.packed import linear

            return linear(hidden, self.packed, None)
        from xllm_vmm.engine.row_buckets import on_padded_rows

        return on_padded_rows(dense, hidden, self.weight)
