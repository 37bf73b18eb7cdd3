"""The native fused layer ops (``native/layer_ops.c`` through ``engine.layers.layer_ops``) against
the torch formulas they replace, on the AVX-512 path and on the portable C path (forced):
float32 within 1e-6 relative (plus a tiny absolute floor for values near 0), bfloat16 within
one bfloat16 ulp of the formula and bit-equal on all but a small fraction of elements; rotary
bit-equal (it has no sums or exps). Unsupported tensors fall back or raise ValueError naming
them; the layers give the torch result with the ops off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xllm_vmm.engine.layers import layer_ops
from xllm_vmm.engine.layers.norm import RMSNorm, add_rms_norm, rms_norm, rms_norm_torch
from xllm_vmm.engine.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(layer_ops.load() is None,
                                reason="libxllm_layer_ops.so not built (setup.py build_ext)")

PATHS = ["best", "portable"]


@pytest.fixture(params=PATHS)
def path(request):
    layer_ops.set_enabled(True)
    layer_ops.force_portable(request.param == "portable")
    yield request.param
    layer_ops.force_portable(False)
    layer_ops.set_enabled(None)


def test_threads_split_rows_equal_one_thread():
    x, w = _rows(torch.bfloat16, (1024, 512), 20), _rows(torch.bfloat16, (512,), 21, 1.0)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer_ops.rms_norm(x, w, 1e-6)
        torch.set_num_threads(max(2, n))
        assert torch.equal(layer_ops.rms_norm(x, w, 1e-6), one)
    finally:
        torch.set_num_threads(n)


def _close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float(), want.float()
    if want.dtype == torch.float32:
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-6 * float(w.abs().max()) * 1e-3)
    else:  # one bfloat16 ulp (2^-7 relative), and nearly always the same bits
        assert ((g - w).abs() <= w.abs() * 2 ** -7 + 1e-30).all()
        assert (got != want).float().mean() < 1e-3


def _rows(dtype, shape, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(600, 512), (64, 8, 64), (3, 96), (5, 37)])  # 600x512: split between threads
def test_rms_norm_matches_torch(path, dtype, shape):
    x, w = _rows(dtype, shape, 1), _rows(dtype, shape[-1:], 2, 1.0)
    assert layer_ops.supported(x, w)
    _close(layer_ops.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_add_then_norm(path, dtype):
    x, r, w = _rows(dtype, (257, 512), 3), _rows(dtype, (257, 512), 4), _rows(dtype, (512,), 5, 1.0)
    want_r = x + r
    res = r.clone()
    got = add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, want_r)  # the residual is updated in place, rounded like x + r
    _close(got, rms_norm_torch(want_r, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(path, dtype):
    g, u = _rows(dtype, (200, 1536), 6, 4.0), _rows(dtype, (200, 1536), 7)
    g[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-3, -1e-3, 20.0, -20.0]).to(dtype)
    want = F.silu(g) * u
    _close(layer_ops.silu_and_mul(g, u), want)
    out = layer_ops.silu_and_mul(g, u, out=g)  # in place into gate, as the MLP does
    assert out is g
    _close(g, want)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _tables(dtype, rot, n=700):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    fr = torch.arange(n).float()[:, None] * inv
    emb = torch.cat((fr, fr), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype), fr.cos().to(dtype), fr.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_neox_gptj_and_partial_bit_equal(path, dtype):
    t, d = 520, 64  # T * heads * dims above the threads' threshold
    pos = torch.randint(0, 700, (t,), generator=torch.Generator().manual_seed(8))
    q, k = _rows(dtype, (t, 8, d), 9, 1.0), _rows(dtype, (t, 2, d), 10, 1.0)
    cos, sin, hcos, hsin = _tables(dtype, d)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    q2, k2 = q.clone(), k.clone()
    layer_ops.rope_(pos, q2, k2, cos, sin)
    assert torch.equal(q2, q * c + _rotate_half(q) * s) and torch.equal(k2, k * c + _rotate_half(k) * s)
    # GPT-J: pairs (2i, 2i+1), a half-width table
    q3 = q.clone()
    layer_ops.rope_(pos, q3, None, hcos, hsin, neox=False)
    a, b = q[..., 0::2], q[..., 1::2]
    hc, hs = hcos[pos].unsqueeze(1), hsin[pos].unsqueeze(1)
    want = torch.stack((a * hc - b * hs, b * hc + a * hs), dim=-1).flatten(-2)
    assert torch.equal(q3, want)
    # partial rotary: the first 32 dims rotate, the rest is untouched
    pc, ps, _, _ = _tables(dtype, 32)
    q4 = q.clone()
    layer_ops.rope_(pos, q4, None, pc, ps)
    r = q[..., :32]
    cc, ss = pc[pos].unsqueeze(1), ps[pos].unsqueeze(1)
    assert torch.equal(q4[..., :32], r * cc + _rotate_half(r) * ss)
    assert torch.equal(q4[..., 32:], q[..., 32:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [3, 520])  # 520: split between threads
def test_rope_out_of_place_from_fused_product_bit_equal(path, dtype, t):
    """q as a strided view of a fused q/k/v product, rotated into a contiguous q_out in one
    pass: the same bits as rotating a copy in place; q itself untouched, k rotated in place;
    with partial rotary the dims past rot are copied."""
    d, hq, hk = 64, 4, 2
    pos = torch.randint(0, 700, (t,), generator=torch.Generator().manual_seed(30))
    for rot in (d, 32):
        prod = _rows(dtype, (t, (hq + 2 * hk) * d), 31, 1.0)
        q = prod[:, :hq * d].view(t, hq, d)
        k = prod[:, hq * d:(hq + hk) * d].view(t, hk, d)
        cos, sin, _, _ = _tables(dtype, rot)
        want_q, want_k = q.clone(), k.clone()
        layer_ops.rope_(pos, want_q, want_k, cos, sin)
        q_before = q.clone()
        out = torch.empty(q.shape, dtype=dtype)
        layer_ops.rope_(pos, q, k, cos, sin, q_out=out)
        assert torch.equal(out, want_q) and torch.equal(k, want_k)
        assert torch.equal(q, q_before)
    with pytest.raises(ValueError, match="q_out"):
        layer_ops.rope_(pos, q, k, cos, sin, q_out=torch.empty((t, hq, d + 1), dtype=dtype))


def test_rotary_apply_strided_q_gives_contiguous_rotation(path):
    rope = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 10000.0}, 4096)
    pos = torch.tensor([0, 5, 9000, 17])
    for dtype in (torch.float32, torch.bfloat16):
        prod = _rows(dtype, (4, 8 * 64), 32, 1.0)
        q, k = prod[:, :4 * 64].view(4, 4, 64), prod[:, 4 * 64:6 * 64].view(4, 2, 64)
        want = rope(pos, q, k)
        got = rope.apply_(pos, q, k)
        assert got[0].is_contiguous() and torch.equal(got[0], want[0])
        assert got[1] is k and torch.equal(got[1], want[1])


def test_rotary_apply_in_place_equals_formula(path):
    rope = RotaryEmbedding(64, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}, 4096)
    pos = torch.tensor([0, 5, 9000, 17])  # beyond the initial table: it grows
    for dtype in (torch.float32, torch.bfloat16):
        q, k = _rows(dtype, (4, 4, 64), 11, 1.0), _rows(dtype, (4, 2, 64), 12, 1.0)
        want = rope(pos, q, k)
        got = rope.apply_(pos, q.clone(), k.clone())
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_unsupported_falls_back_or_names_it():
    layer_ops.set_enabled(True)
    try:
        x, w = _rows(torch.float16, (4, 64), 13), _rows(torch.float16, (64,), 14)
        assert not layer_ops.supported(x, w)
        with pytest.raises(ValueError, match="float16"):
            layer_ops.rms_norm(x, w, 1e-6)
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))  # the layer falls back
        x32 = _rows(torch.float32, (4, 64), 15)
        assert not layer_ops.supported(x32, w)  # mixed dtypes (bf16 weights on fp32 rows)
        strided = _rows(torch.float32, (4, 8, 64), 16)[:, ::2]
        assert not layer_ops.supported(strided)
        with pytest.raises(ValueError, match="rope"):
            layer_ops.rope_(torch.tensor([0, 1]), _rows(torch.float32, (2, 1, 8), 1), None,
                            *_tables(torch.float32, 8, 1)[:2])  # position 1 outside a 1-row table
    finally:
        layer_ops.set_enabled(None)


def test_off_switch_gives_torch_formulas():
    x, r, w = _rows(torch.float32, (9, 512), 17), _rows(torch.float32, (9, 512), 18), _rows(torch.float32, (512,), 19)
    layer_ops.set_enabled(False)
    try:
        assert layer_ops.isa() == "off" and not layer_ops.supported(x, w)
        res = r.clone()
        assert torch.equal(RMSNorm(w, 1e-6).add(x, res), rms_norm_torch(x + r, w, 1e-6))
    finally:
        layer_ops.set_enabled(None)
    assert layer_ops.isa() in ("avx512", "portable", "off")


@pytest.mark.parametrize("mode", ["portable", "off"])
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_portable_and_torch_paths_match_hf_token_for_token(tmp_path, family, mode):
    """The whole engine (fp32) with the portable C ops forced, or with the ops off (torch
    formulas), gives Hugging Face's greedy tokens (the default AVX-512 path is what every
    other HF test of the families runs)."""
    import tests.engine.checkpoints as ck
    from xllm_vmm import LLM, SamplingParams

    d = getattr(ck, f"{family}_checkpoint")(tmp_path / family)
    hf = ck.load_hf_model(d)
    prompts = [[(7 * i + 11 * n + 5) % 300 + 4 for i in range(n)] for n in (1, 17, 83)]
    layer_ops.set_enabled(mode != "off")
    if mode == "portable":
        layer_ops.force_portable(True)
    try:
        with LLM(str(d), block_size=16, device_memory="96MiB", max_tokens_per_batch=512,
                 enable_vmm_kvcache=True, vmm_elastic=True) as llm:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True))
    finally:
        layer_ops.force_portable(False)
        layer_ops.set_enabled(None)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == ck.hf_greedy(hf, p, 8), f"{family}, {mode}: {len(p)} tokens"
