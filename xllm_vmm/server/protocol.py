"""Request bodies of the OpenAI-compatible routes (pydantic), and their sampling parameters.

Field names and defaults are OpenAI's (and vLLM's extensions that load generators send:
``ignore_eos``, ``min_tokens``, ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``stream_options.continuous_usage_stats``). Unknown fields are ignored, as
vLLM does, so that clients sending newer fields still work; fields this server cannot honour
(``suffix``, a non-empty ``logit_bias``, ``best_of`` above ``n``, tools) are refused with a 400
that names them rather than silently dropped.

Every range check raises through pydantic so that the route answers one 400 whose ``param`` is
the field (``errors.from_validation``). Units: token counts are tokens; probabilities are in
[0, 1].
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from xllm_vmm.engine.sampling_params import (  # the engine's (and OpenAI's) limits
    MAX_LOGPROBS,
    MIN_REPETITION_PENALTY,
    SEED_MAX,
    SEED_MIN,
)

MAX_N = 16          # choices per request (each is one engine request)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """The sampling fields shared by both generation routes."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=100.0,
                                      allow_inf_nan=False)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    #: vLLM's extra parameter: requests with different salts never share prefix-cache blocks
    #: (an extra key of the first block's hash); a non-empty string
    cache_salt: Optional[str] = None

    @field_validator("max_tokens", "max_completion_tokens", "top_k", "n", "seed", "min_tokens",
                     "top_logprobs", "prompt_logprobs", "best_of",
                     mode="before", check_fields=False)
    @classmethod
    def _not_bool(cls, v):
        """JSON true/false is not an integer (pydantic would read true as 1)."""
        if isinstance(v, bool):
            raise ValueError(f"must be an integer, not a boolean ({str(v).lower()})")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return None
        items = [v] if isinstance(v, str) else list(v)
        if len(items) > 16:
            raise ValueError("at most 16 stop strings")
        if any(s == "" for s in items):
            raise ValueError("a stop string must not be empty")
        return items

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _cache_salt(cls, v):
        if v is not None and (not isinstance(v, str) or not v):
            raise ValueError(f"cache_salt must be a non-empty string when given, got {v!r}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server (send no logit_bias)")
        return None

    @field_validator("seed")
    @classmethod
    def _seed_n(cls, v, info):
        """Choice ``i`` is seeded with ``seed + i``: the last one must fit too (``n`` is
        declared before ``seed``, so it is validated by now)."""
        n = info.data.get("n", 1)
        if v is not None and v + n - 1 > SEED_MAX:
            raise ValueError(f"seed + n - 1 must be at most 2**64 - 1 (choice i uses seed + i), "
                             f"got seed {v} with n {n}")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def requested_max_tokens(self) -> Optional[int]:
        """``max_completion_tokens`` wins over the older ``max_tokens`` (OpenAI's rule)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling_kwargs(self, *, max_tokens: int, logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None) -> dict[str, Any]:
        """Keyword arguments of the engine's ``SamplingParams`` (vLLM's field names); fields the
        client did not send are left out so that the engine's defaults apply."""
        kw: dict[str, Any] = {"max_tokens": max_tokens, "n": 1,
                              "presence_penalty": self.presence_penalty,
                              "frequency_penalty": self.frequency_penalty,
                              "repetition_penalty": self.repetition_penalty,
                              "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.stop:
            kw["stop"] = list(self.stop)
        if self.stop_token_ids:
            kw["stop_token_ids"] = list(self.stop_token_ids)
        if logprobs is not None:
            kw["logprobs"] = logprobs
        if prompt_logprobs is not None:
            kw["prompt_logprobs"] = prompt_logprobs
        return kw

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_Sampling):
    prompt: PromptType
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    #: vLLM's extra parameter: the most likely tokens per prompt position (0: the prompt
    #: token's own log-probability only), returned as the choice's ``prompt_logprobs``
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[int] = Field(default=None, ge=1)
    suffix: Optional[str] = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_not_bool(cls, v):
        """A completion's ``logprobs`` is a count (a chat completion's is a boolean)."""
        if isinstance(v, bool):
            raise ValueError(f"must be an integer, not a boolean ({str(v).lower()})")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported by this server")
        return None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and all(isinstance(x, list) for x in v) and any(not x for x in v):
            raise ValueError("a token-id prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported (leave it out)")
        return self

    def engine_prompt_logprobs(self) -> Optional[int]:
        """What the engine is asked for (``SamplingParams.prompt_logprobs``): the explicit
        ``prompt_logprobs``, else ``logprobs`` when ``echo`` is set (the echoed prompt's tokens
        carry log-probabilities too, as OpenAI's legacy completions do), else None."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, list):
            for part in v:
                if part.type != "text":
                    raise ValueError(f"content part of type {part.type!r} is not supported by "
                                     "this text model (send type 'text')")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: Optional[list[Any]] = None
    #: vLLM's extra parameter: the ``k`` most likely tokens per prompt position of the rendered
    #: chat prompt (0: the prompt token's own log-probability only), returned as the
    #: response's top-level ``prompt_logprobs`` (streamed: on the first chunk)
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        if v:
            raise ValueError("tools are not supported by this server")
        return None

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def num_logprobs(self) -> Optional[int]:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(BaseModel):
    """``/tokenize``: either ``prompt`` or ``messages`` (vLLM's body)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[int]
