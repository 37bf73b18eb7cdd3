"""The Llama path end to end over a real VmmPool (host driver) and VirtualKVCache: logits and
greedy tokens equal transformers' on the same checkpoint; K/V live in the arena."""

from __future__ import annotations

import pytest
import torch

from tests.engine import checkpoints as C
from tests.engine.paged_stack import PagedStack
from xllm_vmm.engine.step import SeqChunk, StepInput

BS = 16
ATOL = 2e-4  # fp32 logits: same math, different summation order


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = C.llama_checkpoint(tmp_path_factory.mktemp("llama") / "m")
    return d, C.load_hf_model(d)


@pytest.fixture
def stack(llama):
    s = PagedStack(llama[0], block_size=BS, shuffle_blocks=2100)
    yield s
    s.close()


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed + n)
    return torch.randint(4, 384, (n,), generator=g).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("n", [1, BS - 1, BS, BS + 1, 5 * BS + 3])
def test_prefill_logits_match_hf(llama, stack, n):
    ids = _prompt(n)
    out = stack.step([stack.chunk("a", ids)])
    assert out.logits.shape == (1, 384) and out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits[0], _hf_logits(llama[1], ids)[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_with_offsets_matches_hf(llama, stack):
    ids = _prompt(70)
    pieces, at = [5, 16, 11, 30, 8], 0
    for i, n in enumerate(pieces):
        last = i == len(pieces) - 1
        out = stack.step([stack.chunk("a", ids[at:at + n], sample=last)])
        at += n
        assert out.logits.shape[0] == (1 if last else 0)
    torch.testing.assert_close(out.logits[0], _hf_logits(llama[1], ids)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("n", [1, BS - 1, BS, BS + 1, 4 * BS + 5])
def test_greedy_decode_matches_hf_generate(llama, stack, n):
    ids = _prompt(n, seed=1)
    got = stack.greedy({"a": ids}, 12)["a"]
    assert got == C.hf_greedy(llama[1], ids, 12)


def test_batched_mixed_prefill_and_decode_match_hf(llama, stack):
    """Prompts arrive one per step (prefill chunks mixed with the others' decodes) and are
    prefilled in 7-token chunks; every sequence's tokens equal its own HF generate."""
    prompts = {f"r{n}": _prompt(n, seed=2) for n in (1, 9, BS, BS + 1, 40)}
    got = stack.greedy(prompts, 10, chunk=7, stagger=True)
    for r, ids in prompts.items():
        assert got[r] == C.hf_greedy(llama[1], ids, 10), r


def test_mixed_step_logits_rows_follow_chunk_order(llama, stack):
    a, b, c = _prompt(20, 3), _prompt(33, 3), _prompt(5, 3)
    stack.step([stack.chunk("a", a[:19], sample=False)])
    out = stack.step([stack.chunk("b", b), stack.chunk("a", a[19:]), stack.chunk("c", c)])
    assert out.logits.shape[0] == 3
    for row, ids in zip(out.logits, (b, a, c)):
        torch.testing.assert_close(row, _hf_logits(llama[1], ids)[-1], atol=ATOL, rtol=0)


def test_kv_lives_in_the_arena_in_its_blocks(llama, stack):
    ids = _prompt(2 * BS + 3)
    stack.step([stack.chunk("a", ids)])
    table = stack.tables["a"]
    with torch.no_grad():
        ref = llama[1](torch.tensor([ids]), use_cache=True).past_key_values
    views = stack.worker.kv_views
    bps = views.geometry.blocks_per_slot
    for layer in range(2):
        got = torch.cat([views.layers[layer].k_blocks[b // bps, b % bps] for b in table])
        keys = ref.layers[layer].keys[0].transpose(0, 1)  # (L, Hkv, D)
        torch.testing.assert_close(got[:len(ids)], keys, atol=1e-5, rtol=0)
        # the view really is the arena: the block's address in the cache geometry
        geo = stack.cache.geometry["attn"]
        t = 2 * layer
        assert views.layers[layer].k_blocks[table[0] // bps, table[0] % bps].data_ptr() == \
            geo.block_va(t, table[0])


def test_blocks_outside_the_step_are_never_touched(llama, stack):
    """Writes go through the slot mapping only: a neighbour block keeps its bytes."""
    views = stack.worker.kv_views
    bps = views.geometry.blocks_per_slot
    other = stack._blocks(1)[0]
    k = views.layers[0].k_blocks[other // bps, other % bps]
    k.fill_(7.0)
    stack.greedy({"a": _prompt(40)}, 3, chunk=9)
    assert bool((k == 7.0).all())


def test_weights_are_referenced_not_copied(llama, stack):
    w = stack.worker.weights
    m = stack.worker.model
    assert m.layers[0].attn.q_proj.weight.data_ptr() == \
        w["model.layers.0.self_attn.q_proj.weight"].data_ptr()
    assert m.embed.weight.data_ptr() == w["model.embed_tokens.weight"].data_ptr()
    assert m.unused_weights == []


def test_step_output_hidden_states_and_execution_peak(llama, stack):
    ids = _prompt(30)
    out = stack.step([stack.chunk("a", ids)])
    with torch.no_grad():
        hf = llama[1](torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    torch.testing.assert_close(out.hidden_states[0], hf, atol=1e-4, rtol=0)
    small = stack.step([stack.chunk("a", [5])]).execution_peak_bytes
    assert 0 < small < out.execution_peak_bytes


def test_wrong_block_size_is_refused(llama, stack):
    step = StepInput.build([SeqChunk("a", [1, 2], 0, {"attn": stack._blocks(1)}, True)], 8)
    with pytest.raises(ValueError, match="block_size 8"):
        stack.worker.execute(step)


def test_padded_pages_and_the_acl_emulation(llama):
    """block_size 24: 3 KiB blocks do not divide a 2 MiB page (each page ends in padding);
    the ACL emulation driver maps the same arena."""
    s = PagedStack(llama[0], block_size=24, shuffle_blocks=1400, driver="acl")
    try:
        assert 2 * 1024 * 1024 % s.cache.geometry["attn"].group.tensor_block_bytes
        prompts = {"a": _prompt(50, 4), "b": _prompt(23, 4)}
        got = s.greedy(prompts, 8, chunk=20)
        for r, ids in prompts.items():
            assert got[r] == C.hf_greedy(llama[1], ids, 8)
    finally:
        s.close()
