"""Property tests of the exact searches: results are the largest values that fit."""

from hypothesis import given, settings
from hypothesis import strategies as st

from xllm_vmm.planner.capacity import Unit, demand, largest, max_blocks, max_seqs
from tests._hyp import examples

units_st = st.lists(
    st.builds(
        Unit,
        name=st.sampled_from(["attn", "mla", "index", "draft", "sliding"]),
        unit_bytes=st.integers(1, 1 << 24),
        blocks_per_unit=st.integers(1, 64),
        block_size=st.sampled_from([1, 16, 128]),
        window=st.one_of(st.none(), st.integers(1, 4096)),
    ),
    min_size=1, max_size=4)


@settings(max_examples=examples(150), deadline=None)
@given(units=units_st, tokens=st.integers(1, 1 << 20), budget=st.integers(0, 1 << 36),
       extra=st.integers(0, 1 << 26))
def test_max_seqs_is_the_largest_that_fits(units, tokens, budget, extra):
    c = max_seqs(units, tokens, budget, extra)
    assert c >= 0
    if c:
        assert demand(units, c, tokens) + c * extra <= budget
    assert demand(units, c + 1, tokens) + (c + 1) * extra > budget


@settings(max_examples=examples(150), deadline=None)
@given(units=units_st, budget=st.integers(0, 1 << 36))
def test_max_blocks_is_the_largest_that_fits(units, budget):
    n = max_blocks(units, budget)
    assert sum(u.bytes_for_blocks(n) for u in units) <= budget or n == 0
    assert sum(u.bytes_for_blocks(n + 1) for u in units) > budget


@settings(max_examples=examples(200), deadline=None)
@given(limit=st.integers(0, 1 << 50), lo=st.integers(0, 100))
def test_largest_finds_the_threshold(limit, lo):
    got = largest(lambda x: x <= limit, lo)
    assert got == (limit if limit >= lo else lo - 1)
