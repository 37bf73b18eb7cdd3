"""The continuous-batching scheduler: which tokens of which requests run in the next step.

Driver side; it talks to the KV cache only through :class:`~xllm_vmm.kvcache.KVCacheManager`
(lookup → allocate (``None`` = not now) → commit → free; ``step()`` once per iteration) and hands
the worker a plain :class:`~xllm_vmm.engine.step.StepInput`.

One :meth:`Scheduler.schedule` call, within ``max_tokens_per_batch`` tokens and
``max_seqs_per_batch`` sequences:

1. ``mgr.step()`` (host-tier copies progress, finished restores apply, compaction).
2. Running requests, oldest admission first: each gets ``min(uncomputed tokens, token budget)``
   tokens (a decode: 1; a chunked prefill: its next chunk). A request whose host-tier restore is
   in flight (``mgr.ready`` False) sits this step out. Its blocks grow by
   ``mgr.allocate(rid, n)``; when that is "not now" the *newest* running request is preempted by
   recompute (every block freed, back to the head of the waiting queue, its tokens — prompt and
   outputs so far — recomputed when readmitted) and the allocation retried; when the request
   itself is the newest, it is preempted and the pass over running requests ends. A request
   that cannot grow with nothing else left to preempt has reached the KV capacity: it finishes
   with "length" (``RequestStatus.FINISHED_LENGTH``; ``capacity_finished`` counts it) — unless
   host-tier copies are in flight (they pin blocks until they end): then it waits.
   Without chunked prefill a prompt runs in one step (the engine refuses prompts longer than
   ``max_tokens_per_batch``); a preempted request whose prompt + outputs exceed it is
   recomputed in chunks all the same (it could never run otherwise).
3. Only when step 2 preempted nothing: waiting requests in arrival order (preempted ones first),
   while budgets last. Each is looked up in the prefix cache (``num_cached_tokens``: device and
   host tier hits need no compute), then allocated its first chunk against its *whole* footprint
   (``num_prompt_tokens``; no reservation of the outputs). "Not now" ends admission this step
   (first come, first served: a later, smaller request does not overtake); with nothing running,
   a request whose footprint exceeds the whole KV capacity (or is refused ``STALL_LIMIT`` times
   in a row with no host-tier copy in flight: the live budget does not leave room) finishes
   with "length". A parallel sample
   (``Request.parent_id``) waits while a sibling is still prefilling the shared prompt, so that
   it is admitted on the sibling's published blocks (the prefix cache shares them). Likewise
   any request whose next uncached block a running prefill computes now (the same tokens up
   to that block's end, the same salt) waits, keeping its place, until that block is
   published, and is then admitted on it: the same prefix is never prefilled twice at once.

Speculative decoding (MTP, :mod:`xllm_vmm.engine.spec_decode.speculator`): a running request
that decodes and holds proposals (``Request.spec_token_ids``) is scheduled as ``1 + k`` tokens
(its decode token and the drafts the token budget leaves), allocated with ``lookahead=k``; when
the cache has no room for the drafts it decodes plainly (drafts never preempt anyone).
:meth:`update` then takes the list of tokens verification emitted for it, and gives the
blocks beyond the kept tokens back at once (``mgr.truncate``).

After the worker ran the step, :meth:`Scheduler.update` commits each chunk's KV
(``mgr.commit``), appends sampled tokens, applies stop conditions, frees finished requests and
reports the step's execution peak to the pool (``VmmPool.observe_execution_peak``).

Invariants: a RUNNING request is known to the manager with a block table covering its computed
tokens; a WAITING request holds no blocks and no hit; ``num_computed_tokens`` never exceeds the
request's tokens; a step never exceeds either budget; every block is freed when a request
finishes, is aborted or preempted.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from xllm_vmm.engine.output import EngineOutput, Logprob
from xllm_vmm.engine.request import Request, RequestStatus
from xllm_vmm.engine.step import SeqChunk, StepInput


COPY_WAIT_S = 0.0002
"""Pause of a step that scheduled nothing because host-tier copies pin the blocks it needs."""


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    start_pos: int
    num_tokens: int
    sample: bool
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: draft tokens verified after the chunk's one decode token (the
    step computes ``num_tokens + len(spec_token_ids)`` positions; empty: no speculation)."""


@dataclass
class SchedulerOutput:
    """One step's plan: the chunks (in ``step.chunks`` order), and what scheduling itself did."""

    chunks: list[ScheduledChunk]
    step: StepInput | None
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    """Requests scheduling finished (KV capacity reached); their outputs are due this step."""

    @property
    def sampled(self) -> list[Request]:
        """Requests whose logits the step returns, in row order."""
        return [c.request for c in self.chunks if c.sample]

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, mgr: Any, *, max_tokens_per_batch: int, max_seqs_per_batch: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, pool: Any = None) -> None:
        if max_tokens_per_batch < 1 or max_seqs_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch ({max_tokens_per_batch}) and max_seqs_per_batch "
                             f"({max_seqs_per_batch}) must be >= 1")
        self.mgr = mgr
        self.pool = pool
        self.block_size: int = mgr.block_size
        self.max_tokens_per_batch = max_tokens_per_batch
        self.max_seqs_per_batch = max_seqs_per_batch
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (oldest first)
        self.requests: dict[str, Request] = {}
        self._order = itertools.count()
        # counters (for stats / metrics)
        self.num_preemptions = 0
        self.capacity_finished = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.execution_peak_bytes = 0
        self.steps = 0

    # -- queue ---------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Finish ``request_id`` as aborted and free everything it holds (blocks a copy still
        uses stay pinned until it ends: the manager's invariant 4). Unknown ids: None."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.mgr.free(request_id)
        req.status = RequestStatus.FINISHED_ABORTED
        return req

    # -- scheduling ----------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.mgr.free(req.request_id)
        req.spec_token_ids, req.spec_draft_probs = [], None
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        self.requests.pop(req.request_id, None)
        self.mgr.free(req.request_id)

    def schedule(self) -> SchedulerOutput:
        self.mgr.step()
        chunks: list[ScheduledChunk] = []
        seqs: list[SeqChunk] = []  # the step's chunks, built in the same pass (chunk order)
        preempted: list[str] = []
        finished: list[Request] = []
        token_budget = self._schedule_running(chunks, seqs, preempted, finished)
        # a step that preempted admits nobody
        admitted = ([] if preempted else
                    self._admit_waiting(token_budget, chunks, seqs, finished))

        step = None
        if not chunks and self.has_unfinished() and self._copies_in_flight():
            time.sleep(COPY_WAIT_S)  # what waits needs copies to end: do not spin on them
        if chunks:
            step = StepInput.build(seqs, self.block_size)
        return SchedulerOutput(chunks, step, preempted, admitted, finished)

    def _schedule_running(self, chunks: list[ScheduledChunk], seqs: list[SeqChunk],
                          preempted: list[str], finished: list[Request]) -> int:
        """The step's chunks of the running requests, oldest first, preempting from the tail
        when the KV cache has no room (appended to ``chunks``/``seqs``, ``preempted`` and
        ``finished``); returns the token budget left for admissions."""
        mgr = self.mgr
        token_budget = self.max_tokens_per_batch
        # the pass over running requests runs for every sequence of every step: the manager's
        # verbs and the budgets are locals, the request's counts read without properties, and
        # each chunk's two records (ScheduledChunk, SeqChunk) are made here, in one pass
        running = self.running
        max_seqs = self.max_seqs_per_batch
        ready, computed_of, allocate = mgr.ready, mgr.num_computed_tokens, mgr.allocate
        i = 0
        while i < len(running) and token_budget > 0 and len(chunks) < max_seqs:
            req = running[i]
            rid = req.request_id
            if not ready(rid):
                i += 1
                continue
            computed = req.num_computed_tokens = computed_of(rid)  # a failed restore rolls back
            uncomputed = len(req.prompt_token_ids) + len(req.output_token_ids) - computed
            n = uncomputed if uncomputed < token_budget else token_budget
            if n <= 0:  # nothing to compute (cannot happen for a running request)
                i += 1
                continue
            # speculative decoding: a decode verifies its drafts (what the budget leaves)
            spec = (req.spec_token_ids[:token_budget - n]
                    if req.spec_token_ids and uncomputed == 1 else [])
            got = allocate(rid, n, lookahead=len(spec)) if spec else allocate(rid, n)
            if got is None and spec:  # no room for the drafts: decode plainly, preempt nobody
                spec = []
                got = allocate(rid, n)
            self_preempted = False
            while got is None:
                victim = self.running[-1]
                if victim is req:
                    if i == 0 and len(self.running) == 1 and not chunks:
                        if self._copies_in_flight():  # pinned by a copy: room comes back soon
                            self_preempted = True
                            break
                        # alone and still cannot grow: the KV capacity is reached
                        self.capacity_finished += 1
                        self._finish(req, RequestStatus.FINISHED_LENGTH)
                        finished.append(req)
                    else:
                        self._preempt(req)
                        preempted.append(rid)
                    self_preempted = True
                    break
                if any(c.request is victim for c in chunks):  # never: victims come from the tail
                    raise AssertionError("preemption victim already scheduled")
                self._preempt(victim)
                preempted.append(victim.request_id)
                got = mgr.allocate(rid, n)
            if self_preempted:
                break
            sample = n == uncomputed
            chunks.append(ScheduledChunk(req, computed, n, sample, spec))
            toks = req.all_token_ids
            ids = [toks[computed]] if n == 1 else toks[computed:computed + n]
            seqs.append(SeqChunk(rid, ids + spec if spec else ids, computed, got, sample))
            token_budget -= n + len(spec)
            i += 1
        return token_budget

    def _admit_waiting(self, token_budget: int, chunks: list[ScheduledChunk],
                       seqs: list[SeqChunk], finished: list[Request]) -> list[str]:
        """Admit waiting requests, first come first served, while the budget, the batch and
        the KV cache have room (their first chunks appended to ``chunks``/``seqs``); returns
        the admitted ids."""
        mgr = self.mgr
        admitted: list[str] = []
        deferred: list[Request] = []
        # the prefills under way (admitted ones join below): what a waiting request's
        # next block may be computed by (one pass per step, not one per admission)
        prefilling = ([r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
                      if self.waiting and getattr(mgr, "prefix", None) is not None else [])
        while (self.waiting and token_budget > 0
               and len(self.running) < self.max_seqs_per_batch):
            req = self.waiting[0]
            if req.parent_id is not None and self._sibling_prefilling(req):
                deferred.append(self.waiting.popleft())
                continue
            rid = req.request_id
            tokens = req.all_token_ids
            hit = mgr.lookup(rid, tokens, cache_salt=req.cache_salt)
            computed = hit.num_tokens
            if prefilling and self._prefix_being_filled(req, computed, prefilling):
                mgr.drop(rid)  # its next block is computed now: share it once published
                deferred.append(self.waiting.popleft())
                continue
            n = min(len(tokens) - computed, token_budget)
            if (n < len(tokens) - computed and not self.enable_chunked_prefill
                    and len(tokens) - computed <= self.max_tokens_per_batch):
                mgr.drop(rid)  # waits for a step with room for all of it
                break
            got = mgr.allocate(rid, n, hit=hit, num_prompt_tokens=len(tokens))
            if got is None:
                mgr.drop(rid)
                if not self.running and not chunks and not deferred and self._never_fits(req):
                    self.waiting.popleft()
                    self.capacity_finished += 1
                    self._finish(req, RequestStatus.FINISHED_LENGTH)
                    finished.append(req)
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.admitted_order = next(self._order)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
                self.prompt_tokens += req.num_prompt_tokens
            self.running.append(req)
            admitted.append(rid)
            if computed < req.num_prompt_tokens and getattr(mgr, "prefix", None) is not None:
                prefilling.append(req)
            req.num_computed_tokens = computed
            if not mgr.ready(rid):  # host-tier restore in flight: computes once it lands
                continue
            computed = req.num_computed_tokens = mgr.num_computed_tokens(rid)
            n = min(req.num_uncomputed_tokens, n)
            sample = computed + n == req.num_tokens
            chunks.append(ScheduledChunk(req, computed, n, sample))
            seqs.append(SeqChunk(rid, req.all_token_ids[computed:computed + n], computed,
                                 got, sample))
            token_budget -= n
        for req in reversed(deferred):
            self.waiting.appendleft(req)
        return admitted

    def _truncate(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks beyond ``num_tokens`` (rejected drafts' KV; contract section 1).
        A manager without ``truncate`` keeps them as the request's lookahead."""
        truncate = getattr(self.mgr, "truncate", None)
        if truncate is not None:
            self.released_spec_blocks += truncate(request_id, num_tokens)

    released_spec_blocks = 0
    """Blocks speculative decoding gave back at once (rejected drafts), all requests."""

    def _never_fits(self, req: Request) -> bool:
        """Nothing runs and ``req`` was refused: true when its footprint exceeds the whole KV
        capacity, or when it was refused ``STALL_LIMIT`` times in a row with nothing running
        and no host-tier copy in flight (the live budget leaves no room; only memory freed
        outside the pool could change that)."""
        if req.num_tokens + 1 > self.mgr.capacity().total_tokens:
            return True
        if self._copies_in_flight():  # host-tier copies pin blocks until they end
            return False
        self._stalls = self._stalls + 1 if self._stall_id == req.request_id else 1
        self._stall_id = req.request_id
        return self._stalls >= self.STALL_LIMIT

    def _copies_in_flight(self) -> bool:
        """Host-tier copies are under way (they pin device blocks; the pins end with them)."""
        host = getattr(self.mgr, "host", None)
        return bool(host is not None and host.in_flight)

    STALL_LIMIT = 64
    _stalls = 0
    _stall_id: str | None = None

    def _prefix_being_filled(self, req: Request, computed: int,
                             prefilling: Sequence[Request]) -> bool:
        """Whether a running request's prefill (scheduled this step or still under way) is
        computing the block that would extend ``req``'s prefix hit (``computed`` tokens, block
        aligned): the same first ``computed + block_size`` tokens under the same salt, not yet
        computed by it. ``req`` then waits until that request commits the block and the
        prefix cache publishes it, and is admitted on it instead of prefilling the same
        tokens a second time. Only a block ``req`` could hit counts (complete, and not its
        prompt's last token), and only with a prefix cache. ``prefilling``: the running
        requests whose prompt is not computed yet."""
        bs = self.block_size
        end = computed + bs
        tokens = req.all_token_ids
        if end > (len(tokens) - 1) // bs * bs:
            return False
        head = None
        for r in prefilling:
            if (r.num_computed_tokens < end <= r.num_prompt_tokens
                    and r.cache_salt == req.cache_salt):
                if head is None:
                    head = tokens[:end]
                if r.all_token_ids[:end] == head:
                    return True
        return False

    def _sibling_prefilling(self, req: Request) -> bool:
        for r in self.running:
            if r.parent_id == req.parent_id and r.num_computed_tokens < r.num_prompt_tokens:
                return True
        return False

    # -- results -------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, token_ids: Sequence[int | Sequence[int]] = (),
               logprobs: Sequence[Any] | None = None,
               execution_peak_bytes: int = 0) -> list[EngineOutput]:
        """Apply a step's results: ``token_ids[i]`` / ``logprobs[i]`` sampled for
        ``out.sampled[i]``. Returns one :class:`EngineOutput` per request that produced a token
        or finished.

        Speculative decoding: for a chunk with ``spec_token_ids``, ``token_ids[i]`` is the list
        of tokens verification emitted (the accepted drafts, then the target's token) and
        ``logprobs[i]`` a list of the same length (or None). They are appended one by one until
        a stop condition; the accepted drafts hold valid KV (``num_computed_tokens`` = the
        chunk's start + 1 + accepted drafts kept), and the blocks beyond that go back at once
        (``mgr.truncate``: the rejected drafts' KV is never published)."""
        self.steps += 1
        if execution_peak_bytes > 0:
            self.execution_peak_bytes = max(self.execution_peak_bytes, execution_peak_bytes)
            if self.pool is not None:
                self.pool.observe_execution_peak(execution_peak_bytes)
        num_sampled = sum(1 for c in out.chunks if c.sample)
        if len(token_ids) != num_sampled:
            raise ValueError(f"{len(token_ids)} sampled tokens for {num_sampled} sampled chunks")
        results: list[EngineOutput] = []
        add = results.append
        commit = self.mgr.commit
        max_len = self.max_model_len
        running = RequestStatus.RUNNING
        now = time.monotonic()
        generated = 0
        j = -1  # row of token_ids: sampled chunks in chunk order
        for c in out.chunks:
            req = c.request
            if c.sample:
                j += 1
            if req.status is not running:  # aborted meanwhile
                continue
            rid = req.request_id
            if not c.sample:
                req.num_computed_tokens = c.start_pos + c.num_tokens
                commit(rid, req.num_computed_tokens, req.all_token_ids)
                continue
            got, lp_got = token_ids[j], logprobs[j] if logprobs is not None else None
            if not c.spec_token_ids:  # one token: the common case, no per-token loop
                tok = int(got)
                req.append_output(tok)
                new = [tok]
                if lp_got is not None:
                    req.output_logprobs.append(lp_got)
                    new_lps = [lp_got]
                else:
                    new_lps = None
                generated += 1
                status = req.check_stop(tok, max_len)
            else:
                toks = [int(t) for t in got]
                lps = list(lp_got) if lp_got is not None else [None] * len(toks)
                new = []
                new_lps = []
                status = None
                for tok, lp in zip(toks, lps):
                    req.append_output(tok)
                    new.append(tok)
                    if lp is not None:
                        req.output_logprobs.append(lp)
                        new_lps.append(lp)
                    generated += 1
                    status = req.check_stop(tok, max_len)
                    if status is not None:
                        break
                new_lps = new_lps or None
            # the chunk's tokens and the accepted drafts before the last new token hold KV
            req.num_computed_tokens = c.start_pos + c.num_tokens + len(new) - 1
            commit(rid, req.num_computed_tokens, req.all_token_ids)
            if req.spec_token_ids or req.spec_draft_probs is not None:
                req.spec_token_ids, req.spec_draft_probs = [], None
            if req.first_token_time is None:
                req.first_token_time = now
            if status is None:
                if c.spec_token_ids:
                    self._truncate(rid, req.num_computed_tokens)
                add(EngineOutput(rid, new, False, None, None, new_lps, len(req.prompt_token_ids),
                                 max(req.num_cached_tokens, 0), req.parent_id or rid,
                                 req.sample_index))
            else:
                self._finish(req, status)
                add(EngineOutput(rid, new, True, status.finish_reason, req.stop_reason, new_lps,
                                 len(req.prompt_token_ids), max(req.num_cached_tokens, 0),
                                 req.parent_id or rid, req.sample_index))
        self.generation_tokens += generated
        for req in out.finished:
            rid = req.request_id
            add(EngineOutput(rid, [], True, req.finish_reason, None, None, req.num_prompt_tokens,
                             max(req.num_cached_tokens, 0), req.parent_id or rid,
                             req.sample_index))
        return results


__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput"]
