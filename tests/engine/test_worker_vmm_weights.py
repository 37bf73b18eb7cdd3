"""The worker over weights that live in the pool (xllm_vmm.weights, enable_vmm_weights): the
model references the arena's tensors, refuses to compute while they sleep, and computes the
same tokens after wakeup."""

from __future__ import annotations

import pytest
import torch

from tests.engine import checkpoints as C
from tests.engine.paged_stack import PagedStack

weights_pkg = pytest.importorskip("xllm_vmm.weights")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = C.qwen3_checkpoint(tmp_path_factory.mktemp("q3") / "m")
    return d, C.load_hf_model(d)


def test_weights_in_the_arena_sleep_and_wake(qwen3):
    s = PagedStack(qwen3[0], block_size=16, vmm_weights=True)
    try:
        w = s.worker.weights
        lo, hi = s.pool.arena_va, s.pool.arena_va + s.pool.arena_pages * s.pool.page_bytes
        q = s.worker.model.layers[1].attn.q_proj.weight
        assert lo <= q.data_ptr() < hi  # a view of the pool's arena, not a host copy
        # fused projections over pool weights are views only: the pool's image places q/k/v and
        # gate/up back to back (weights.image.placement_order) and each group runs as one
        # product over the arena (nothing is ever copied out of the pool)
        mlp, attn = s.worker.model.layers[1].mlp, s.worker.model.layers[1].attn
        assert mlp.gate_up is not None and mlp.gate_up.weight.data_ptr() == mlp.gate.weight.data_ptr()
        assert lo <= mlp.gate_up.weight.data_ptr() < hi
        assert attn.qkv is not None and attn.qkv.weight.data_ptr() == q.data_ptr()
        assert attn.qkv.weight.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
        assert attn.qkv.packed is None  # pool weights are never packed (a copy is not the pool's)
        del mlp, attn
        ids = list(range(10, 40))
        before = s.greedy({"a": ids}, 6)["a"]
        assert before == C.hf_greedy(qwen3[1], ids, 6)
        w.sleep(1)
        with pytest.raises(weights_pkg.WeightsNotLoaded):
            s.step([s.chunk("b", [5, 6, 7])])
        w.wake_up()
        assert q.data_ptr() == s.worker.model.layers[1].attn.q_proj.weight.data_ptr()
        s.tables.pop("b", None), s.computed.pop("b", None)
        assert s.greedy({"c": ids}, 6)["c"] == before
        del q, w
    finally:
        s.close()


def test_pool_weights_fuse_qkv_with_bias_as_views_token_for_token(tmp_path):
    """Qwen2 (q/k/v biases, no q/k norm) over pool weights: weights and biases each one view of
    the arena, q rotated out of the product into a contiguous tensor; greedy tokens equal
    transformers' before and after a sleep / wakeup. (Hidden 128, 4 KV heads of 32: every
    part's bytes a multiple of the image's 512-byte alignment, which adjacency needs.)"""
    d = C.qwen2_checkpoint(tmp_path / "q2", hidden_size=128, num_key_value_heads=4)
    hf = C.load_hf_model(d)
    s = PagedStack(d, block_size=16, vmm_weights=True)
    try:
        lo, hi = s.pool.arena_va, s.pool.arena_va + s.pool.arena_pages * s.pool.page_bytes
        attn = s.worker.model.layers[0].attn
        assert attn.qkv is not None and attn.qkv.bias is not None
        assert attn.qkv.weight.data_ptr() == attn.q_proj.weight.data_ptr()
        assert attn.qkv.bias.data_ptr() == attn.q_proj.bias.data_ptr()
        assert lo <= attn.qkv.weight.data_ptr() < hi and lo <= attn.qkv.bias.data_ptr() < hi
        del attn
        ids = list(range(3, 40))
        want = C.hf_greedy(hf, ids, 6)
        assert s.greedy({"a": ids}, 6)["a"] == want
        s.worker.weights.sleep(1)
        s.worker.weights.wake_up()
        assert s.greedy({"b": ids}, 6)["b"] == want
    finally:
        s.close()
