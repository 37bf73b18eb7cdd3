"""Token embedding and the LM head over referenced weights ``(vocab, hidden)``.

World size 1 today; the vocab-parallel split (issue 14: rows of the table per rank, masked
lookup + all-reduce for the embedding, all-gather of logits for the head) is the marked seam.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


class VocabEmbedding:
    def __init__(self, weight: Tensor, *, tp: TensorParallel = SINGLE) -> None:
        if tp.world_size > 1:  # sharded path (issue 14)
            raise NotImplementedError("vocab-parallel embedding (tensor parallel size > 1) is issue 14")
        self.weight = weight

    def __call__(self, ids: Tensor) -> Tensor:
        import torch.nn.functional as F

        return F.embedding(ids, self.weight)


class LMHead:
    """``logits = hidden @ weight^T``; tied models pass the embedding table itself."""

    def __init__(self, weight: Tensor, *, tp: TensorParallel = SINGLE) -> None:
        if tp.world_size > 1:  # sharded path (issue 14)
            raise NotImplementedError("vocab-parallel LM head (tensor parallel size > 1) is issue 14")
        self.weight = weight

    def __call__(self, hidden: Tensor) -> Tensor:
        import torch.nn.functional as F

        return F.linear(hidden, self.weight)
