"""What the engine returns: per-step engine outputs, vLLM-shaped request outputs, and the
:class:`OutputProcessor` that turns token ids into text.

Layers: ``LLMEngine.step()`` returns :class:`EngineOutput` (token ids only, per request that
progressed). :class:`OutputProcessor` (shared by ``LLM.generate`` and the server's front) keeps
one :class:`RequestState` per request: incremental detokenization (no broken UTF-8), stop
strings (checked once ``min_tokens`` outputs exist; the caller aborts the request in the engine,
the finish reason stays "stop" with the string as ``stop_reason``), and the text delta that is
safe to stream (the last ``len(longest stop) - 1`` characters are held back until they cannot
start a stop string). No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from xllm_vmm.engine.detokenizer import IncrementalDetokenizer
from xllm_vmm.engine.request import child_request_id


@dataclass
class Logprob:
    """A token's log-probability under the raw model distribution, its rank (1 = most likely),
    and its text (filled by the OutputProcessor)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class EngineOutput:
    """One request's progress in one ``LLMEngine.step()``."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None          # "stop" | "length" | "abort"
    stop_reason: int | str | None = None      # the stop token id (or string, set by OutputProcessor)
    new_logprobs: list[dict[int, Logprob]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    parent_request_id: str | None = None
    """The id given to ``add_request`` (differs from ``request_id`` for a parallel sample)."""
    index: int = 0
    """Which parallel sample (0 .. n-1)."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """On a request's first output when ``SamplingParams.prompt_logprobs`` is set: one entry per
    prompt token, None for position 0 (engine.prompt_logprobs)."""
    error: str | None = None
    """Set (with ``finished`` and finish_reason "error") when this request alone failed in the
    step (non-finite logits, a seed its generator refuses): what failed. ``stop_reason`` holds it
    too, so that offline callers read it from the CompletionOutput."""


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All samples of one prompt (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """vLLM's: per prompt token ``{token id: Logprob}`` (the token itself plus the
    ``prompt_logprobs`` most likely), None for position 0; None when not asked for."""


@dataclass(slots=True)
class RequestUpdate:
    """What one ``OutputProcessor.process`` call changed for one request."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    delta_logprobs: list[dict[int, Logprob]] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    parent_id: str = ""
    index: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """Set on the update that first carries them (see ``RequestOutput.prompt_logprobs``)."""


class RequestState:
    """Text-side state of one request (one sample)."""

    def __init__(self, request_id: str, params: Any, prompt_token_ids: Sequence[int], tokenizer: Any,
                 *, prompt: str | None = None, parent_id: str | None = None, index: int = 0) -> None:
        self.request_id = request_id
        self.params = params
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._tok = tokenizer
        self._detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                       if params.detokenize and tokenizer is not None else None)
        self._stops: list[str] = list(params.stop_strings)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._emitted = 0
        self._ids_only = self._detok is None and self.logprobs is None
        """No text and no logprobs to fold in: :meth:`apply` only extends the token ids
        (``detokenize=False``, the benches' and token-id clients' case)."""
        self._text_only = (self._detok is not None and self.logprobs is None
                           and not self._stops)
        """Text without stop strings or logprobs (``generate``'s default): nothing is held
        back, so each update's delta is exactly what the detokenizer emitted."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason)

    def apply(self, out: EngineOutput) -> tuple[RequestUpdate, bool]:
        """Fold one engine output in; returns the update and whether a stop string ended it
        (the caller must then abort the request in the engine)."""
        if self._ids_only and out.prompt_logprobs is None:  # no text, no logprobs: ids only
            ids = out.new_token_ids
            self.token_ids.extend(ids)
            self.num_cached_tokens = out.num_cached_tokens
            if out.finished and self.finish_reason is None:
                self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            return RequestUpdate(self.request_id, "", ids, None, self.finished,
                                 self.finish_reason, self.stop_reason, len(self.prompt_token_ids),
                                 self.num_cached_tokens, self.parent_id, self.index), False
        if self._text_only and out.prompt_logprobs is None:  # no stops, no logprobs
            ids = out.new_token_ids
            self.token_ids.extend(ids)
            self.num_cached_tokens = out.num_cached_tokens
            d = self._detok
            delta = d.add(ids)
            if out.finished:
                delta += d.flush()
                if self.finish_reason is None:
                    self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self.text = d.text
            self._emitted = len(self.text)
            return RequestUpdate(self.request_id, delta, ids, None, self.finished,
                                 self.finish_reason, self.stop_reason, len(self.prompt_token_ids),
                                 self.num_cached_tokens, self.parent_id, self.index), False
        ids = list(out.new_token_ids)
        self.token_ids.extend(ids)
        self.num_cached_tokens = out.num_cached_tokens
        new_prompt_lps = out.prompt_logprobs
        if new_prompt_lps is not None:
            if self._tok is not None:
                for d in new_prompt_lps:
                    for t, lp in (d or {}).items():
                        if lp.decoded_token is None:
                            lp.decoded_token = self._tok.decode([t], skip_special_tokens=False)
            self.prompt_logprobs = new_prompt_lps
        new_lps = None
        if out.new_logprobs is not None and self.logprobs is not None:
            new_lps = []
            for d, tid in zip(out.new_logprobs, ids):
                if self._tok is not None:
                    for t, lp in d.items():
                        if lp.decoded_token is None:
                            lp.decoded_token = self._tok.decode([t], skip_special_tokens=False)
                new_lps.append(d)
                if tid in d and self.cumulative_logprob is not None:
                    self.cumulative_logprob += d[tid].logprob
            self.logprobs.extend(new_lps)
        stopped_by_string = False
        if self._detok is not None:
            before = len(self.text)
            self._detok.add(ids)
            if out.finished:
                self._detok.flush()
            self.text = self._detok.text if self._stop_cut is None else self.text
            if (self._stops and self._stop_cut is None
                    and len(self.token_ids) >= self.params.min_tokens):
                start = max(0, before - self._hold)
                best = None
                for s in self._stops:
                    i = self.text.find(s, start)
                    if i >= 0 and (best is None or i < best[0]):
                        best = (i, s)
                if best is not None:
                    i, s = best
                    self._stop_cut = i + len(s) if self.params.include_stop_str_in_output else i
                    self.text = self.text[: self._stop_cut]
                    self.finish_reason, self.stop_reason = "stop", s
                    stopped_by_string = True
        if not stopped_by_string and out.finished and self.finish_reason is None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        end = len(self.text) if self.finished else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        upd = RequestUpdate(self.request_id, delta, ids, new_lps, self.finished, self.finish_reason,
                            self.stop_reason, len(self.prompt_token_ids), self.num_cached_tokens,
                            self.parent_id, self.index, new_prompt_lps)
        return upd, stopped_by_string

    _stop_cut: int | None = None


@dataclass
class ProcessResult:
    updates: list[RequestUpdate]
    to_abort: list[str]
    """Requests a stop string finished: abort them in the engine (their text is final)."""


class OutputProcessor:
    """Detokenization, stop strings and per-request text state (see the module docstring).

    ``add_request`` before the request's first output; ``process`` each step's outputs; a
    finished request's state stays until ``pop`` (``LLM.generate`` reads it then)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self._parents: dict[str, list[str]] = {}

    def add_request(self, request_id: str, params: Any, prompt_token_ids: Sequence[int], *,
                    prompt: str | None = None) -> list[RequestState]:
        """Track ``request_id`` — its ``params.n`` parallel samples, under the ids the engine
        gives them (:func:`~xllm_vmm.engine.request.child_request_id`)."""
        n = params.n
        kids = [child_request_id(request_id, i, n) for i in range(n)]
        if request_id in self._parents or any(k in self.states for k in kids):
            raise ValueError(f"request {request_id!r} is already tracked")
        out = []
        for i, kid in enumerate(kids):
            p = params if n == 1 else params.for_sibling(i)
            st = RequestState(kid, p, prompt_token_ids, self.tokenizer, prompt=prompt,
                              parent_id=request_id, index=i)
            self.states[kid] = st
            out.append(st)
        self._parents[request_id] = kids
        return out

    def finished(self, request_id: str) -> bool:
        """Every sample of ``request_id`` finished."""
        return all(self.states[k].finished for k in self._parents[request_id])

    def request_output(self, request_id: str) -> RequestOutput:
        """The vLLM-shaped output of ``request_id`` so far (all its samples, by index)."""
        sts = [self.states[k] for k in self._parents[request_id]]
        first = sts[0]
        return RequestOutput(request_id, first.prompt, list(first.prompt_token_ids),
                             [s.completion() for s in sts], all(s.finished for s in sts),
                             max(s.num_cached_tokens for s in sts),
                             prompt_logprobs=first.prompt_logprobs)

    def process(self, outputs: Iterable[EngineOutput]) -> ProcessResult:
        ups: list[RequestUpdate] = []
        abort: list[str] = []
        for out in outputs:
            st = self.states.get(out.request_id)
            if st is None or st.finished:
                continue
            upd, stop = st.apply(out)
            ups.append(upd)
            if stop and not out.finished:
                abort.append(out.request_id)
        return ProcessResult(ups, abort)

    def pop(self, request_id: str) -> RequestOutput | None:
        """Stop tracking ``request_id`` (a parent id: all its samples); returns its output."""
        if request_id not in self._parents:
            return None
        out = self.request_output(request_id)
        for k in self._parents.pop(request_id):
            self.states.pop(k, None)
        return out

    def has(self, request_id: str) -> bool:
        return request_id in self._parents


__all__ = ["CompletionOutput", "EngineOutput", "Logprob", "OutputProcessor", "ProcessResult",
           "RequestOutput", "RequestState", "RequestUpdate"]
