"""``MtpSpeculator``: MTP speculative decoding inside the engine's continuous batching.

The engine's step with speculation on (``LLMEngine`` with ``--draft_model=DIR
--speculative_algorithm=MTP --num_speculative_tokens=K``):

1. **Schedule** (:class:`~xllm_vmm.engine.scheduler.Scheduler`): a running request that decodes
   and holds proposals ``d_1 .. d_k`` (``Request.spec_token_ids``, ``k <= K``) is one chunk of
   ``1 + k`` tokens ``[t, d_1 .. d_k]`` at positions ``p .. p + k``, allocated as
   ``allocate(rid, 1, lookahead=k)`` (target and draft groups together, one manager, SD-01),
   counted ``1 + k`` against the token budget; prefill chunks run beside them in the same step
   (mixed batches: every chunk is independent rows of one pass, so a step with prefills does
   not wait for a step without them, and the decodes' verification is not delayed by a long
   prompt beyond what chunked prefill already bounds).
2. **Target** (:meth:`target_step`): one pass over every chunk, returning logits and hidden
   states of *every* row (the verify rows and the prefill rows the draft catches up on).
3. **Verify and sample** (:meth:`sample`): a plain chunk samples its last row with the engine's
   sampler; a speculative chunk accepts by :func:`.rejection.greedy_verify` (temperature 0:
   the output is the target's argmax, token for token the same as without speculation) or the
   rejection rule (:func:`.rejection.rejection_sample`) over the distributions the sampler
   draws from (temperature, min_p, top_k, top_p: :meth:`Sampler.probabilities`), so every
   emitted token is distributed as sampling the target alone. Logprobs come from the target's
   raw logits of each emitted position.
4. **Commit** (``Scheduler.update``): accepted drafts and the target's token are appended (stop
   conditions token by token); ``num_computed`` = ``p + 1 + accepted kept``; ``mgr.truncate``
   returns the rejected drafts' blocks at once.
5. **Draft** (:meth:`propose`): one draft pass catches up over every chunk's newly computed
   positions (tokens shifted by one, the target's hidden states there) — prefill chunks too,
   so the draft's cache follows the target's — and, for each decoding request, proposes from
   its last row; ``K - 1`` more single-token draft passes (batched over the requests) propose
   the rest, each from the draft's own previous hidden state. The blocks the proposals and
   the next verification need are allocated first (``allocate(rid, 1 + k)``); a request that
   gets none decodes plainly next step (speculation never preempts).

Which requests speculate: those without penalties (repetition/frequency/presence depend on
the tokens before each verified position) and past ``min_tokens``; their proposals are capped
by the tokens they may still emit (``max_tokens``, ``max_model_len``). Others decode plainly in
the same batch.

A prefix hit (and a recomputed preemption) leaves the draft's cache for the hit's positions as
an earlier request wrote it: at a block's last position the draft's input token may differ, so
a proposal may be worse, never the output (the target verifies every token).

Hidden-state ("embedding") slots (AD-03): every running request holds one of ``max_seqs``
slots (:class:`MtpSlotsKVManager`, taken at admission, given back at free), the per-sequence
hidden vector an MTP draft reads from the target; with none left admission is "not now".

Statistics (:attr:`stats`): drafts, draft tokens, accepted
tokens, accepted tokens per position (vLLM's ``vllm:spec_decode_*`` counters).

Cost on this engine: the target's pass returns logits for every row of a step (the worker's
one output; a prefill row's logits are not needed, only its hidden state).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

from xllm_vmm.engine.spec_decode.generator import SpecDecodeStats
from xllm_vmm.kvcache.resident import SequenceSlots

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.request import Request
    from xllm_vmm.engine.scheduler import SchedulerOutput
    from xllm_vmm.engine.spec_decode.mtp import MtpDraft
    from xllm_vmm.engine.step import StepInput, StepOutput


class MtpSlotsKVManager:
    """The KV cache manager as the scheduler sees it, with MTP hidden-state slots taken by a
    fresh request's ``allocate`` ("not now" when none is left, nothing changed) and given back
    by ``free``; everything else falls through to the manager."""

    def __init__(self, mgr: Any, slots: SequenceSlots) -> None:
        self._mgr = mgr
        self.slots = slots
        self._slot: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mgr, name)

    def allocate(self, request_id: str, num_new_tokens: int, *, hit: Any = None,
                 lookahead: int = 0, num_prompt_tokens: int | None = None):
        fresh = request_id not in self._slot
        if fresh:
            slot = self.slots.acquire()
            if slot is None:
                return None  # no hidden-state slot: "not now" (AD-03)
            self._slot[request_id] = slot
        got = self._mgr.allocate(request_id, num_new_tokens, hit=hit, lookahead=lookahead,
                                 num_prompt_tokens=num_prompt_tokens)
        if got is None and fresh:
            self.slots.release(self._slot.pop(request_id))
        return got

    def free(self, request_id: str) -> None:
        self._mgr.free(request_id)
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self.slots.release(slot)


def speculates(req: Request) -> bool:
    """Whether ``req`` may get proposals (module docstring: no penalties, past min_tokens)."""
    p = req.params
    return not p.has_penalties and req.num_output_tokens >= p.min_tokens


class MtpSpeculator:
    """K-token MTP speculation for the engine (module docstring). ``mgr``: the manager the
    scheduler uses (its ``block_tables``/``allocate``); ``draft``: the loaded module over the
    same cache's ``"draft"`` group."""

    def __init__(self, mgr: Any, draft: MtpDraft, *, num_speculative_tokens: int,
                 max_model_len: int, seed: int | None = None) -> None:
        import torch

        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if "draft" not in mgr.group_names:
            raise ValueError(f"the KV cache has no 'draft' group (groups: {mgr.group_names}); "
                             "its layout must be built with the draft (SD-01)")
        self.mgr, self.draft = mgr, draft
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.block_size = mgr.block_size
        self.stats = SpecDecodeStats(num_speculative_tokens)
        self._gen = torch.Generator()
        if seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(seed)

    # -- statistics ----------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """``LLMEngine.stats()["spec_decode"]`` (contract section 2: cumulative counters)."""
        st = self.stats
        return {"num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
                "num_accepted_tokens": st.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(st.accepted_per_pos)}

    # -- 2. the target's pass ------------------------------------------------------------------
    def target_step(self, worker: Any, step: StepInput) -> StepOutput:
        """Run ``step`` on the target returning every row's logits and hidden state."""
        import torch

        full = dataclasses.replace(step, sample_indices=torch.arange(step.num_tokens))
        self.stats.target_steps += 1
        return worker.execute(full)

    # -- 3. verification and sampling ----------------------------------------------------------
    def sample(self, out: SchedulerOutput, so: StepOutput, sampler: Any
               ) -> tuple[list[Any], list[Any] | None]:
        """Tokens and logprobs per sampled chunk (``out.sampled`` order) for
        ``Scheduler.update``: an int and a dict (or None) for a plain chunk, lists for a
        speculative one."""
        import torch

        from xllm_vmm.engine.sampler import Sampler, top_logprobs

        qsl = out.step.query_start_loc.tolist()
        plain_rows, plain_reqs, plain_at = [], [], []
        toks: list[Any] = []
        lps: list[Any] = []
        any_lp = False
        for i, c in enumerate(out.chunks):
            if not c.sample:
                continue
            r0, r1 = qsl[i], qsl[i + 1]
            req = c.request
            any_lp = any_lp or req.params.logprobs is not None
            if not c.spec_token_ids:
                plain_rows.append(r1 - 1)
                plain_reqs.append(req)
                plain_at.append(len(toks))
                toks.append(None)
                lps.append(None)
                continue
            drafts = list(c.spec_token_ids)
            logits = so.logits[r0:r1].float()
            if req.params.greedy:
                a, emitted = _greedy(drafts, logits)
            else:
                p = Sampler.probabilities(logits, [req.params] * len(logits)).to(torch.float64)
                q = req.spec_draft_probs[:len(drafts)].to(torch.float64)
                a, emitted = _rejection(drafts, q, p, self._generator(req))
            st = self.stats
            st.num_drafts += 1
            st.num_draft_tokens += len(drafts)
            st.num_accepted_tokens += a
            for j in range(a):
                st.accepted_per_pos[j] += 1
            st.emitted_tokens += len(emitted)
            toks.append(emitted)
            if req.params.logprobs is not None:
                raw = torch.log_softmax(logits[:len(emitted)], dim=-1)
                lps.append([top_logprobs(raw[j], t, req.params.logprobs or 0)
                            for j, t in enumerate(emitted)])
            else:
                lps.append(None)
        if plain_rows:
            s = sampler.sample(so.logits[torch.tensor(plain_rows)], plain_reqs)
            for j, at in enumerate(plain_at):
                toks[at] = s.token_ids[j]
                lps[at] = s.logprobs[j]
        return toks, (lps if any_lp else None)

    def _generator(self, req: Request) -> Any:
        import torch

        if req.params.seed is None:
            return self._gen
        if req.generator is None:
            req.generator = torch.Generator().manual_seed(req.params.seed)
        return req.generator

    # -- 5. the draft ---------------------------------------------------------------------------
    def propose(self, out: SchedulerOutput, so: StepOutput) -> None:
        """Draft catch-up over the step's newly computed positions, then proposals for the
        decoding requests (module docstring, step 5). Call after ``Scheduler.update``."""
        import torch

        from xllm_vmm.engine.request import RequestStatus
        from xllm_vmm.engine.step import SeqChunk, StepInput

        mgr = self.mgr
        qsl = out.step.query_start_loc.tolist()
        chunks, hidden, proposing = [], [], []
        for i, c in enumerate(out.chunks):
            req = c.request
            if req.status is not RequestStatus.RUNNING:
                continue
            rid = req.request_id
            start, done = c.start_pos, req.num_computed_tokens
            if done <= start:
                continue
            tokens = req.all_token_ids
            k = 0
            if done == len(tokens) - 1 and speculates(req):
                k = min(self.k, req.params.max_tokens - req.num_output_tokens - 1,
                        self.max_model_len - len(tokens) - 1)
                if k > 0 and mgr.allocate(rid, 1 + k) is None:
                    k = 0  # no room for the proposals: a plain decode next step
            chunks.append(SeqChunk(rid, tokens[start + 1:done + 1], start,
                                   mgr.block_tables(rid), k > 0))
            hidden.append(so.hidden_states[qsl[i]:qsl[i] + done - start])
            if k > 0:
                proposing.append((req, k))
        if not chunks:
            return
        logits, y = self.draft.forward(StepInput.build(chunks, self.block_size),
                                       torch.cat(hidden))
        self.stats.draft_steps += 1
        if not proposing:
            return
        live = list(proposing)  # rows of logits / y, in order
        for req, _ in live:
            req.spec_token_ids, req.spec_draft_probs = [], []
        pos = {req.request_id: req.num_computed_tokens for req, _ in live}
        while True:
            for row, (req, _) in enumerate(live):
                tok, q = self._pick(req, logits[row])
                req.spec_token_ids.append(tok)
                if q is not None:
                    req.spec_draft_probs.append(q)
            nxt = [(row, req, k) for row, (req, k) in enumerate(live)
                   if len(req.spec_token_ids) < k]
            if not nxt:
                break
            step = StepInput.build(
                [SeqChunk(req.request_id, [req.spec_token_ids[-1]],
                          pos[req.request_id] + len(req.spec_token_ids) - 1,
                          mgr.block_tables(req.request_id), True) for _, req, _ in nxt],
                self.block_size)
            rows = torch.tensor([row for row, _, _ in nxt])
            logits, y = self.draft.forward(step, y[rows])
            self.stats.draft_steps += 1
            live = [(req, k) for _, req, k in nxt]
        for req, _ in proposing:
            req.spec_draft_probs = (torch.stack(req.spec_draft_probs)
                                    if req.spec_draft_probs else None)

    def _pick(self, req: Request, logits: Tensor) -> tuple[int, Tensor | None]:
        """A proposal from the draft's ``logits``: the argmax (greedy), else a draw from the
        distribution the sampler would draw from with the request's parameters."""
        import torch

        from xllm_vmm.engine.sampler import Sampler

        if req.params.greedy:
            return int(logits.argmax()), None
        q = Sampler.probabilities(logits.float().unsqueeze(0), [req.params])[0]
        return int(torch.multinomial(q, 1, generator=self._generator(req))), q


def _greedy(drafts: Sequence[int], logits: Tensor) -> tuple[int, list[int]]:
    from xllm_vmm.engine.spec_decode.rejection import greedy_verify

    return greedy_verify(list(drafts), logits)


def _rejection(drafts: Sequence[int], q: Tensor, p: Tensor, gen: Any) -> tuple[int, list[int]]:
    from xllm_vmm.engine.spec_decode.rejection import rejection_sample

    return rejection_sample(list(drafts), q, p, gen)


__all__ = ["MtpSlotsKVManager", "MtpSpeculator", "speculates"]
