"""Sparse mixture of experts with top-k routing (Qwen3-MoE; transformers' semantics).

Per token: ``p = softmax(router(x))`` in float32, the ``top_k`` largest ``p`` select experts,
renormalised to sum 1 when ``norm_topk_prob``, cast to the activations' dtype; the output is
``sum_k p_k * expert_k(x)`` where each expert is a :class:`~.mlp.GatedMLP`. Experts are run
once each over the tokens routed to them (gather, compute, ``index_add_``), never over the
whole batch.

Tensor parallel: each expert's intermediate features split like a dense MLP; the
all-reduce is deferred to once per layer (not per expert). Expert parallel (``ep_size``): an
expert this rank does not hold is None in ``experts`` (the router still scores every expert,
replicated); its tokens are left to the rank that holds it, and the layer's one all-reduce
adds every rank's partial sum (each expert slice lives on exactly one rank:
:mod:`xllm_vmm.engine.distributed.sharding`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from xllm_vmm.engine.layers.linear import ReplicatedLinear
from xllm_vmm.engine.layers.mlp import GatedMLP
from xllm_vmm.engine.layers.parallel import SINGLE, TensorParallel
from xllm_vmm.engine.row_buckets import empty_rows

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


class SparseMoE:
    def __init__(self, router: Tensor,
                 experts: Sequence[tuple[Tensor, Tensor, Tensor] | None], *,
                 top_k: int, norm_topk_prob: bool, tp: TensorParallel = SINGLE) -> None:
        """``router`` (num_experts, hidden); ``experts``: (gate, up, down) weights per expert,
        None for an expert another expert-parallel rank holds."""
        if not 1 <= top_k <= len(experts):
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts "
                             f"{len(experts)}")
        self.router = ReplicatedLinear(router)
        self.tp = tp
        self.experts = [None if e is None else GatedMLP(*e, tp=tp, reduce=False)
                        for e in experts]
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(weights (T, k) in x's dtype, expert ids (T, k))``."""
        import torch

        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), idx

    def __call__(self, x: Tensor) -> Tensor:
        import torch

        weights, idx = self.route(x)
        out = torch.zeros_like(x)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        w = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0 or self.experts[e] is None:  # none routed, or held by another rank
                start += n
                continue
            rows = tokens[start:start + n]
            xe = torch.index_select(x, 0, rows, out=empty_rows(n, tuple(x.shape[1:]), x.dtype,
                                                               x.device))
            y = self.experts[e](xe) * w[start:start + n, None]
            out.index_add_(0, rows, y)
            start += n
        return self.tp.all_reduce(out)
