"""A request's state on the driver side (and, re-exported, the error a bad request raises).

A :class:`Request` is one sequence (a parallel sample of ``n`` is its own request, a *sibling*
sharing the prompt). Its token list is ``prompt_token_ids + output_token_ids``;
``num_computed_tokens`` of them hold KV in the cache (prefix-cache hits included). The scheduler
gives a request chunks until ``num_computed_tokens == num_tokens - 0``; a chunk that reaches the
end of the token list is sampled and appends one output token, so a running decode always has
exactly one uncomputed token.

States: WAITING (not yet admitted, or preempted: every block freed, ``num_computed_tokens`` 0,
recomputed from the whole token list when readmitted) → RUNNING → FINISHED_* (blocks freed).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xllm_vmm.engine.request_error import RequestError

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.engine.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Id of parallel sample ``index`` of ``n``: the request id itself when ``n == 1``, else
    ``{request_id}#{index}``."""
    return request_id if n == 1 else f"{request_id}#{index}"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish_reason ("stop" | "length" | "abort"), None while unfinished."""
        return self.value if self.finished else None


@dataclass(eq=False)
class Request:
    """One sequence's driver-side state (module docstring). Compared by identity (``eq=False``):
    the scheduler's ``list.remove`` / ``in`` over running requests would otherwise build and
    compare every field of every request before the one sought (milliseconds when a whole
    batch finishes in one step)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()
    parent_id: str | None = None
    """For a parallel sample (n > 1): the id the caller gave; siblings are
    :func:`child_request_id` of it. None for a plain request."""
    sample_index: int = 0
    """Which parallel sample of ``parent_id`` this is (0 .. n-1; 0 for a plain request):
    ``EngineOutput.index``."""
    cache_salt: str | None = None
    """vLLM's ``cache_salt``: an extra key of the request's first block hash (passed to the KV
    cache manager's ``lookup``), so requests with different salts never share a cached block;
    None = no salt (validated by ``LLMEngine.add_request``: a non-empty string)."""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served by the prefix cache at first admission (-1 until admitted)."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    generator: Any = None
    """torch.Generator of a seeded request (created by the sampler on first use)."""
    first_token_time: float | None = None
    admitted_order: int = -1
    """Monotonic admission counter: preemption takes the highest (newest) first."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: the draft's proposals for the positions after the last
    token, verified by the target in the request's next decode step (empty: plain decode)."""
    plain_greedy_from: int = -1
    """Outputs from which this request's next token is the raw argmax (greedy, no logprobs, no
    penalties: ``min_tokens``; never: ``sys.maxsize``); -1 until the sampler first sees it
    (``Sampler._plain_from``)."""
    spec_draft_probs: Any = None
    """The draft distributions ``(len(spec_token_ids), vocab)`` the proposals were sampled
    from (None for a greedy request): the rejection rule's ``q``."""
    _all: list[int] | None = field(default=None, repr=False, compare=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens: one list kept across steps (read it, do not modify it;
        outputs go through :meth:`append_output`)."""
        a = self._all
        if a is None or len(a) != len(self.prompt_token_ids) + len(self.output_token_ids):
            a = self._all = self.prompt_token_ids + self.output_token_ids
        return a

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self._all is not None:
            self._all.append(token_id)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def check_stop(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """The finished state after ``token_id`` was appended, or None to go on.

        Order (vLLM's): min_tokens holds off EOS/stop ids (the sampler already masks them);
        EOS (unless ignore_eos) → stop, stop_reason None; a stop token id → stop, stop_reason
        the id; max_tokens or max_model_len reached → length.
        """
        p = self.params
        n_out = len(self.output_token_ids)  # runs for every sampled token: no properties
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token_id in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            stop_ids = p.stop_token_ids
            if stop_ids and token_id in stop_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(self.prompt_token_ids) + n_out >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


__all__ = ["Request", "RequestError", "RequestStatus", "child_request_id"]
