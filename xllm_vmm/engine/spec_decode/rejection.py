"""Verification of draft tokens against the target's distributions.

Greedy (temperature 0): draft token ``d_j`` is accepted while it equals the target's argmax at
the position before it; the first mismatch is replaced by the target's argmax there; with every
draft accepted the target's argmax after the last draft is the bonus token. The output is
therefore exactly the target's greedy continuation, whatever the draft proposed.

Sampling (the standard rule, Leviathan et al. 2023 / Chen et al. 2023): with draft
distributions ``q_j`` and target distributions ``p_j``, ``d_j`` is accepted with probability
``min(1, p_j(d_j) / q_j(d_j))``; the first rejected position samples from
``normalize(max(0, p_j - q_j))``; with every draft accepted a bonus token is sampled from
``p_K``. Every emitted token is then distributed exactly as sampling the target alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from torch import Generator, Tensor


def greedy_verify(draft_tokens: list[int], target_logits: Tensor) -> tuple[int, list[int]]:
    """``target_logits`` ``(K + 1, V)``: rows for the positions of ``[t, d_1 .. d_K]``.
    Returns ``(accepted drafts a, emitted tokens)``: ``d_1 .. d_a`` then the target's token."""
    best = target_logits.argmax(-1).tolist()
    a = 0
    while a < len(draft_tokens) and draft_tokens[a] == best[a]:
        a += 1
    return a, list(draft_tokens[:a]) + [best[a]]


def rejection_sample(draft_tokens: list[int], draft_probs: Tensor, target_probs: Tensor,
                     generator: Generator | None = None) -> tuple[int, list[int]]:
    """``draft_probs`` ``(K, V)`` (the ``q_j`` the drafts were sampled from), ``target_probs``
    ``(K + 1, V)``. Returns ``(accepted drafts a, emitted tokens)`` (module docstring)."""
    import torch

    k = len(draft_tokens)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} draft tokens need {k} draft and {k + 1} target distributions, "
                         f"got {draft_probs.shape[0]} and {target_probs.shape[0]}")
    out: list[int] = []
    for j, d in enumerate(draft_tokens):
        p, q = target_probs[j, d], draft_probs[j, d]
        u = torch.rand((), generator=generator, dtype=torch.float64)
        if q > 0 and u <= min(1.0, float(p / q)):
            out.append(d)
            continue
        residual = torch.clamp(target_probs[j] - draft_probs[j], min=0)
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[j]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return j, out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return k, out


__all__ = ["greedy_verify", "rejection_sample"]
