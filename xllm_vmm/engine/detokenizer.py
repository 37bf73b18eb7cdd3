"""Incremental detokenization: text deltas as tokens arrive, never a broken UTF-8 character.

Byte-level tokenizers split multi-byte characters across tokens; decoding a prefix then ends in
U+FFFD. The detokenizer keeps two offsets into the token list (vLLM's scheme): ``prefix_offset``
(context decoded once more so that tokenizers that strip a leading space, or merge across
tokens, render the same as a whole decode) and ``read_offset`` (tokens whose text was emitted).
A delta is emitted only when the new text is longer than the context's and does not end in
U+FFFD; :meth:`flush` emits what remains at the end (so ``text`` then equals a decode of all
output tokens, up to tokenizers that rewrite across the prompt boundary).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5
"""Prompt tokens decoded as context before the first output token."""


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        ctx = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids: list[int] = ctx
        self._prompt_ctx = len(ctx)
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self.text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._prompt_ctx:]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=self._skip) if ids else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text they complete (possibly "").

        Runs for every request of every step: the two decodes are called on the slices
        directly (fresh lists already), without :meth:`_decode`'s extra copy."""
        ids = self._ids
        ids.extend(token_ids)
        decode, skip, start = self._tok.decode, self._skip, self._prefix_offset
        prefix = decode(ids[start:self._read_offset], skip_special_tokens=skip) \
            if self._read_offset > start else ""
        full = decode(ids[start:], skip_special_tokens=skip) if len(ids) > start else ""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Emit whatever the pending tokens decode to (end of the output), U+FFFD included."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        delta = full[len(prefix):] if full.startswith(prefix) else self._decode(self._ids[self._read_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta


__all__ = ["IncrementalDetokenizer"]
