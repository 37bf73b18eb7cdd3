"""StepInput.build: the flat tensors of a step, checked by hand."""

import pytest
import torch

from xllm_vmm.engine.step import BLOCK_TABLE_PAD, SeqChunk, StepInput


def test_build_mixed_prefill_and_decode():
    # block_size 4; request a: prefill chunk of 3 tokens at positions 4..6 (blocks [7, 2]);
    # request b: one decode at position 9 (blocks [5, 1, 3]), request c: a chunk not sampled.
    a = SeqChunk("a", [10, 11, 12], 4, {"attn": [7, 2, 9]}, True)
    b = SeqChunk("b", [20], 9, {"attn": [5, 1, 3]}, True)
    c = SeqChunk("c", [30, 31], 0, {"attn": [8]}, False)
    s = StepInput.build([a, b, c], block_size=4)
    assert s.input_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert s.input_ids.dtype == torch.int64
    assert s.positions.tolist() == [4, 5, 6, 9, 0, 1]
    # a: block 2 holds positions 4..7 -> slots 8, 9, 10; b: pos 9 -> block index 2 = id 3, slot 13
    assert s.slot_mapping["attn"].tolist() == [8, 9, 10, 13, 32, 33]
    assert s.query_start_loc.tolist() == [0, 3, 4, 6]
    assert s.query_start_loc.dtype == torch.int32
    assert s.seq_lens.tolist() == [7, 10, 2]
    # only covering blocks copied (a needs 2 of its 3); rows padded with BLOCK_TABLE_PAD
    assert s.block_tables["attn"].tolist() == [[7, 2, BLOCK_TABLE_PAD], [5, 1, 3], [8, 0, 0]]
    assert s.block_tables["attn"].dtype == torch.int32
    assert s.sample_indices.tolist() == [2, 3]
    assert (s.num_tokens, s.num_seqs, s.num_sampled) == (6, 3, 2)
    assert (s.max_query_len, s.max_seq_len) == (3, 10)
    assert s.group_names == ("attn",)
    assert not s.is_decode_only


def test_build_two_groups_each_own_slots():
    ch = SeqChunk("a", [1, 2], 3, {"attn": [0, 4], "draft": [6, 1]}, True)
    s = StepInput.build([ch], block_size=4)
    # pos 3 -> block index 0, pos 4 -> block index 1, per group
    assert s.slot_mapping["attn"].tolist() == [0 * 4 + 3, 4 * 4 + 0]
    assert s.slot_mapping["draft"].tolist() == [6 * 4 + 3, 1 * 4 + 0]


@pytest.mark.parametrize(
    "chunks, match",
    [
        ([], "at least one chunk"),
        ([SeqChunk("a", [], 0, {"attn": [0]}, True)], "empty"),
        ([SeqChunk("a", [1], -1, {"attn": [0]}, True)], "start_pos"),
        ([SeqChunk("a", [1, 2, 3], 0, {"attn": [0]}, True)], "2 needed for 3 tokens"),
        ([SeqChunk("a", [1], 0, {"attn": [-1]}, True)], "negative"),
        ([SeqChunk("a", [1], 0, {"attn": [0]}, True), SeqChunk("a", [1], 0, {"attn": [1]}, True)], "twice"),
        ([SeqChunk("a", [1], 0, {"attn": [0]}, True), SeqChunk("b", [1], 0, {"x": [1]}, True)], "groups"),
    ],
)
def test_build_refuses_bad_chunks(chunks, match):
    with pytest.raises(ValueError, match=match):
        StepInput.build(chunks, block_size=2)


def test_negative_id_names_its_chunk():
    ok = SeqChunk("a", [1, 2, 3], 0, {"attn": [4, 5]}, True)
    bad = SeqChunk("b", [1], 2, {"attn": [6, -3]}, True)
    with pytest.raises(ValueError, match="chunk 'b'.*negative"):
        StepInput.build([ok, bad], block_size=2)


def _reference(chunks, bs):
    """The per-token definition of the flat tensors (the module docstring's formulas)."""
    ids, pos, slots, qsl, lens, tables, sample = [], [], {}, [0], [], {}, []
    groups = tuple(chunks[0].block_table)
    need_max = max(-(-c.seq_len // bs) for c in chunks)
    for c in chunks:
        need = -(-c.seq_len // bs)
        for g in groups:
            row = c.block_table[g][:need]
            tables.setdefault(g, []).append(row + [BLOCK_TABLE_PAD] * (need_max - need))
            slots.setdefault(g, []).extend(row[p // bs] * bs + p % bs
                                           for p in range(c.start_pos, c.seq_len))
        ids += c.token_ids
        pos += list(range(c.start_pos, c.seq_len))
        qsl.append(qsl[-1] + len(c.token_ids))
        lens.append(c.seq_len)
        if c.sample:
            sample.append(qsl[-1] - 1)
    return ids, pos, slots, qsl, lens, tables, sample


@pytest.mark.parametrize("seed", range(5))
def test_build_equals_per_token_reference_on_random_steps(seed):
    import random

    rnd = random.Random(seed)
    bs = rnd.choice([1, 2, 4, 16])
    chunks = []
    for i in range(rnd.randint(1, 40)):
        start = rnd.randint(0, 300)
        n = 1 if rnd.random() < 0.6 else rnd.randint(1, 200)
        need = -(-(start + n) // bs)
        extra = rnd.randint(0, 3)  # lookahead blocks a request holds beyond what it covers
        table = {g: rnd.sample(range(10_000), need + extra) for g in ("attn", "draft")}
        chunks.append(SeqChunk(f"r{i}", [rnd.randrange(50_000) for _ in range(n)], start, table,
                               rnd.random() < 0.8))
    s = StepInput.build(chunks, block_size=bs)
    ids, pos, slots, qsl, lens, tables, sample = _reference(chunks, bs)
    assert s.input_ids.tolist() == ids and s.positions.tolist() == pos
    assert s.query_start_loc.tolist() == qsl and s.seq_lens.tolist() == lens
    assert s.sample_indices.tolist() == sample
    for g in ("attn", "draft"):
        assert s.slot_mapping[g].tolist() == slots[g] and s.slot_mapping[g].dtype == torch.int64
        assert s.block_tables[g].tolist() == tables[g] and s.block_tables[g].dtype == torch.int32
    assert (s.positions.dtype, s.sample_indices.dtype) == (torch.int64, torch.int64)
    assert (s.seq_lens.dtype, s.query_start_loc.dtype) == (torch.int32, torch.int32)
    assert s.max_query_len == max(len(c.token_ids) for c in chunks)
    assert s.max_seq_len == max(lens)
