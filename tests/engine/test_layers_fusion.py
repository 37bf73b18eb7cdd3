"""Fused q/k/v and gate/up products (``engine/layers/fusion.py``, ``MergedColumnLinear``): views
only over adjacent weights, plain weights re-laid in place (same objects, values and bytes),
the same outputs as the separate products, and in effect in the families' workers (whose
tokens the families' tests check against transformers)."""

from __future__ import annotations

import pytest
import torch

from tests.engine import checkpoints as C
from tests.engine.paged_stack import PagedStack
from xllm_vmm.engine.layers import fusion
from xllm_vmm.engine.layers.linear import (ColumnParallelLinear, MergedColumnLinear,
                                           ReplicatedLinear)
from xllm_vmm.engine.layers.parallel import TensorParallel


def _qkv(bias: bool = True, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    w = {f"l.self_attn.{n}_proj.weight": torch.randn(r, 16, generator=g, dtype=dtype)
         for n, r in (("q", 32), ("k", 8), ("v", 8))}
    if bias:
        w.update({f"l.self_attn.{n}_proj.bias": torch.randn(r, generator=g, dtype=dtype)
                  for n, r in (("q", 32), ("k", 8), ("v", 8))})
    w["l.mlp.gate_proj.weight"] = torch.randn(24, 16, generator=g, dtype=dtype)
    w["l.mlp.up_proj.weight"] = torch.randn(24, 16, generator=g, dtype=dtype)
    w["l.mlp.down_proj.weight"] = torch.randn(16, 24, generator=g, dtype=dtype)
    return w


def test_adjacent_rows_views_only_back_to_back_parts():
    buf = torch.arange(40.0).reshape(10, 4)
    a, b, c = buf[0:2], buf[2:5], buf[5:10]
    v = fusion.adjacent_rows([a, b, c])
    assert v is not None and v.data_ptr() == a.data_ptr() and v.shape == (10, 4)
    assert torch.equal(v, buf)
    assert fusion.adjacent_rows([a, c]) is None  # a gap
    assert fusion.adjacent_rows([b, a]) is None  # out of order
    assert fusion.adjacent_rows([a, torch.zeros(3, 4)]) is None  # another storage
    assert fusion.adjacent_rows([buf[0:2, :2], buf[2:4, :2]]) is None  # not contiguous
    assert fusion.adjacent_rows([]) is None
    assert torch.equal(fusion.adjacent_rows([buf.view(-1)[:3], buf.view(-1)[3:7]]),
                       torch.arange(7.0))  # 1-D (biases)


def test_colocate_relays_in_place_same_objects_values_and_bytes():
    w = _qkv()
    before = {n: (t, t.clone()) for n, t in w.items()}
    nbytes = sum(t.numel() * t.element_size() for t in w.values())
    moved = fusion.colocate_projections(w)
    fused = [n for n in w if "down_proj" not in n]
    assert moved == sum(w[n].numel() * w[n].element_size() for n in fused)
    for n, t in w.items():
        assert t is before[n][0]  # the same tensor object (the mapping and its holders see it)
        assert torch.equal(t, before[n][1])  # the same values
    assert sum(t.numel() * t.element_size() for t in w.values()) == nbytes
    names = [f"l.self_attn.{p}_proj.weight" for p in "qkv"]
    view = fusion.adjacent_rows([w[n] for n in names])
    assert view is not None and view.untyped_storage().nbytes() == view.numel() * 4  # one buffer
    assert fusion.adjacent_rows([w[f"l.self_attn.{p}_proj.bias"] for p in "qkv"]) is not None
    assert fusion.adjacent_rows([w["l.mlp.gate_proj.weight"], w["l.mlp.up_proj.weight"]]) is not None
    assert fusion.colocate_projections(w) == 0  # already adjacent: nothing moves


def test_colocate_leaves_incomplete_mixed_and_grad_groups(monkeypatch):
    w = _qkv(bias=False)
    del w["l.self_attn.v_proj.weight"]  # q and k only: not a group
    w["l.mlp.up_proj.weight"] = w["l.mlp.up_proj.weight"].to(torch.bfloat16)  # mixed dtypes
    assert fusion.colocate_projections(w) == 0
    w = _qkv(bias=False)
    w["l.mlp.gate_proj.weight"].requires_grad_(True)
    assert fusion.colocate_projections(w) == sum(w[f"l.self_attn.{p}_proj.weight"].numel() * 4
                                                 for p in "qkv")
    monkeypatch.setenv(fusion.ENV, "0")
    assert fusion.colocate_projections(_qkv()) == 0


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_linear_equals_separate_products(bias, dtype):
    w = _qkv(bias=bias, dtype=dtype)
    fusion.colocate_projections(w)
    parts = [ColumnParallelLinear(w[f"l.self_attn.{p}_proj.weight"],
                                  w.get(f"l.self_attn.{p}_proj.bias")) for p in "qkv"]
    m = MergedColumnLinear.of(parts)
    assert m is not None and m.sizes == (32, 8, 8)
    x = torch.randn(5, 16, dtype=dtype)
    for got, p in zip(m(x), parts):
        ref = p(x)
        # one product over the concatenated rows: each output element is the same dot product,
        # summed in an order the BLAS kernel picks by the product's shape (fp32: within a few
        # units in the last place of the terms' magnitude, not always the same bits)
        torch.testing.assert_close(got, ref, atol=1e-6 if dtype is torch.float32 else 1e-2,
                                   rtol=1e-5 if dtype is torch.float32 else 1e-2)


def test_merged_linear_refuses_what_it_cannot_view(monkeypatch):
    w = _qkv()
    # not re-laid: separate buffers
    assert MergedColumnLinear.of([ReplicatedLinear(w[f"l.self_attn.{p}_proj.weight"])
                                  for p in "qkv"]) is None
    fusion.colocate_projections(w)
    ws = [w[f"l.self_attn.{p}_proj.weight"] for p in "qkv"]
    bs = [w[f"l.self_attn.{p}_proj.bias"] for p in "qkv"]
    assert MergedColumnLinear.of([ReplicatedLinear(ws[0], bs[0]), ReplicatedLinear(ws[1]),
                                  ReplicatedLinear(ws[2], bs[2])]) is None  # some biases only
    # tensor parallel without a shard hook: each part narrowed to this rank's rows, which are
    # no longer back to back: the parts run one by one (and stay correct)
    tp = TensorParallel(rank=1, world_size=2)
    parts = [ColumnParallelLinear(wt, b, tp=tp) for wt, b in zip(ws, bs)]
    assert MergedColumnLinear.of(parts) is None
    monkeypatch.setenv(fusion.ENV, "0")
    assert MergedColumnLinear.of([ReplicatedLinear(t) for t in ws]) is None


FAMILIES = {
    "llama": C.llama_checkpoint,
    "qwen2_bias": C.qwen2_checkpoint,
    "qwen3_qk_norm": C.qwen3_checkpoint,
    "qwen3_moe": C.qwen3_moe_checkpoint,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_run_fused_and_match_unfused_and_hf(tmp_path, monkeypatch, family):
    d = FAMILIES[family](tmp_path / "m")
    hf = C.load_hf_model(d)
    prompts = {"a": C.random_prompt(19, 1), "b": C.random_prompt(5, 2)}
    s = PagedStack(d, block_size=16)
    try:
        for layer in s.worker.model.layers:
            assert layer.attn.qkv is not None
            mlps = [layer.mlp] if hasattr(layer.mlp, "gate_up") else \
                [e for e in layer.mlp.experts if e is not None]
            assert mlps and all(m.gate_up is not None for m in mlps)
        fused = s.greedy(prompts, 6, chunk=7)
    finally:
        s.close()
    monkeypatch.setenv(fusion.ENV, "0")
    s = PagedStack(d, block_size=16)
    try:
        assert all(layer.attn.qkv is None for layer in s.worker.model.layers)
        plain = s.greedy(prompts, 6, chunk=7)
    finally:
        s.close()
    assert fused == plain
    for r, ids in prompts.items():
        assert fused[r] == C.hf_greedy(hf, ids, 6), (family, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_of_fused_heads_equals_norm_of_contiguous_heads(dtype):
    """Qwen3's per-head q/k norms over views of the fused product: the same bits as over the
    separate (contiguous) products."""
    from xllm_vmm.engine.layers.norm import rms_norm

    qkv = torch.randn(9, 48 + 16 + 16, dtype=dtype)
    q = qkv[:, :48].view(9, 3, 16)  # token rows at the product's stride
    w = torch.rand(16, dtype=dtype) + 0.5
    assert not q.is_contiguous()
    assert torch.equal(rms_norm(q, w, 1e-6), rms_norm(q.contiguous(), w, 1e-6))
