"""oneDNN-prepacked bf16 projections (``engine/layers/packed.py``): the same bits as
``F.linear``, the originals released (held once), the same tokens and logits as the unpacked
worker, and never applied to float32 or to pool weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine import checkpoints as C
from tests.engine.paged_stack import PagedStack
from xllm_vmm.engine.layers import packed

pytestmark = pytest.mark.skipif(not packed.enabled(),
                                reason=f"packed linear off here: {packed.disabled_reason()}")


@pytest.mark.parametrize("rows", [1, 7, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_f_linear_bit_for_bit(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    p = packed.pack(w)
    assert torch.equal(packed.linear(x, p, b), F.linear(x, w, b))
    xs = torch.randn(rows, 128, generator=g).to(torch.bfloat16)[:, :64]  # strided rows
    assert torch.equal(packed.linear(xs, p, b), F.linear(xs, w, b))
    assert packed.linear(x[:0], p, b).shape == (0, 96)


def test_packable_only_cpu_bf16_matrices():
    assert packed.packable(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not packed.packable(torch.zeros(4, 4))  # float32: not packed (rounds differently)
    assert not packed.packable(torch.zeros(4, dtype=torch.bfloat16))
    assert not packed.packable(None)


def _greedy_and_logits(s, prompts):
    got = s.greedy(prompts, 6, chunk=7)
    ids = prompts["a"] + got["a"]
    return got, s.step([s.chunk("x", ids)]).logits[0]


@pytest.mark.parametrize("family,untied", [("llama", True), ("qwen3_moe", False)])
def test_packed_worker_equals_unpacked_and_holds_weights_once(tmp_path, monkeypatch, family,
                                                               untied):
    make = C.llama_checkpoint if family == "llama" else C.qwen3_moe_checkpoint
    d = make(tmp_path / "m", tie_word_embeddings=not untied)
    prompts = {"a": C.random_prompt(21, 3), "b": C.random_prompt(4, 4)}
    s = PagedStack(d, block_size=16, dtype="bfloat16")
    try:
        model, w = s.worker.model, s.worker.weights
        rep = model.packed
        layers = len(model.layers)
        assert rep.linears >= 4 * layers + (1 if untied else 0), rep  # qkv, o, gate_up, down
        for layer in model.layers:
            assert layer.attn.qkv.packed is not None and layer.attn.qkv.weight is None
            assert layer.attn.o_proj.packed is not None and layer.attn.q_proj.weight is None
        assert (model.lm_head.packed is not None) == untied
        # the originals are released: the mapping keeps the names, the packed ones empty
        emptied = [n for n, t in w.items() if t.numel() == 0]
        assert any(n.endswith("q_proj.weight") for n in emptied)
        assert not any(n.endswith(("norm.weight", "embed_tokens.weight")) for n in emptied)
        assert ("lm_head.weight" in emptied) == untied
        fused = _greedy_and_logits(s, prompts)
    finally:
        s.close()
    monkeypatch.setenv(packed.ENV, "0")
    s = PagedStack(d, block_size=16, dtype="bfloat16")
    try:
        assert s.worker.model.packed.linears == 0
        # the packed weights' bytes are exactly the emptied tensors' (each counted once)
        assert rep.weight_bytes == sum(s.worker.weights[n].numel() * 2 for n in emptied)
        plain = _greedy_and_logits(s, prompts)
    finally:
        s.close()
    assert fused[0] == plain[0]
    assert torch.equal(fused[1], plain[1])  # the same bits


def test_float32_and_pool_weights_are_not_packed(tmp_path):
    d = C.llama_checkpoint(tmp_path / "m")
    s = PagedStack(d, block_size=16)  # fp32 checkpoint, auto dtype
    try:
        assert s.worker.model.packed.linears == 0
        assert s.worker.model.layers[0].attn.o_proj.weight is not None
    finally:
        s.close()
    s = PagedStack(d, block_size=16, dtype="bfloat16", vmm_weights=True)
    try:  # pool weights: never replaced by a copy (sleep / wakeup / fork use their addresses)
        assert getattr(s.worker.model, "packed", None) is None
        assert s.worker.model.layers[0].attn.o_proj.packed is None
    finally:
        s.close()
