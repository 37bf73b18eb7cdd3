"""The step description: what the scheduler (driver side) hands a worker, and what comes back.

Plain data, the seam between scheduling and compute (``xllm_vmm.engine``): a worker
never sees requests, sampling parameters or the KV cache manager, only chunks of token ids with
their positions and block tables. Tensor-parallel workers receive the same ``StepInput`` (the
same block tables on every worker); an MTP draft later reads ``StepOutput.hidden_states``.

Units: positions and lengths are tokens; block ids index a cache group's blocks; a *slot* in
``slot_mapping`` is the flat token slot ``block_id * block_size + pos % block_size`` of the
group's K/V tensors viewed as ``(num_blocks * block_size, ...)``.

Invariants ``StepInput.build`` checks (``ValueError`` naming the chunk otherwise):

- every chunk computes at least one token; ``start_pos >= 0``;
- every chunk's block table has the same groups, and each group's list covers
  ``[0, start_pos + len(token_ids))`` (at least ``ceil(seq_len / block_size)`` blocks, ids >= 0);
- request ids are unique within a step.

Padding of ``block_tables``: rows are padded with ``BLOCK_TABLE_PAD`` (0, a valid block id, so a
gather over a padded row never indexes out of range); entries past ``ceil(seq_lens[i] /
block_size)`` are padding and must be masked by ``seq_lens``. Only the blocks covering
``seq_lens[i]`` are copied into the tensor (lookahead blocks a request holds are left out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

BLOCK_TABLE_PAD = 0
"""Value that pads ``StepInput.block_tables`` rows beyond a sequence's blocks (a valid id)."""


@dataclass
class SeqChunk:
    """One request's share of a step: a prefill chunk (many tokens) or a decode (one token).

    ``token_ids`` are computed this step (len >= 1) at positions ``start_pos ..
    start_pos + len(token_ids) - 1``; ``start_pos`` = tokens whose KV is already in the cache
    (prefix-cache hits included). ``block_table`` maps group -> block ids covering at least
    ``[0, start_pos + len(token_ids))``. ``sample``: return logits for the chunk's last token
    (False for a prefill chunk that does not reach the prompt's end).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: dict[str, list[int]]
    sample: bool
    # Hybrid linear-attention models (filled by engine.linear_state, else unused):
    state_slot: int | None = None
    """The sequence's resident conv/recurrent state slot (HY-01)."""
    state_restore: Any = None
    """A linear-state checkpoint (``PrefixMatch.checkpoint`` of a prefix hit) copied into
    ``state_slot`` before this chunk, which resumes at ``start_pos > 0``; with ``start_pos == 0``
    the state starts at zero; otherwise the slot's state continues."""
    state_saves: tuple[int, ...] = ()
    """Block boundaries inside ``(start_pos, seq_len]`` after which the worker snapshots the
    state (a checkpoint published with that block, PC-02)."""
    prompt_logprobs: bool = False
    """Return the log-softmax of every row of this chunk (``StepOutput.prompt_logprobs``):
    row i is position ``start_pos + i`` (prompt log-probabilities, engine.prompt_logprobs)."""

    @property
    def seq_len(self) -> int:
        """Tokens holding KV once this chunk ran (``start_pos + len(token_ids)``)."""
        return self.start_pos + len(self.token_ids)


@dataclass
class StepInput:
    """A batch of chunks plus the flat tensors a worker's kernels read.

    Build with :meth:`build`; the tensors are derived from ``chunks`` once, on CPU:

    - ``input_ids`` (T,) int64, ``positions`` (T,) int64: the chunks' tokens concatenated in
      chunk order (T = total tokens of the step);
    - ``slot_mapping``: group -> (T,) int64 flat slot of each token's new K/V;
    - ``query_start_loc`` (B+1,) int32: chunk i's tokens are rows
      ``query_start_loc[i]:query_start_loc[i+1]``;
    - ``seq_lens`` (B,) int32: ``start_pos + len(token_ids)`` per chunk;
    - ``block_tables``: group -> (B, max_blocks) int32, padded with ``BLOCK_TABLE_PAD``;
    - ``sample_indices`` (num_sampled,) int64: rows of the token axis whose logits are returned
      (the last token of every chunk with ``sample=True``, in chunk order).
    """

    chunks: list[SeqChunk]
    block_size: int
    input_ids: Tensor
    positions: Tensor
    slot_mapping: dict[str, Tensor]
    query_start_loc: Tensor
    seq_lens: Tensor
    block_tables: dict[str, Tensor]
    sample_indices: Tensor
    max_query_len: int = 0
    max_seq_len: int = 0
    group_names: tuple[str, ...] = field(default=())
    write_kv: bool = True
    """False: a read-only recompute (prompt log-probabilities of prefix-cache hits) — the
    chunks' K/V are already in their (shared, published) blocks and are not written again.
    Only chunks starting at position 0 of the standard decoder may run this way."""

    @property
    def num_tokens(self) -> int:
        """T, tokens computed this step."""
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        """B, chunks in this step."""
        return len(self.chunks)

    @property
    def num_sampled(self) -> int:
        """Rows of logits the worker returns."""
        return int(self.sample_indices.numel())

    @property
    def request_ids(self) -> list[str]:
        return [c.request_id for c in self.chunks]

    @property
    def is_decode_only(self) -> bool:
        """Every chunk computes exactly one token (a pure decode step)."""
        return all(len(c.token_ids) == 1 for c in self.chunks)

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], block_size: int) -> StepInput:
        """Derive the flat tensors of a step from its chunks (checks the module's invariants).

        This runs for every step: the per-chunk reads are list comprehensions (one pass each,
        no per-chunk helper calls) and every check and formula over them is numpy's."""
        import numpy as np

        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        chunks = list(chunks)
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        first = chunks[0].block_table
        groups: tuple[str, ...] = tuple(first)
        if not groups:
            raise ValueError(f"chunk {chunks[0].request_id!r}: block_table has no groups")
        toks = [c.token_ids for c in chunks]
        ns = [len(t) for t in toks]
        starts = [c.start_pos for c in chunks]
        if min(ns) < 1:
            raise ValueError(f"chunk {chunks[ns.index(min(ns))].request_id!r}: token_ids is "
                             "empty (a chunk computes >= 1 token)")
        if min(starts) < 0:
            c = chunks[starts.index(min(starts))]
            raise ValueError(f"chunk {c.request_id!r}: start_pos {c.start_pos} < 0")
        tabs = [c.block_table for c in chunks]
        keys = first.keys()
        rows: dict[str, list[list[int]]] = {}
        if len(groups) == 1:  # the common layout: one dict read per chunk
            g0 = groups[0]
            bad = set(map(len, tabs)) != {1}
            if not bad:
                try:
                    rows[g0] = [bt[g0] for bt in tabs]
                except KeyError:  # one group each, another name
                    bad = True
        else:
            bad = any(bt.keys() != keys for bt in tabs)
            if not bad:
                rows = {g: [bt[g] for bt in tabs] for g in groups}
        if bad:
            c = next(c for c in chunks if c.block_table.keys() != keys)
            raise ValueError(f"chunk {c.request_id!r}: block_table groups {sorted(c.block_table)} "
                             f"differ from the step's {sorted(groups)}")
        if len({c.request_id for c in chunks}) != len(chunks):
            seen: set[str] = set()
            for c in chunks:
                if c.request_id in seen:
                    raise ValueError(f"request {c.request_id!r} appears twice in one step")
                seen.add(c.request_id)
        b = len(chunks)
        t = sum(ns)
        if t == b:  # a pure decode step: one token per chunk
            ids = np.array([tk[0] for tk in toks], dtype=np.int64)
        else:
            import itertools

            ids = np.fromiter(itertools.chain.from_iterable(toks), dtype=np.int64, count=t)
        return cls._from_arrays(chunks, block_size, groups, ids, ns, starts,
                                [c.sample for c in chunks], rows)

    @staticmethod
    def _short_table(c: SeqChunk, g: str, have: int, need: int, seq_len: int,
                     block_size: int) -> None:
        raise ValueError(f"chunk {c.request_id!r}: group {g!r} block table has {have} blocks, "
                         f"{need} needed for {seq_len} tokens at block_size {block_size}")

    @classmethod
    def _from_arrays(cls, chunks: list[SeqChunk], block_size: int, groups: tuple[str, ...],
                     ids: Any, ns: list[int], starts: list[int], samples: list[bool],
                     rows: dict[str, list[list[int]]]) -> StepInput:
        """The flat tensors, vectorised (numpy): no Python work per token. ``rows[g][i]``:
        chunk i's block ids in group g (at least the covering ones; checked here)."""
        import itertools

        import numpy as np

        b = len(ns)
        t = int(ids.shape[0])
        start = np.array(starts, dtype=np.int64)
        if t == b:  # a pure decode step: one token per chunk, at its start_pos
            n = np.ones(b, dtype=np.int64)
            seq_lens = start + 1
            qsl = np.arange(b + 1, dtype=np.int64)
            positions = start
            tok_chunk = qsl[:-1]
        else:
            n = np.array(ns, dtype=np.int64)
            seq_lens = start + n
            qsl = np.zeros(b + 1, dtype=np.int64)
            np.cumsum(n, out=qsl[1:])
            # positions: start_pos .. start_pos + n - 1 per chunk, concatenated
            positions = np.arange(t, dtype=np.int64) - np.repeat(qsl[:-1] - start, n)
            tok_chunk = np.repeat(np.arange(b), n)
        need = (seq_lens + block_size - 1) // block_size
        max_blocks = int(need.max())
        total = int(need.sum())
        tok_block = positions // block_size
        tok_off = positions - tok_block * block_size
        covered = np.arange(max_blocks)[None, :] < need[:, None]  # row-major = concatenation order
        tables: dict[str, Tensor] = {}
        slots: dict[str, Tensor] = {}
        for g in groups:
            rg = rows[g]
            have = np.fromiter(map(len, rg), dtype=np.int64, count=b)
            if (have != need).any():
                short = np.flatnonzero(have < need)
                if short.size:
                    i = int(short[0])
                    cls._short_table(chunks[i], g, int(have[i]), int(need[i]), int(seq_lens[i]),
                                     block_size)
                # lookahead blocks beyond the covering ones are left out
                rg = [bt if h == k else bt[:k] for bt, h, k in zip(rg, have.tolist(),
                                                                  need.tolist())]
            flat = np.fromiter(itertools.chain.from_iterable(rg), dtype=np.int64, count=total)
            if flat.size and int(flat.min()) < 0:
                bad = int(np.repeat(np.arange(b), need)[np.flatnonzero(flat < 0)[0]])
                raise ValueError(f"chunk {chunks[bad].request_id!r}: group {g!r} block "
                                 "table holds a negative id")
            table = np.full((b, max_blocks), BLOCK_TABLE_PAD, dtype=np.int64)
            table[covered] = flat
            slots[g] = torch.from_numpy(table[tok_chunk, tok_block] * block_size + tok_off)
            tables[g] = torch.from_numpy(table.astype(np.int32))
        sample = np.array(samples, dtype=bool)
        return cls(
            chunks=chunks,
            block_size=block_size,
            input_ids=torch.from_numpy(ids),  # from numpy: 1/3 of torch.tensor(list)
            positions=torch.from_numpy(positions),
            slot_mapping=slots,
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_tables=tables,
            sample_indices=torch.from_numpy(qsl[1:][sample] - 1),
            max_query_len=int(n.max()),
            max_seq_len=int(seq_lens.max()),
            group_names=groups,
        )


@dataclass
class StepOutput:
    """What a worker returns for one ``StepInput``.

    ``logits`` (num_sampled, vocab) float32: one row per chunk with ``sample=True``, in chunk
    order (row i belongs to ``step.sample_indices[i]``). ``hidden_states`` (num_sampled, hidden)
    or None: the last layer's hidden state of the same rows (for an MTP draft). ``execution_peak_bytes``:
    the step's transient device memory beyond weights and KV (activations, workspace), bytes; the
    scheduler reports it to the pool (``VmmPool.observe_execution_peak``).
    """

    logits: Tensor
    hidden_states: Tensor | None = None
    execution_peak_bytes: int = 0
    prompt_logprobs: dict[str, Tensor] | None = None
    """request id -> (len(token_ids), vocab) float32 log-softmax of the raw logits of every
    row of each chunk with ``SeqChunk.prompt_logprobs`` (None when no chunk asked)."""


__all__ = ["BLOCK_TABLE_PAD", "SeqChunk", "StepInput", "StepOutput"]
