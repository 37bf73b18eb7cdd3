"""The engine's tokenizer: a model directory's ``tokenizer.json`` and chat template, light.

Built on the ``tokenizers`` library and a sandboxed jinja2 environment configured as Hugging
Face transformers renders chat templates (``trim_blocks``, ``lstrip_blocks``, loop controls,
``tojson``, ``raise_exception``, ``strftime_now``; variables ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``, ``tools``),
so importing it costs milliseconds rather than transformers' seconds.

Sources, as transformers reads them: ``tokenizer.json``; ``tokenizer_config.json``
(``chat_template``, special token strings, ``add_bos_token`` handled by the post-processor in
tokenizer.json); ``chat_template.jinja`` (transformers ≥ 4.43 writes the template there);
``generation_config.json`` / ``config.json`` ``eos_token_id`` (int or list) for EOS ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    """A model directory's tokenizer files are missing or unusable (message says which)."""


def _token_str(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


class Tokenizer:
    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 special: dict[str, str | None] | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.special = dict(special or {})
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self._template = None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(model_dir)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(
                f"{d}: no tokenizer.json (the engine reads a fast tokenizer's tokenizer.json; "
                "save one with tokenizer.save_pretrained())"
            )
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{tj}: cannot be read as a tokenizer ({e})") from None
        cfg = _read_json(d / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = d / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos: list[int] = []
        for f in ("generation_config.json", "config.json"):
            v = _read_json(d / f).get("eos_token_id")
            if isinstance(v, int):
                eos.append(v)
            elif isinstance(v, list):
                eos.extend(int(x) for x in v)
        if special.get("eos_token"):
            tid = tok.token_to_id(special["eos_token"])
            if tid is not None:
                eos.append(tid)
        return cls(tok, chat_template=template, special=special, eos_token_ids=eos)

    # -- the interface the engine and the server use ---------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render ``messages`` with the model's chat template (as transformers does).

        ``tokenize=True`` returns token ids (encoded without added special tokens: the template
        writes them). Raises :class:`TokenizerError` when the model has no chat template."""
        if not self.chat_template:
            raise TokenizerError("this model's tokenizer has no chat template (tokenizer_config.json "
                                 "'chat_template' or chat_template.jinja); send a plain prompt instead")
        if self._template is None:
            self._template = _compile(self.chat_template)
        ctx: dict[str, Any] = {"tools": None, "documents": None, **self.special, **kwargs}
        text = self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **ctx)
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text


def _read_json(p: Path) -> dict[str, Any]:
    if not p.is_file():
        return {}
    try:
        v = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{p}: not valid JSON ({e})") from None
    return v if isinstance(v, dict) else {}


def _compile(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(f"the chat template does not compile: {e}") from None


__all__ = ["Tokenizer", "TokenizerError"]
