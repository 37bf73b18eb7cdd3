"""Attention backends behind one interface: each against a naive reference (softmax over the
sequence's own keys, causal with the chunk offset, grouped-query heads), over K/V written into
a real arena through the step's slot mapping."""

from __future__ import annotations

import math

import pytest
import torch

from tests.engine import checkpoints as C
from tests.engine.paged_stack import PagedStack
from xllm_vmm.engine.attention import backend_class, select_backend
from xllm_vmm.engine.attention.npu import NpuPagedBackend
from xllm_vmm.engine.step import StepInput

H, HKV, D = 4, 2, 16


def _reference(q_rows, keys, values, start):
    """q_rows (n, H, D) at positions start.., keys/values (L, Hkv, D) of the whole sequence."""
    rep = H // HKV
    k = keys.repeat_interleave(rep, dim=1)
    v = values.repeat_interleave(rep, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q_rows, k) / math.sqrt(D)
    n, L = q_rows.shape[0], keys.shape[0]
    allowed = torch.arange(L)[None, :] <= (start + torch.arange(n))[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)


def _fake_fused_infer_attention_score(query, key, value, *, block_table, actual_seq_lengths_kv,
                                      num_heads, num_key_value_heads, scale, input_layout,
                                      block_size, actual_seq_lengths=None, atten_mask=None,
                                      sparse_mode=0):
    """The documented semantics of torch_npu's operator in paged BSH mode (decode: q_len 1;
    prompt: sparse_mode 3 = right-down causal)."""
    assert input_layout == "BSH" and key.dim() == 3 and key.shape[1] == block_size
    assert query.is_contiguous()
    b, s, hd = query.shape
    d = hd // num_heads
    assert sparse_mode == (3 if s > 1 else 0) and (atten_mask is not None) == (s > 1)
    outs = []
    for i in range(b):
        kv_len = actual_seq_lengths_kv[i]
        blocks = block_table[i, :-(-kv_len // block_size)].long()
        ks = key[blocks].reshape(-1, num_key_value_heads, d)[:kv_len]
        vs = value[blocks].reshape(-1, num_key_value_heads, d)[:kv_len]
        outs.append(_reference(query[i].view(s, num_heads, d), ks, vs, kv_len - s))
    return torch.stack(outs).reshape(b, s, hd), None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return C.llama_checkpoint(tmp_path_factory.mktemp("att") / "m")


def _step(stack, plan, g):
    """Chunks with random q/k/v: plan = [(rid, n_new)], run twice to have offsets."""
    chunks = [stack.chunk(r, list(range(3, 3 + n))) for r, n in plan]
    step = StepInput.build(chunks, stack.block_size)
    t = step.num_tokens
    q = torch.randn(t, H, D, generator=g)
    k = torch.randn(t, HKV, D, generator=g)
    v = torch.randn(t, HKV, D, generator=g)
    return step, q, k, v


@pytest.mark.parametrize("block_size", [16, 24])
@pytest.mark.parametrize("kind", ["torch", "torch-gather", "torch-per-sequence", "npu-standin",
                                  "torch-native-prefill", "torch-native-prefill-portable",
                                  "torch-sdpa-prefill"])
def test_backend_matches_reference(model_dir, monkeypatch, block_size, kind):
    if kind == "npu-standin":
        if block_size == 24:
            pytest.skip("the npu backend refuses padded pages (tested below)")
        monkeypatch.setattr("xllm_vmm.engine.attention.npu._operator",
                            lambda: _fake_fused_infer_attention_score)
    stack = PagedStack(model_dir, block_size=block_size, shuffle_blocks=1500)
    try:
        cls = NpuPagedBackend if kind == "npu-standin" else backend_class("torch", "cpu")
        kw = {"torch-per-sequence": {"batch_decodes": False},
              "torch-gather": {"native_decode": False},
              "torch-native-prefill": {"native_prefill": "on"},
              "torch-native-prefill-portable": {"native_prefill": "portable"},
              "torch-sdpa-prefill": {"native_prefill": "off"}}.get(kind, {})
        _check_against_reference(stack, cls, torch.Generator().manual_seed(block_size), **kw)
    finally:
        stack.close()


def _check_against_reference(stack, cls, g, **kw):
    """Three steps: prefills; chunked continuation + decodes + a fresh prompt, mixed; decodes
    only. Every chunk's output equals the reference over its whole history."""
    views = stack.worker.kv_views
    be = cls(views.geometry, num_heads=H, num_kv_heads=HKV, head_dim=D, device="cpu", **kw)
    history: dict[str, tuple[list, list]] = {}
    layer = views.layers[1]
    for plan in ([("a", 40), ("b", 1), ("c", 17)],
                 [("b", 1), ("a", 9), ("d", 33), ("c", 1)],
                 [("a", 1), ("b", 1), ("c", 1), ("d", 1)]):
        step, q, k, v = _step(stack, plan, g)
        meta = be.prepare(step)
        be.write_kv(layer, k, v, meta)
        out = be.attend(q, k, v, layer, meta)
        qsl = step.query_start_loc.tolist()
        for i, (rid, n) in enumerate(plan):
            ks, vs = history.setdefault(rid, ([], []))
            ks.append(k[qsl[i]:qsl[i + 1]]), vs.append(v[qsl[i]:qsl[i + 1]])
            keys, values = torch.cat(ks), torch.cat(vs)
            ref = _reference(q[qsl[i]:qsl[i + 1]], keys, values, keys.shape[0] - n)
            torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, atol=1e-5, rtol=1e-5)


def test_npu_backend_refuses_padded_pages(model_dir):
    stack = PagedStack(model_dir, block_size=24)
    try:
        with pytest.raises(ValueError, match="block_size 24"):
            NpuPagedBackend(stack.worker.kv_views.geometry, num_heads=H, num_kv_heads=HKV,
                            head_dim=D, device="cpu")
    finally:
        stack.close()


def test_backend_selection():
    assert backend_class("auto", "cpu").name == "torch"
    assert backend_class("auto", "cuda").name == "torch"
    assert backend_class("auto", "npu") is NpuPagedBackend
    with pytest.raises(ValueError, match="needs an NPU device"):
        backend_class("npu", "cpu")
    with pytest.raises(ValueError, match="'flash' is not one of"):
        backend_class("flash", "cpu")


def _has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(torch.npu.is_available())


@pytest.mark.npu
@pytest.mark.skipif(not _has_npu(), reason="needs an Ascend NPU with torch_npu")
def test_npu_greedy_matches_cpu(model_dir):  # pragma: no cover - hardware only
    cpu = PagedStack(model_dir, block_size=16, dtype="float16")
    npu = PagedStack(model_dir, block_size=16, dtype="float16", driver="npu")
    try:
        prompts = {"a": list(range(5, 45)), "b": [9, 8, 7]}
        assert npu.greedy(prompts, 6, chunk=16) == cpu.greedy(prompts, 6, chunk=16)
    finally:
        npu.close(), cpu.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_greedy_matches_hf(model_dir):  # pragma: no cover - hardware only
    s = PagedStack(model_dir, block_size=16, driver="cuda", shuffle_blocks=1100)
    try:
        assert s.worker.device.startswith("cuda")
        hf = C.load_hf_model(model_dir)
        prompts = {"a": list(range(5, 45)), "b": [9, 8, 7]}
        got = s.greedy(prompts, 8, chunk=16, stagger=True)
        for r, ids in prompts.items():
            assert got[r] == C.hf_greedy(hf, ids, 8)
    finally:
        s.close()


def test_select_backend_builds_on_the_worker_geometry(model_dir):
    stack = PagedStack(model_dir, block_size=16)
    try:
        be = select_backend("auto", stack.worker.kv_views.geometry, num_heads=H,
                            num_kv_heads=HKV, head_dim=D, device="cpu")
        assert be.name == "torch" and be.scale == pytest.approx(D ** -0.5)
    finally:
        stack.close()
