"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``, vLLM's meaning and shape).

``RequestOutput.prompt_logprobs`` is a list with one entry per prompt token: ``None`` for
position 0 (nothing predicts it), else ``{token id: Logprob}`` holding the prompt token itself
(its log-probability and rank under the raw logits of the position before it) plus the
``prompt_logprobs`` most likely tokens there. Raw logits: no penalties, no temperature.

How they are computed (driver side, :class:`PromptLogprobs`, around each engine step):

- a chunk of a request that asks for them and covers prompt positions not yet recorded is
  flagged (``SeqChunk.prompt_logprobs``); the worker returns the log-softmax of every row of
  that chunk (``StepOutput.prompt_logprobs``), so chunked prefill yields them chunk by chunk;
- a chunk that starts after positions never computed — a prefix-cache hit (device or host tier)
  — first gets a *read-only recompute*: one extra step over the prompt's first ``start_pos``
  tokens from position 0 with ``StepInput.write_kv=False`` (their K/V are already in the shared
  blocks and are not written again), whose rows give the missing positions;
- a request preempted and recomputed keeps what it recorded (each position is recorded once);
- the list is complete when the prompt's last chunk ran; it travels on the request's first
  :class:`~xllm_vmm.engine.output.EngineOutput` (``prompt_logprobs``).

The recompute runs on the standard decoder in this process only (Llama, Qwen2/3, Qwen3-MoE, one
worker); elsewhere (MLA, hybrid linear attention, several workers) a request asking for prompt
log-probabilities while the prefix cache is on is refused at ``add_request`` with a
``RequestError`` naming ``prompt_logprobs`` (:meth:`PromptLogprobs.check`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xllm_vmm.engine.output import Logprob

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from xllm_vmm.engine.output import EngineOutput


def prompt_logprob_dicts(rows: torch.Tensor, targets: list[int], k: int) -> list[dict[int, Logprob]]:
    """For each row of log-probabilities ``rows`` (n, vocab): ``{target: Logprob}`` plus the
    ``k`` most likely tokens, ranks 1-based (a token's rank = 1 + tokens strictly more likely)."""
    import torch

    n = len(targets)
    if n == 0:
        return []
    rows = rows[:n]
    tgt = torch.tensor(targets, dtype=torch.int64)
    tlp = rows.gather(1, tgt[:, None])[:, 0]
    ranks = ((rows > tlp[:, None]).sum(dim=1) + 1).tolist()
    tlp_l = tlp.tolist()
    if k > 0:
        vals, ids = rows.topk(min(k, rows.shape[1]), dim=1)
        vals_l, ids_l = vals.tolist(), ids.tolist()
    out = []
    for i, t in enumerate(targets):
        d = {t: Logprob(tlp_l[i], ranks[i])}
        if k > 0:
            for rank, (v, tid) in enumerate(zip(vals_l[i], ids_l[i]), start=1):
                if tid not in d:
                    d[tid] = Logprob(v, rank)
        out.append(d)
    return out


class PromptLogprobs:
    """Per-request prompt log-probabilities being gathered (see the module docstring).

    ``prepare(sched_out, worker)`` before the step's execute (flags chunks, runs read-only
    recomputes), ``collect(sched_out, step_out)`` after it, ``attach(sched_out, results)``
    after ``Scheduler.update``. Requests that never ask cost one attribute check per chunk."""

    def __init__(self) -> None:
        self._lists: dict[str, list[dict[int, Logprob] | None]] = {}
        # requests whose list was delivered: their later chunks (decodes, a recompute after
        # preemption) neither flag nor recompute anything
        self._done: set[str] = set()

    @staticmethod
    def _wants(req: Any) -> bool:
        return getattr(req.params, "prompt_logprobs", None) is not None

    def prepare(self, out: Any, worker: Any) -> None:
        from xllm_vmm.engine.step import SeqChunk, StepInput

        if out.step is None:
            return
        for sc, chunk in zip(out.chunks, out.step.chunks):
            req = sc.request
            if not self._wants(req) or req.request_id in self._done:
                continue
            lst = self._lists.setdefault(req.request_id, [None])
            num_prompt = req.num_prompt_tokens
            need = len(lst) - 1  # first position whose logits are still missing
            if need >= num_prompt - 1:
                continue
            if need < sc.start_pos:  # a prefix hit: recompute [0, start_pos) read-only
                if not supports_recompute(worker):  # refused at add_request (check)
                    raise RuntimeError("prompt_logprobs: a prefix hit on a worker without "
                                       "read-only recompute")
                ro = StepInput.build([SeqChunk(req.request_id, req.all_token_ids[:sc.start_pos],
                                               0, chunk.block_table, False,
                                               prompt_logprobs=True)], out.step.block_size)
                ro.write_kv = False
                so = worker.execute(ro)
                self._record(req, lst, 0, so.prompt_logprobs[req.request_id])
            if sc.start_pos < num_prompt - 1:
                chunk.prompt_logprobs = True

    def _record(self, req: Any, lst: list, start: int, rows: torch.Tensor) -> None:
        """Record positions ``start .. start + len(rows) - 1`` (those not yet recorded and
        before the prompt's last token) from their log-softmax ``rows``."""
        num_prompt = req.num_prompt_tokens
        first = len(lst) - 1
        end = min(start + rows.shape[0], num_prompt - 1)
        if first < start or first >= end:
            return
        targets = req.prompt_token_ids[first + 1:end + 1]
        lst.extend(prompt_logprob_dicts(rows[first - start:], targets, req.params.prompt_logprobs))

    def collect(self, out: Any, so: Any) -> None:
        got = getattr(so, "prompt_logprobs", None)
        if not got:
            return
        for sc in out.chunks:
            rows = got.get(sc.request.request_id)
            if rows is not None:
                self._record(sc.request, self._lists[sc.request.request_id], sc.start_pos, rows)

    def attach(self, out: Any, results: list[EngineOutput], live: Any) -> None:
        """Put each complete list on its request's first output and stop tracking it; lists of
        requests no longer in ``live`` (the scheduler's request ids: aborted, or finished without
        an output) are dropped."""
        if not self._lists and not self._done:
            return
        for r in results:
            lst = self._lists.get(r.request_id)
            if lst is not None and r.new_token_ids:
                r.prompt_logprobs = self._lists.pop(r.request_id)
                self._done.add(r.request_id)
        for rid in [k for k in self._lists if k not in live]:
            del self._lists[rid]
        if self._done:
            self._done.intersection_update(live)

    @staticmethod
    def check(params: Any, worker: Any, prefix_cache: bool) -> None:
        """Refuse ``prompt_logprobs`` where a prefix hit could not be recomputed (a family with
        its own cache groups, or a worker that does not expose its model) while the prefix cache
        is on: a ``RequestError`` naming the parameter, at ``add_request``."""
        if getattr(params, "prompt_logprobs", None) is None or not prefix_cache:
            return
        if not supports_recompute(worker):
            from xllm_vmm.engine.request import RequestError

            raise RequestError(param="prompt_logprobs", message=(
                "prompt_logprobs with the prefix cache on needs a read-only recompute of prefix "
                "hits, which this model family / worker does not support; start the engine with "
                "enable_prefix_cache=false to get prompt_logprobs"))


def supports_recompute(worker: Any) -> bool:
    """The worker runs the standard decoder in this process (a read-only recompute works)."""
    model = getattr(worker, "model", None)
    return model is not None and not hasattr(model, "make_kv") and hasattr(worker, "runner")


__all__ = ["PromptLogprobs", "prompt_logprob_dicts", "supports_recompute"]
