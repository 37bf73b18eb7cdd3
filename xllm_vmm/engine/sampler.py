"""The sampler: next tokens from a step's logits, per request, on the driver side.

Order of operations per row (vLLM v1's): log-probabilities are taken from the *raw* logits
(vLLM's default ``raw_logprobs``); then penalties — repetition (over prompt and output tokens:
a positive logit is divided by it, a negative one multiplied), frequency and presence (over
output tokens: ``logit -= frequency * count + presence * (count > 0)``); then ``min_tokens``
(while fewer outputs than that, EOS — unless ``ignore_eos`` — and ``stop_token_ids`` get -inf);
then greedy rows take the argmax (first index on ties, as ``torch.argmax`` and HF ``generate``);
random rows divide by ``temperature``, apply ``min_p`` (drop tokens whose probability is below
``min_p`` × the most likely one's), ``top_k`` (keep tokens whose logit is at least the k-th
largest: ties kept), ``top_p`` (keep the smallest set of most likely tokens holding at least
``top_p`` of the mass; the most likely token always stays) and draw one token from the
renormalised distribution.

Reproducibility: a seeded request draws from its own ``torch.Generator`` (seeded with its
``seed``), so its tokens do not depend on what else is in the batch; unseeded requests share the
sampler's generator (seeded with the engine's ``seed``).

Faults stay with their request: a row whose logits hold a NaN or +inf (non-finite weights or an
overflow upstream) and a request whose generator cannot be seeded are reported in
``SamplerOutput.errors`` (row -> what failed) and sampled as token 0; the engine fails those
requests alone and the other rows of the step are sampled as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from xllm_vmm.engine.output import Logprob
from xllm_vmm.engine.request import Request
from xllm_vmm.engine.sampling_params import SAMPLING_EPS


@dataclass
class SamplerOutput:
    """``token_ids[i]`` sampled for ``requests[i]``; ``logprobs[i]``: token id -> Logprob (the
    ``params.logprobs`` most likely tokens plus the sampled one), None when not asked for."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]
    errors: dict[int, str] = field(default_factory=dict)
    """Row -> why that request failed (its token is a placeholder, never to be used)."""


class Sampler:
    def __init__(self, seed: int | None = 0) -> None:
        self._gen = torch.Generator()
        if seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """Sample one token per row of ``logits`` (num_rows, vocab) for ``requests`` (same order)."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(requests)} requests")
        logits = logits.float()
        n, vocab = logits.shape
        errors = nonfinite_rows(logits)
        if errors:  # those rows are sampled from zeros: their requests fail, the rest go on
            logits = logits.clone()
            logits[torch.tensor(sorted(errors))] = 0.0
        if not errors and all(len(r.output_token_ids) >= (r.plain_greedy_from if r.plain_greedy_from >= 0
                                           else self._plain_from(r)) for r in requests):
            return SamplerOutput(argmax_rows(logits), [None] * n)  # one argmax, no copies
        want_lp = [r.params.logprobs is not None for r in requests]
        raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        x = logits
        copied = False
        for i, r in enumerate(requests):
            p = r.params
            masked = self._min_tokens_ids(r)
            if not (p.has_penalties or masked):
                continue
            if not copied:
                x = logits.clone()
                copied = True
            row = x[i]
            if p.repetition_penalty != 1.0:
                ids = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
                                   dtype=torch.int64)
                if ids.numel():
                    v = row[ids]
                    row[ids] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and r.output_token_ids:
                counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.int64),
                                        minlength=vocab)[:vocab].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
            if masked:
                row[torch.tensor(sorted(t for t in masked if 0 <= t < vocab), dtype=torch.int64)] = -float("inf")

        out = [0] * n
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        if greedy:
            g = torch.tensor(greedy)
            for i, t in zip(greedy, argmax_rows(x[g])):
                out[i] = t
        rand = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rand:
            probs = self.probabilities(x[torch.tensor(rand)], [requests[i].params for i in rand])
            broken = _bad_distributions(probs)
            if broken:  # this request's parameters made its distribution non-finite: it fails
                probs = probs.clone()
                for j in broken:
                    errors[rand[j]] = (
                        "the sampling distribution is not finite after this request's "
                        f"penalties and temperature (repetition_penalty "
                        f"{requests[rand[j]].params.repetition_penalty}, temperature "
                        f"{requests[rand[j]].params.temperature}): give values nearer 1")
                    probs[j] = 1.0 / probs.shape[1]
            shared = [j for j, i in enumerate(rand) if requests[i].params.seed is None]
            if shared:
                picks = torch.multinomial(probs[torch.tensor(shared)], 1, generator=self._gen)
                for j, t in zip(shared, picks[:, 0].tolist()):
                    out[rand[j]] = t
            for j, i in enumerate(rand):
                r = requests[i]
                if r.params.seed is None:
                    continue
                if r.generator is None:
                    try:
                        r.generator = torch.Generator().manual_seed(r.params.seed)
                    except (ValueError, RuntimeError, OverflowError) as exc:
                        errors[i] = (f"seed {r.params.seed} cannot seed a generator ({exc}): "
                                     "give a seed in [-2**63, 2**64 - 1]")
                        continue
                out[i] = int(torch.multinomial(probs[j], 1, generator=r.generator))

        lps: list[dict[int, Logprob] | None] = [None] * n
        if raw_lp is not None:
            for i, r in enumerate(requests):
                if want_lp[i] and i not in errors:
                    lps[i] = top_logprobs(raw_lp[i], out[i], r.params.logprobs or 0)
        for i in errors:
            out[i] = 0
        return SamplerOutput(out, lps, errors)

    @staticmethod
    def _plain_greedy(r: Request) -> bool:
        """Greedy, no logprobs, no penalties, past ``min_tokens``: the token is the raw argmax."""
        return r.num_output_tokens >= Sampler._plain_from(r)

    @staticmethod
    def _plain_from(r: Request) -> int:
        """From how many output tokens on ``r``'s row is the raw argmax (greedy, no logprobs,
        no penalties: ``min_tokens``; otherwise never, ``sys.maxsize``); kept on the request
        (``Request.plain_greedy_from``: its sampling parameters do not change)."""
        import sys

        p = r.params
        r.plain_greedy_from = (p.min_tokens if p.temperature < SAMPLING_EPS
                               and p.logprobs is None and not p.has_penalties else sys.maxsize)
        return r.plain_greedy_from

    @staticmethod
    def _min_tokens_ids(r: Request) -> set[int]:
        p = r.params
        if r.num_output_tokens >= p.min_tokens:
            return set()
        ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            ids |= set(r.eos_token_ids)
        return ids

    @staticmethod
    def probabilities(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
        """The distribution random rows draw from: temperature, min_p, top_k, top_p (module doc).

        ``logits`` (rows, vocab) after penalties; returns probabilities (rows, vocab) float32."""
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        x = logits / temps
        neg = -float("inf")
        min_ps = [p.min_p for p in params]
        if any(m > 0 for m in min_ps):
            pr = torch.softmax(x, dim=-1)
            thresh = torch.tensor(min_ps, dtype=x.dtype).unsqueeze(1) * pr.max(dim=-1, keepdim=True).values
            x = x.masked_fill(pr < thresh, neg)
        ks = [p.top_k_effective for p in params]
        if any(k > 0 for k in ks):
            vocab = x.shape[1]
            kk = torch.tensor([min(k, vocab) if k > 0 else vocab for k in ks])
            sorted_desc = x.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (kk - 1).unsqueeze(1))
            x = x.masked_fill(x < kth, neg)
        tops = [p.top_p for p in params]
        if any(t < 1.0 for t in tops):
            sx, idx = x.sort(dim=-1, descending=False)
            sp = torch.softmax(sx, dim=-1)
            cum = sp.cumsum(dim=-1)
            remove = cum <= (1.0 - torch.tensor(tops, dtype=x.dtype)).unsqueeze(1)
            remove[:, -1] = False
            x = x.scatter(1, idx, sx.masked_fill(remove, neg))
        return torch.softmax(x, dim=-1)


def _bad_distributions(probs: torch.Tensor) -> list[int]:
    """Rows of ``probs`` that ``torch.multinomial`` refuses (a NaN or inf, or nothing left)."""
    sums = probs.sum(dim=-1)
    bad = ~torch.isfinite(sums) | (sums <= 0)
    if not bool(bad.any()):
        return []
    return torch.nonzero(bad).flatten().tolist()


def nonfinite_rows(logits: torch.Tensor) -> dict[int, str]:
    """Rows of ``logits`` (rows, vocab) holding a NaN or +inf, with what each holds; -inf is a
    masked token and allowed. One row sum finds them (NaN or +inf make the sum NaN or +inf)."""
    sums = logits.sum(dim=-1)
    bad = torch.isnan(sums) | torch.isposinf(sums)
    if not bool(bad.any()):
        return {}
    res = {}
    for i in torch.nonzero(bad).flatten().tolist():
        row = logits[i]
        nan, pinf = int(torch.isnan(row).sum()), int(torch.isposinf(row).sum())
        res[i] = (f"the model's logits are not finite ({nan} NaN, {pinf} +inf of {row.numel()}): "
                  "the weights or the computation produced non-finite values "
                  "(check the checkpoint for NaN/inf weights)")
    return res


def argmax_rows(x: torch.Tensor) -> list[int]:
    """The first maximal index of every row of ``x`` (rows, vocab), as ``torch.argmax`` and HF
    ``generate`` pick (a NaN counts as the maximum, as in both).

    A CPU float32 tensor goes through numpy's vectorised single-threaded ``argmax``: for 128 x
    2,048 float32 logits it took 17 us of CPU time against 130-1,900 us for ``torch.max(dim)``
    (loaded 2-core machine), which splits so small a reduction over its threads and then waits
    for whichever thread the OS descheduled (19-26 ms wall in the worst runs). Elsewhere torch."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return x.numpy().argmax(axis=1).tolist()
    return torch.max(x, dim=-1).indices.tolist()


def top_logprobs(row_lp: torch.Tensor, sampled: int, k: int) -> dict[int, Logprob]:
    """The ``k`` most likely tokens of ``row_lp`` (log-probabilities) plus ``sampled``, with
    ranks (1 = most likely; a token's rank = 1 + tokens with a strictly larger log-probability)."""
    res: dict[int, Logprob] = {}
    s_lp = float(row_lp[sampled])
    res[sampled] = Logprob(s_lp, int((row_lp > s_lp).sum()) + 1)
    if k > 0:
        vals, ids = row_lp.topk(min(k, row_lp.numel()))
        for rank, (v, t) in enumerate(zip(vals.tolist(), ids.tolist()), start=1):
            if t not in res:
                res[t] = Logprob(v, rank)
    return res


__all__ = ["Sampler", "SamplerOutput", "argmax_rows", "nonfinite_rows", "top_logprobs"]
