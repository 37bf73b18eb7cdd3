"""Sampling parameters of one request, with vLLM's field names and meanings.

Every bad value raises :class:`~xllm_vmm.engine.request_error.RequestError` naming the parameter
(``param``) and what to do, never a bare traceback. No torch here (the server front imports it).

Meanings (as vLLM's): ``temperature`` < 1e-5 is greedy (top_p/top_k/min_p then have no effect);
``top_k`` 0 or -1 = off; ``top_p`` 1.0 = off; ``min_p`` 0.0 = off (keep tokens whose probability
is at least ``min_p`` times the most likely one's); ``seed`` makes the request's samples
reproducible whatever else runs beside it; ``max_tokens`` None = up to ``max_model_len``;
``min_tokens``: EOS and ``stop_token_ids`` cannot end the output before that many tokens;
``stop``: strings that end the output (not included unless ``include_stop_str_in_output``);
``logprobs``: number of most likely tokens whose log-probabilities are returned beside the sampled
one (None = none, 0 = the sampled token only); ``prompt_logprobs``: number of most likely tokens
whose log-probabilities are returned at every prompt position beside the prompt's own token
(None = none, 0 = the prompt token only; position 0 has none; raw logits, no penalties: vLLM's
meaning); ``presence_penalty``/``frequency_penalty`` in
[-2, 2] over generated tokens; ``repetition_penalty`` > 0 over prompt and generated tokens (1 = off);
``n``: parallel samples of one prompt (sibling requests sharing the prompt's blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from xllm_vmm.engine.request_error import RequestError

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)."""

MAX_LOGPROBS = 20
"""Most top log-probabilities one request may ask for (OpenAI's limit)."""

MIN_REPETITION_PENALTY = 1e-6
"""Smallest repetition penalty: a positive logit is divided by it, and a denormal penalty
(1e-323) made it inf and the whole distribution NaN."""

SEED_MIN = -(2 ** 63)
SEED_MAX = 2 ** 64 - 1
"""The seeds a generator takes (torch's ``manual_seed``: a signed or unsigned 64-bit integer);
parallel samples use ``seed + index``, so ``seed + n - 1`` must not pass ``SEED_MAX``."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    prompt_logprobs: int | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check()
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    # -- derived -------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """True when the sampled token is the argmax (temperature below ``SAMPLING_EPS``)."""
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (empty when unset)."""
        return list(self._stop_list)

    @property
    def top_k_effective(self) -> int:
        """``top_k`` with -1 folded into 0 (off)."""
        return 0 if self.top_k in (0, -1) else self.top_k

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def for_sibling(self, index: int) -> SamplingParams:
        """Parameters of parallel sample ``index`` of ``n``: n=1, and ``seed + index`` when seeded
        (so siblings differ and each stays reproducible)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

    # -- validation ----------------------------------------------------------------------
    def _check(self) -> None:
        def bad(param: str, message: str) -> RequestError:
            return RequestError(param=param, message=message)

        def number(param: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(param, f"{param} must be a finite number, got {value!r}")
            return float(value)

        def integer(param: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(param, f"{param} must be an integer, got {value!r}")
            return value

        if integer("n", self.n) < 1:
            raise bad("n", f"n must be at least 1, got {self.n}")
        if number("temperature", self.temperature) < 0:
            raise bad("temperature", f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < number("top_p", self.top_p) <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if integer("top_k", self.top_k) < -1:
            raise bad("top_k", f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= number("min_p", self.min_p) <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.seed is not None:
            if not SEED_MIN <= integer("seed", self.seed) <= SEED_MAX:
                raise bad("seed", f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
            if self.seed + self.n - 1 > SEED_MAX:
                raise bad("seed", f"seed + n - 1 must be at most 2**64 - 1 (parallel sample i "
                                  f"uses seed + i), got seed {self.seed} with n {self.n}")
        if self.max_tokens is not None and integer("max_tokens", self.max_tokens) < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if integer("min_tokens", self.min_tokens) < 0:
            raise bad("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                    f"({self.max_tokens})")
        if self.stop is not None:
            items = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
                raise bad("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
            if any(s == "" for s in items):
                raise bad("stop", "stop strings must not be empty")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
            ):
                raise bad("stop_token_ids", f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        if self.logprobs is not None:
            if not 0 <= integer("logprobs", self.logprobs) <= MAX_LOGPROBS:
                raise bad("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None:
            if not 0 <= integer("prompt_logprobs", self.prompt_logprobs) <= MAX_LOGPROBS:
                raise bad("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                                             f"got {self.prompt_logprobs}")
        for p in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(p, getattr(self, p)) <= 2.0:
                raise bad(p, f"{p} must be in [-2, 2], got {getattr(self, p)}")
        if number("repetition_penalty", self.repetition_penalty) < MIN_REPETITION_PENALTY:
            raise bad("repetition_penalty",
                      f"repetition_penalty must be at least {MIN_REPETITION_PENALTY} (1 = off; "
                      f"smaller ones overflow the logits), got {self.repetition_penalty}")


__all__ = ["MAX_LOGPROBS", "MIN_REPETITION_PENALTY", "SAMPLING_EPS", "SEED_MAX", "SEED_MIN", "SamplingParams"]
