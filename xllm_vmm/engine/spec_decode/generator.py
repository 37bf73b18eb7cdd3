"""``SpeculativeGenerator``: MTP speculative decoding over the KV cache manager and a worker.

Per sequence, after its prefill (the target computes the prompt, the first token is sampled,
the draft catches up over the prompt's positions and proposes), every round is:

1. **Verify**: one target step computes ``[t, d_1 .. d_K]`` (the last emitted token and the K
   proposals) at positions ``p .. p + K`` for every running sequence together, returning logits
   and hidden states of every row;
2. **Accept** (:mod:`.rejection`): greedy, or the rejection rule when sampling; ``a`` drafts are
   accepted and one target token follows them; ``commit`` marks ``p + a + 1`` tokens computed,
   so the K/V written for rejected positions is overwritten by the next round (their blocks stay
   the sequence's lookahead: the next round needs them again);
3. **Draft**: the table is grown to cover the next round (``allocate(rid, K + 1)``: target and
   draft blocks together, SD-01); the draft catches up over the verified positions
   ``p .. p + a`` (tokens ``d_1 .. d_a, y`` with the target's hidden states there), then
   proposes K tokens (each later proposal from its own previous hidden state).

The target's output is therefore the target's own: with temperature 0 identical, token for
token, to decoding without speculation; when sampling, distributed as the target's.

Acceptance statistics (:class:`SpecDecodeStats`) follow vLLM's ``vllm:spec_decode_*`` metrics:
drafts (verify rounds), draft tokens, accepted tokens, accepted tokens per position.

Scope: a generation loop over a batch of prompts (admitted in waves bounded by the
hidden-state slots, each wave prefilled in one step, then lock-step rounds); temperature sampling
only (no top-k/top-p/penalties in this path). The engine's continuous batching runs
speculation through :mod:`.speculator` instead (top-k/top-p/min-p, truncation of rejected
drafts' blocks); this loop stays as its reference. A prefix hit leaves the draft's cache for
the hit's positions as an earlier request wrote it: a proposal may then be worse, never the
output (the target verifies every token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from xllm_vmm.engine.spec_decode.mtp import MtpDraft


@dataclass
class SpecDecodeStats:
    """Counters of speculative decoding (vLLM's ``vllm:spec_decode_*`` meanings)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verify rounds, per sequence
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    target_steps: int = 0
    draft_steps: int = 0
    emitted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        """Fraction of rounds whose proposal at position j (1-based j = index + 1) was accepted."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify round (accepted drafts + the target's token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_decode_acceptance_rate": self.acceptance_rate,
                "spec_decode_acceptance_per_pos": self.acceptance_per_pos,
                "spec_decode_mean_accepted_length": self.mean_accepted_length,
                "spec_decode_target_steps": self.target_steps,
                "spec_decode_draft_steps": self.draft_steps}


@dataclass
class _Seq:
    rid: str
    tokens: list[int]  # prompt + emitted (the last one not computed yet)
    prompt_len: int
    max_tokens: int
    computed: int = 0
    drafts: list[int] = field(default_factory=list)
    draft_probs: Any = None  # (K, V) when sampling
    done: bool = False
    admitted: bool = False
    slot: int | None = None  # its hidden-state ("embedding") slot while admitted

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class SpeculativeGenerator:
    """K-token MTP speculation over ``mgr`` (a KVCacheManager whose layout has the target's
    groups and ``"draft"``), the target ``worker`` and the ``draft`` module."""

    def __init__(self, mgr: Any, worker: Any, draft: MtpDraft, *,
                 num_speculative_tokens: int, max_seqs: int = 256) -> None:
        """``max_seqs``: hidden-state slots (one ``hidden`` vector per running sequence, what
        the draft reads from the target; AD-03's MTP embedding slots): sequences beyond them
        wait for one."""
        from xllm_vmm.kvcache.resident import SequenceSlots
        from xllm_vmm.planner.sizing import mtp_embedding_bytes_per_seq

        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if "draft" not in mgr.group_names:
            raise ValueError(f"the KV cache has no 'draft' group (groups: {mgr.group_names}); "
                             "build its layout with the draft (cache_layout(..., draft=True, "
                             "draft_spec=...), SD-01)")
        self.mgr, self.worker, self.draft = mgr, worker, draft
        self.k = num_speculative_tokens
        self.block_size = mgr.block_size
        self.stats = SpecDecodeStats(num_speculative_tokens)
        # the planner's formula (AD-03, one home), over the draft's real dtype
        per_seq = mtp_embedding_bytes_per_seq(
            draft.config.hidden_size, str(draft.body.dtype).removeprefix("torch.")) \
            if draft is not None else 0
        self.slots = SequenceSlots("mtp_embedding", max_seqs, per_seq)

    # -- helpers ------------------------------------------------------------------------------
    def _target(self, chunks: list) -> tuple[Any, list[tuple[int, int]]]:
        """Run the target on ``chunks`` returning every row's logits and hidden state."""
        import torch

        from xllm_vmm.engine.step import StepInput

        step = StepInput.build(chunks, self.block_size)
        step = dataclasses.replace(step, sample_indices=torch.arange(step.num_tokens))
        out = self.worker.execute(step)
        self.stats.target_steps += 1
        qsl = step.query_start_loc.tolist()
        return out, [(qsl[i], qsl[i + 1]) for i in range(len(chunks))]

    def _pick(self, logits: Tensor, temperature: float, gen: Any) -> tuple[int, Any]:
        import torch

        if temperature <= 0:
            return int(logits.argmax()), None
        p = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)
        return int(torch.multinomial(p, 1, generator=gen)), p

    def _propose(self, seqs: list[_Seq], catchup: list[tuple[_Seq, int, list[int], Tensor]],
                 temperature: float, gen: Any) -> None:
        """Draft catch-up (``(seq, start_pos, next tokens, target hidden rows)``) then K
        proposals per sequence."""
        import torch

        from xllm_vmm.engine.step import SeqChunk, StepInput

        if not catchup:
            return
        chunks = [SeqChunk(s.rid, toks, start, self.mgr.block_tables(s.rid), True)
                  for s, start, toks, _ in catchup]
        hidden = torch.cat([h for *_, h in catchup])
        logits, y = self.draft.forward(StepInput.build(chunks, self.block_size), hidden)
        self.stats.draft_steps += 1
        live = [c[0] for c in catchup]
        pos = [c[1] + len(c[2]) for c in catchup]  # position of each seq's next draft input
        for s in live:
            s.drafts, s.draft_probs = [], []
        for k in range(self.k):
            for i, s in enumerate(live):
                tok, p = self._pick(logits[i], temperature, gen)
                s.drafts.append(tok)
                if p is not None:
                    s.draft_probs.append(p)
            if k == self.k - 1:
                break
            chunks = [SeqChunk(s.rid, [s.drafts[-1]], pos[i], self.mgr.block_tables(s.rid), True)
                      for i, s in enumerate(live)]
            logits, y = self.draft.forward(StepInput.build(chunks, self.block_size), y)
            self.stats.draft_steps += 1
            pos = [p + 1 for p in pos]
        for s in live:
            s.draft_probs = torch.stack(s.draft_probs) if s.draft_probs else None

    # -- the loop -------------------------------------------------------------------------------
    def _prefill(self, seqs: list[_Seq], temperature: float, gen: Any) -> None:
        """Admit ``seqs`` (their hidden-state slots already taken): one target step over their
        prompts (prefix hits skipped), the first token each, the draft's first proposals."""
        from xllm_vmm.engine.step import SeqChunk

        mgr, k = self.mgr, self.k
        chunks, starts = [], []
        for s in seqs:
            hit = mgr.lookup(s.rid, s.tokens)
            n0 = hit.num_tokens
            got = mgr.allocate(s.rid, s.prompt_len - n0, hit=hit,
                               num_prompt_tokens=s.prompt_len, lookahead=k + 1)
            if got is None:
                mgr.drop(s.rid)
                raise RuntimeError(f"request {s.rid!r} does not fit the KV cache")
            s.admitted = True
            chunks.append(SeqChunk(s.rid, s.tokens[n0:], n0, got, True))
            starts.append(n0)
        out, rows = self._target(chunks)
        catchup = []
        for s, n0, (r0, r1) in zip(seqs, starts, rows):
            tok, _ = self._pick(out.logits[r1 - 1], temperature, gen)
            mgr.commit(s.rid, s.prompt_len, s.tokens)
            s.computed = s.prompt_len
            s.tokens.append(tok)
            if len(s.output) >= s.max_tokens:
                self._finish(s)
                continue
            catchup.append((s, n0, s.tokens[n0 + 1:s.prompt_len + 1], out.hidden_states[r0:r1]))
        self._propose(seqs, catchup, temperature, gen)

    def _finish(self, s: _Seq) -> None:
        s.done = True
        self.mgr.free(s.rid)
        if s.slot is not None:
            self.slots.release(s.slot)
            s.slot = None

    def generate(self, prompts: dict[str, list[int]], max_tokens: int, *,
                 temperature: float = 0.0, seed: int | None = None) -> dict[str, list[int]]:
        """Continuations of every prompt, exactly ``max_tokens`` tokens each (eos ignored).

        At most ``max_seqs`` sequences run at once (their hidden-state slots, AD-03); the others
        wait and are admitted, in order, as slots are given back."""
        import torch

        from xllm_vmm.engine.spec_decode.rejection import greedy_verify, rejection_sample
        from xllm_vmm.engine.step import SeqChunk

        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        mgr, k = self.mgr, self.k
        seqs = [_Seq(rid, list(ids), len(ids), max_tokens) for rid, ids in prompts.items()]
        waiting = list(seqs)
        try:
            while waiting or any(s.admitted and not s.done for s in seqs):
                batch = []
                while waiting:
                    slot = self.slots.acquire()
                    if slot is None:
                        break
                    waiting[0].slot = slot
                    batch.append(waiting.pop(0))
                if batch:
                    self._prefill(batch, temperature, gen)
                live = [s for s in seqs if s.admitted and not s.done]
                if not live:
                    continue
                chunks = [SeqChunk(s.rid, [s.tokens[-1]] + s.drafts, s.computed,
                                   mgr.block_tables(s.rid), True) for s in live]
                out, rows = self._target(chunks)
                catchup = []
                for s, (r0, r1) in zip(live, rows):
                    logits = out.logits[r0:r1]
                    if temperature <= 0:
                        a, emitted = greedy_verify(s.drafts, logits)
                    else:
                        p = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)
                        a, emitted = rejection_sample(s.drafts, s.draft_probs, p, gen)
                    st = self.stats
                    st.num_drafts += 1
                    st.num_draft_tokens += k
                    st.num_accepted_tokens += a
                    for j in range(a):
                        st.accepted_per_pos[j] += 1
                    room = s.max_tokens - len(s.output)
                    emitted = emitted[:room]
                    st.emitted_tokens += len(emitted)
                    start = s.computed
                    s.tokens.extend(emitted)
                    s.computed = start + len(emitted)  # [t, d_1 .. d_a] hold valid K/V
                    mgr.commit(s.rid, s.computed, s.tokens)
                    if len(s.output) >= s.max_tokens:
                        self._finish(s)
                        continue
                    if mgr.allocate(s.rid, k + 1) is None:
                        raise RuntimeError(f"request {s.rid!r}: the KV cache is full")
                    catchup.append((s, start, s.tokens[start + 1:s.computed + 1],
                                    out.hidden_states[r0:r0 + len(emitted)]))
                self._propose(live, catchup, temperature, gen)
        finally:
            for s in seqs:
                if s.admitted and not s.done:
                    self._finish(s)
                elif s.slot is not None:
                    self.slots.release(s.slot)
                    s.slot = None
        return {s.rid: s.output for s in seqs}


__all__ = ["SpecDecodeStats", "SpeculativeGenerator"]
