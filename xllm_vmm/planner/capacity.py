"""Block and slot arithmetic of one worker's KV pool: pure integer functions.

A pool is split into *units*: in VMM modes a unit of group ``g`` is one slot (one page in every
tensor of the group, ``slot_bytes``) holding ``blocks_per_page`` blocks; in physical mode a unit
is one block across every tensor of the group (``block_bytes``). A block never straddles a page.

For ``c`` sequences of ``L`` tokens, group ``g`` needs ``c x seq_blocks(g, L)`` blocks, i.e.
``ceil(c x seq_blocks(g, L) / blocks_per_unit)`` units, where ``seq_blocks`` is
``ceil(L / block_size)`` for a group that grows with the context and, for a sliding-window group
(window ``w``), ``min(ceil(L / block_size), ceil((w + block_size - 1) / block_size))``: the newest
``w`` tokens span at most that many blocks.

A sliding group also holds, once per pool, the prefill chunk in flight: while a chunk of ``C``
tokens (``C = min(max_tokens_per_batch, L)`` with chunked prefill, else ``L``) is prefilled, its
sequence keeps the ``w - 1`` tokens before the chunk and the chunk itself, which span up to
``min(ceil(L / block_size), ceil((w - 1 + C + block_size - 1) / block_size))`` blocks; the
blocks beyond the sequence's window are :meth:`Unit.prefill_extra` (added once, not per sequence:
one batch holds at most ``max_tokens_per_batch`` prefill tokens).
"""

from __future__ import annotations

from xllm_vmm.models.search import largest  # noqa: F401  (the one home; re-exported)

from dataclasses import dataclass


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Unit:
    """How one group is carved: ``unit_bytes`` per unit, ``blocks_per_unit`` blocks each."""

    name: str
    unit_bytes: int
    blocks_per_unit: int
    block_size: int
    window: int | None = None  # sliding cap in tokens; None = grows with the context
    chunk: int = 0  # tokens of the prefill chunk in flight (sliding groups; 0 = none)

    def span(self, tokens: int) -> int:
        """Most blocks ``tokens`` consecutive tokens can touch (they may start mid-block)."""
        return ceil_div(tokens + self.block_size - 1, self.block_size) if tokens > 0 else 0

    def seq_blocks(self, tokens: int) -> int:
        """Blocks one sequence of ``tokens`` tokens holds in this group (decoding)."""
        full = ceil_div(tokens, self.block_size)
        if self.window is None:
            return full
        return min(full, self.span(self.window))

    def prefill_extra(self, tokens: int) -> int:
        """Blocks beyond :meth:`seq_blocks` that a sequence of ``tokens`` tokens holds while a
        prefill chunk is in flight: the ``window - 1`` tokens before the chunk plus the chunk
        (``min(chunk, tokens)`` tokens). 0 for a group that grows with the context."""
        if self.window is None or self.chunk <= 0:
            return 0
        full = ceil_div(tokens, self.block_size)
        held = min(full, self.span(self.window - 1 + min(self.chunk, tokens)))
        return max(0, held - self.seq_blocks(tokens))

    def bytes_for_blocks(self, blocks: int) -> int:
        return ceil_div(blocks, self.blocks_per_unit) * self.unit_bytes


def demand(units: list[Unit], seqs: int, tokens: int) -> int:
    """Pool bytes ``seqs`` sequences of ``tokens`` tokens need, every group together (with the
    prefill chunk in flight of sliding groups, once, when ``seqs > 0``)."""
    return sum(u.bytes_for_blocks(seqs * u.seq_blocks(tokens)
                                  + (u.prefill_extra(tokens) if seqs > 0 else 0))
               for u in units)




def max_seqs(units: list[Unit], tokens: int, budget: int, per_seq_extra: int = 0) -> int:
    """Most sequences of ``tokens`` tokens whose blocks (plus ``per_seq_extra`` bytes each, the
    resident state of hybrid models) fit in ``budget`` bytes; found exactly (0 if none)."""
    if budget <= 0:
        return 0
    one = demand(units, 1, tokens) + per_seq_extra
    if one <= 0:
        return 0
    hi = budget // max(1, sum(u.seq_blocks(tokens) * (u.unit_bytes // u.blocks_per_unit)
                               for u in units) + per_seq_extra) + 2
    hi = max(hi, 2)
    found = largest(lambda c: demand(units, c, tokens) + c * per_seq_extra <= budget, 0, hi)
    return max(found or 0, 0)


def max_blocks(units: list[Unit], budget: int) -> int:
    """Most blocks ``N`` such that every group holding ``N`` blocks fits in ``budget`` bytes."""
    if budget <= 0 or not units:
        return 0
    per_block = sum(u.unit_bytes for u in units)  # >= bytes of one block in every group
    hi = (budget // max(1, min(u.unit_bytes // u.blocks_per_unit for u in units))) + 2
    del per_block
    found = largest(lambda n: sum(u.bytes_for_blocks(n) for u in units) <= budget, 0, hi)
    return max(found or 0, 0)
