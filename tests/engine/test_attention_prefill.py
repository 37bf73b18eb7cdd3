"""The native paged prefill kernel (``xllm_paged_prefill`` of ``native/paged_attn.c`` through
:mod:`xllm_vmm.engine.attention.native_prefill`) against a float64 reference: chunks at
position 0 and with offsets (chunked prefill, prefix hits), lengths around block and tile
boundaries (1, 15, 16, 17, 63, 64, 65 and many blocks), scattered blocks, every slot the kernel
must not read holding NaN, rows outside the chunks untouched; GQA groups 1/2/4/8, head_dim
32/64/96/128 (and 40: the portable fallback); every implementation this CPU runs (AMX, AVX-512,
the portable C forced), 1 and 2 threads; bad arguments; the torch backend's switches and
per-chunk choice; the whole fp32 engine equal to transformers with the kernel forced."""

from __future__ import annotations

import re

import pytest
import torch

from tests.engine.test_native_decode import Arena
from xllm_vmm.engine.attention import native_decode as nd
from xllm_vmm.engine.attention import native_prefill as npf

pytestmark = pytest.mark.skipif(nd.load() is None,
                                reason="libxllm_paged_attn.so is not built "
                                       "(python setup.py build_ext --inplace)")

IMPLS = ["best", "avx512", "portable"]


def _impl_kw(impl: str) -> dict:
    return {"best": {}, "avx512": {"amx": False}, "portable": {"portable": True}}[impl]


def _reference(q, keys, values, scale):
    """q (n, H, D) ending a sequence of keys/values (L, Hkv, D), float64, causal."""
    n, h = q.shape[:2]
    L, hkv = keys.shape[:2]
    k = keys.double().repeat_interleave(h // hkv, dim=1)
    v = values.double().repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    seen = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)


def _case(g, chunks, *, H, HKV, D, dtype, bs=16, bps=4, order=None):
    """chunks [(n, L)]: an arena with every chunk's L keys in scattered blocks, q rows in
    ``order`` of the chunks with one spare row between them; returns (arena, q, q0, q1, lens,
    table, expected per chunk)."""
    nbs = [-(-L // bs) for _, L in chunks]
    S = -(-sum(nbs) // bps) + 2
    arena = Arena(S, bps, bs, HKV, D, dtype)
    perm = torch.randperm(S * bps, generator=g).tolist()
    table = torch.full((len(chunks), max(nbs) + 2), -1, dtype=torch.int64)
    order = list(range(len(chunks))) if order is None else order
    q0 = [0] * len(chunks)
    row = 1
    for c in order:
        q0[c] = row
        row += chunks[c][0] + 1
    q = torch.randn(row, H, D, generator=g).to(dtype)
    used, exp = 0, []
    for c, (n, L) in enumerate(chunks):
        blocks = perm[used:used + nbs[c]]
        used += nbs[c]
        table[c, :nbs[c]] = torch.tensor(blocks)
        keys = torch.randn(L, HKV, D, generator=g).to(dtype)
        values = torch.randn(L, HKV, D, generator=g).to(dtype)
        arena.write(blocks, keys, values)
        exp.append(_reference(q[q0[c]:q0[c] + n], keys, values, D ** -0.5))
    q1 = [q0[c] + n for c, (n, _) in enumerate(chunks)]
    lens = [L for _, L in chunks]
    return arena, q, torch.tensor(q0), torch.tensor(q1), torch.tensor(lens), table, exp


def _check(out, q0, q1, exp, dtype):
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    for c, e in enumerate(exp):
        o = out[q0[c]:q1[c]].double()
        assert torch.isfinite(o).all()
        if dtype == torch.float32:
            torch.testing.assert_close(o, e, atol=2e-5, rtol=1e-5)
        else:  # bf16 inputs, bf16 probabilities and output (SDPA's flash kernel: the same)
            torch.testing.assert_close(o, e, atol=1.6e-2, rtol=1e-2)
        keep[q0[c]:q1[c]] = False
    assert (out[keep] == 7).all()  # rows outside the chunks are left as they are


CHUNKS = [(1, 1), (15, 15), (16, 16), (17, 17), (5, 63), (64, 64), (65, 200), (130, 130),
          (33, 97)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G, D", [(2, 64), (1, 128), (4, 32), (8, 96)])
def test_matches_float64_reference(impl, dtype, G, D):
    g = torch.Generator().manual_seed(G * 1000 + D)
    hkv = 2
    arena, q, q0, q1, lens, table, exp = _case(g, CHUNKS, H=G * hkv, HKV=hkv, D=D, dtype=dtype,
                                               order=[3, 0, 8, 1, 7, 2, 6, 4, 5])
    for threads in (1, 2):
        out = torch.full_like(q, 7.0)
        npf.paged_prefill(q, arena.k, arena.v, table, q0, q1, lens, block_size=16,
                          blocks_per_slot=arena.bps, scale=D ** -0.5, out=out,
                          num_threads=threads, **_impl_kw(impl))
        _check(out, q0, q1, exp, dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_odd_block_sizes_and_head_dim_fallback(impl):
    """Block sizes 1, 5 and 24 (tiles crossing blocks), and head_dim 40 (no AVX-512 form:
    the portable C takes it whatever is asked)."""
    for bs, D in ((1, 64), (5, 32), (24, 128), (16, 40)):
        g = torch.Generator().manual_seed(bs)
        arena, q, q0, q1, lens, table, exp = _case(g, [(20, 50), (3, 3), (40, 41)], H=4,
                                                   HKV=2, D=D, dtype=torch.bfloat16, bs=bs)
        out = torch.full_like(q, 7.0)
        npf.paged_prefill(q, arena.k, arena.v, table, q0, q1, lens, block_size=bs,
                          blocks_per_slot=arena.bps, scale=D ** -0.5, out=out,
                          **_impl_kw(impl))
        _check(out, q0, q1, exp, torch.bfloat16)
    assert npf.implementation(torch.bfloat16, torch.bfloat16, 40) == "portable"


def test_implementations_and_dispatch():
    impl = npf.implementation(torch.bfloat16, torch.bfloat16, 64)
    assert impl in ("amx-bf16", "avx512-bf16", "portable")
    assert npf.implementation(torch.bfloat16, torch.bfloat16, 64, portable=True) == "portable"
    assert npf.implementation(torch.float32, torch.bfloat16, 64) == "portable"  # mixed
    assert npf.implementation(torch.bfloat16, torch.bfloat16, 64, amx=False) in (
        "avx512-bf16", "portable")
    assert npf.implementation(torch.float32, torch.float32, 64) in ("avx512-f32", "portable")
    # the implementations agree with each other (bf16: within rounding of the output)
    g = torch.Generator().manual_seed(3)
    arena, q, q0, q1, lens, table, _ = _case(g, [(70, 300), (16, 16)], H=8, HKV=4, D=64,
                                             dtype=torch.bfloat16)
    outs = [npf.paged_prefill(q, arena.k, arena.v, table, q0, q1, lens, block_size=16,
                              blocks_per_slot=arena.bps, scale=0.125, out=torch.zeros_like(q),
                              **_impl_kw(i)).float() for i in IMPLS]
    for o in outs[1:]:
        assert (o - outs[0]).abs().max() < 1.6e-2


def test_mixed_q_and_kv_dtypes():
    g = torch.Generator().manual_seed(5)
    arena, q, q0, q1, lens, table, exp = _case(g, [(9, 40)], H=4, HKV=2, D=64,
                                               dtype=torch.bfloat16)
    qf = q.float()
    out = torch.full_like(qf, 7.0)
    npf.paged_prefill(qf, arena.k, arena.v, table, q0, q1, lens, block_size=16,
                      blocks_per_slot=arena.bps, scale=0.125, out=out)
    _check(out, q0, q1, [_reference(qf[q0[0]:q1[0]], *_kv(arena, table[0], 40), 0.125)],
           torch.bfloat16)


def _kv(arena, blocks, L):
    """The L keys/values of a sequence read back from the arena."""
    rows = []
    for kind in (arena.k, arena.v):
        t = [kind[int(blocks[i // arena.bs]) // arena.bps,
                  (int(blocks[i // arena.bs]) % arena.bps) * arena.bs + i % arena.bs]
             for i in range(L)]
        rows.append(torch.stack(t))
    return rows


def test_bad_arguments_raise_value_error_naming_them():
    g = torch.Generator().manual_seed(11)
    arena, q, q0, q1, lens, table, _ = _case(g, [(4, 20)], H=4, HKV=2, D=64,
                                             dtype=torch.bfloat16)
    base = dict(q=q, k_slots=arena.k, v_slots=arena.v, block_table=table, q_start=q0, q_end=q1,
                seq_lens=lens, block_size=16, blocks_per_slot=arena.bps, scale=0.125)

    def call(**over):
        kw = {**base, **over}
        return npf.paged_prefill(kw.pop("q"), kw.pop("k_slots"), kw.pop("v_slots"),
                                 kw.pop("block_table"), kw.pop("q_start"), kw.pop("q_end"),
                                 kw.pop("seq_lens"), **kw)

    cases = [
        (dict(q=q[0]), "q must be (T, H, D)"),
        (dict(q=q.half()), "q must be float32 or bfloat16"),
        (dict(k_slots=arena.k.half(), v_slots=arena.v.half()), "k_slots/v_slots must be float32"),
        (dict(q=torch.zeros(q.shape[0], 5, 64, dtype=torch.bfloat16)), "q heads 5 over K/V heads 2"),
        (dict(block_size=8), "block_size 8 x blocks_per_slot"),
        (dict(q_start=torch.tensor([0, 1])), "q_start (2,) / q_end (1,)"),
        (dict(q_end=torch.tensor([int(q0[0])])), "1 <= n = q_end - q_start"),
        (dict(q_end=torch.tensor([q.shape[0] + 1])), "q_end <= "),
        (dict(seq_lens=torch.tensor([3])), "<= seq_len"),
        (dict(seq_lens=torch.tensor([10_000])), "nb * block_size"),
        (dict(block_table=torch.full_like(table, 10_000)), "block id outside"),
        (dict(seq_lens=lens.float()), "seq_lens must be an integer tensor"),
        (dict(out=torch.zeros(2, 2)), "out must be a contiguous CPU"),
    ]
    before = q.clone()
    for over, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            call(**over)
    assert torch.equal(q, before)


def _backend(**kw):
    from xllm_vmm.engine.attention.kv import KVGeometry
    from xllm_vmm.engine.attention.torch_sdpa import TorchSDPABackend

    return TorchSDPABackend(KVGeometry("attn", 16, 4, 64), num_heads=8, num_kv_heads=4,
                            head_dim=64, device="cpu", **kw)


def test_backend_switches(monkeypatch):
    """``XLLM_VMM_NATIVE_PREFILL`` / ``native_prefill``: auto by default (every chunk where the
    AMX or the AVX-512 float32 form runs; the AVX-512-BF16 form alone: chunks of at most 32;
    none on the portable C alone), ``0`` off, ``1`` every chunk, ``portable``; a bad value is
    refused naming it."""
    monkeypatch.delenv(npf.ENV, raising=False)
    be = _backend()
    assert be.native_prefill == "auto"
    bf = type("KV", (), {"k_slots": torch.empty(1, dtype=torch.bfloat16)})()
    f32 = type("KV", (), {"k_slots": torch.empty(1)})()
    q_bf, q_f32 = torch.empty(1, 8, 64, dtype=torch.bfloat16), torch.empty(1, 8, 64)
    impl = npf.implementation(torch.bfloat16, torch.bfloat16, 64)
    want = {"amx-bf16": 1 << 62, "avx512-bf16": npf.AVX512_BF16_MAX_QUERIES}.get(impl, 0)
    assert be._native_prefill_limit(q_bf, bf) == want
    want32 = 1 << 62 if npf.implementation(torch.float32, torch.float32, 64) == "avx512-f32" else 0
    assert be._native_prefill_limit(q_f32, f32) == want32
    assert be._native_prefill_limit(q_f32, bf) == 0  # mixed dtypes: only the portable C
    for env, mode in (("0", "off"), ("1", "on"), ("portable", "portable"), ("", "auto")):
        monkeypatch.setenv(npf.ENV, env)
        assert _backend().native_prefill == mode
    monkeypatch.setenv(npf.ENV, "0")
    assert _backend(native_prefill=True).native_prefill == "on"
    assert _backend()._native_prefill_limit(q_bf, bf) == 0
    assert _backend(native_prefill="on")._native_prefill_limit(q_f32, bf) == 1 << 62
    with pytest.raises(ValueError, match="native_prefill 'fast' is not one of"):
        _backend(native_prefill="fast")


def test_backend_splits_chunks_by_limit():
    """A step whose chunks are partly above the kernel's limit: those go to SDPA, the others
    to the kernel, and every row equals SDPA alone."""
    from xllm_vmm.bench.attention import _prefill_case

    c = _prefill_case(8, 40, 64, 64, torch.bfloat16, 8, 4, 16, 4, 0)  # 8 chunks of 8 at 40
    step = c["step"]
    # make half the chunks longer: rebuild the step with chunks of 8 and 24 queries is more
    # work than limiting the kernel to chunks of at most 4 queries, which none is: all SDPA,
    # then a limit of 8: all native, then a mixed split through native_prefills()
    be = _backend(native_prefill="on")
    ref = _backend(native_prefill="off")
    meta, meta_ref = be.prepare(step), ref.prepare(step)
    want = ref.attend(c["q"], c["k"], c["v"], c["layer"], meta_ref)
    got = be.attend(c["q"], c["k"], c["v"], c["layer"], meta)
    assert (got.float() - want.float()).abs().max() < 1.6e-2
    q0, q1, lens, table = meta.native_prefills(8)
    assert q0.shape == (8,) and table.shape[0] == 8
    q0, q1, lens, table = meta.native_prefills(4)
    assert q0.shape == (0,)
    be._prefill_ok[(torch.bfloat16, torch.bfloat16, "cpu")] = (4, 1 << 62, 1 << 62)  # none
    got = be.attend(c["q"], c["k"], c["v"], c["layer"], be.prepare(step))
    assert torch.equal(got, want)


def test_backend_routes_chunks_by_keys_too():
    """The route's key bound: chunks (8 queries ending at key 48) past ``max_keys`` go to SDPA
    unless they are within ``any_keys_queries``; every row equals SDPA either way."""
    from xllm_vmm.bench.attention import _prefill_case

    c = _prefill_case(8, 40, 64, 64, torch.bfloat16, 8, 4, 16, 4, 0)  # 8 chunks of 8 at 40
    step = c["step"]
    ref = _backend(native_prefill="off")
    want = ref.attend(c["q"], c["k"], c["v"], c["layer"], ref.prepare(step))
    be = _backend(native_prefill="on")
    meta = be.prepare(step)
    assert meta.native_prefills(1 << 62, 47, 7)[0].shape == (0,)  # 48 keys > 47, 8 queries > 7
    assert meta.native_prefills(1 << 62, 48, 0)[0].shape == (8,)  # within the keys
    assert meta.native_prefills(1 << 62, 0, 8)[0].shape == (8,)  # short enough for any keys
    key = (torch.bfloat16, torch.bfloat16, "cpu")
    for route, native in (((1 << 62, 47, 7), False), ((1 << 62, 48, 0), True)):
        be._prefill_ok[key] = route
        got = be.attend(c["q"], c["k"], c["v"], c["layer"], be.prepare(step))
        if native:
            assert (got.float() - want.float()).abs().max() < 1.6e-2
        else:
            assert torch.equal(got, want)  # SDPA alone: the same bits


def test_default_route_bounds_the_amx_form_at_wide_heads():
    """``auto``: the AMX form takes every chunk below head_dim 128 and, from 128, chunks of at
    most 512 queries ending within 1,024 keys or of at most 128 queries (measured,
    ``AMX_WIDE_HEAD_DIM``); ``route_takes`` applies the rule."""
    r = npf.AMX_WIDE_ROUTE
    assert npf.route_takes(r, 512, 1024) and npf.route_takes(r, 128, 4096)
    assert not npf.route_takes(r, 512, 1025) and not npf.route_takes(r, 513, 600)
    assert not npf.route_takes(r, 256, 1280) and npf.route_takes(r, 1, 1 << 20)
    for d in (64, 128):
        impl = npf.implementation(torch.bfloat16, torch.bfloat16, d)
        route = npf.default_route(torch.bfloat16, torch.bfloat16, d)
        if impl == "amx-bf16":
            assert route == (r if d >= npf.AMX_WIDE_HEAD_DIM else (npf.UNBOUNDED,) * 3)
        elif impl == "avx512-bf16":
            assert route == (npf.AVX512_BF16_MAX_QUERIES, npf.UNBOUNDED, npf.UNBOUNDED)
        else:
            assert route == (0, 0, 0)
        assert npf.default_limit(torch.bfloat16, torch.bfloat16, d) == route[0]


@pytest.mark.parametrize("mode", ["on", "portable"])
def test_engine_fp32_greedy_matches_hf_with_the_kernel_forced(tmp_path, monkeypatch, mode):
    """The whole engine (fp32 Llama, head_dim 32: the AVX-512 float32 form with ``on``, the
    portable C with ``portable``): chunked prefill (chunks with offsets), a second pass that
    hits the prefix cache, batched decodes — greedy tokens equal transformers'."""
    import tests.engine.checkpoints as ck
    from xllm_vmm import LLM, SamplingParams

    monkeypatch.setenv(npf.ENV, mode)
    d = ck.llama_checkpoint(tmp_path / "m", head_dim=32)
    hf = ck.load_hf_model(d)
    prompts = [ck.random_prompt(n, 3) for n in (1, 15, 16, 17, 40, 70)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(d), block_size=16, device_memory="96MiB", max_tokens_per_batch=32,
             enable_prefix_cache=True) as llm:
        for _ in range(2):  # the second pass hits the prefix cache (chunks with offsets)
            outs = llm.generate(prompts, sp)
            for p, o in zip(prompts, outs):
                assert o.outputs[0].token_ids == ck.hf_greedy(hf, p, 6), f"{mode}: {len(p)}"
