"""The native paged decode kernel (``native/paged_attn.c`` through
:mod:`xllm_vmm.engine.attention.native_decode`) against a float64 reference over random block
tables: scattered blocks, shared prefix blocks, lengths 1, bs-1, bs, bs+1 and many blocks; every
slot the kernel must not read (unused blocks, a last block's tail, padding table entries) holds
NaN and the output must be finite. GQA groups 1/2/4/8, head_dim 64/128 (and 80, 72: the
AVX-512 tail masks and the portable fallback), float32 and bfloat16, 1 and 2 threads, both
implementations (AVX-512 where the CPU has it — with its bf16 scores on the AMX tiles where
those run, and with AMX off — and the portable C forced)."""

from __future__ import annotations

import threading

import pytest
import torch

from xllm_vmm.engine.attention import native_decode as nd

pytestmark = pytest.mark.skipif(nd.load() is None,
                                reason="libxllm_paged_attn.so is not built "
                                       "(python setup.py build_ext --inplace)")

NAN_PAD = 7  # page padding elements (a page need not be a whole number of blocks)


class Arena:
    """K and V of one layer in the KVCacheViews layout: ``S`` pages (slots) of ``Bps`` blocks
    of ``bs`` tokens, each page ``NAN_PAD`` elements longer than its blocks; all NaN until
    written."""

    def __init__(self, S, bps, bs, hkv, d, dtype):
        self.S, self.bps, self.bs, self.hkv, self.d = S, bps, bs, hkv, d
        self.page = bps * bs * hkv * d + NAN_PAD
        self.flat_k = torch.full((S * self.page,), float("nan"), dtype=dtype)
        self.flat_v = torch.full((S * self.page,), float("nan"), dtype=dtype)
        shape, stride = (S, bps * bs, hkv, d), (self.page, hkv * d, d, 1)
        self.k = self.flat_k.as_strided(shape, stride)
        self.v = self.flat_v.as_strided(shape, stride)

    def write(self, blocks, keys, values):
        """keys/values (L, Hkv, D) into the blocks of a sequence (token t in blocks[t // bs])."""
        for t in range(keys.shape[0]):
            b = blocks[t // self.bs]
            slot, off = b // self.bps, (b % self.bps) * self.bs + t % self.bs
            self.k[slot, off] = keys[t]
            self.v[slot, off] = values[t]


def _reference(q, keys, values, scale):
    """q (H, D), keys/values (L, Hkv, D), float64."""
    h, hkv = q.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(h // hkv, dim=1)
    v = values.double().repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    return torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)


def _case(g, *, lens, H, HKV, D, dtype, bs=16, bps=4, shared_prefix=0, extra_rows=3):
    """A random decode batch; returns (arena, q, rows, table, lens, expected rows)."""
    nb = [-(-n // bs) for n in lens]
    need = sum(nb) - shared_prefix * (len(lens) - 1)
    S = -(-(need + 5) // bps) + 1
    arena = Arena(S, bps, bs, HKV, D, dtype)
    perm = torch.randperm(S * bps, generator=g).tolist()  # scattered, never all in one slot
    used = iter(perm)
    width = max(nb) + 2  # padding entries at the end of every row
    table = torch.full((len(lens), width), -1, dtype=torch.int64)
    prefix = [next(used) for _ in range(shared_prefix)]
    hist = []
    for i, n in enumerate(lens):
        blocks = [prefix[j] if j < shared_prefix else next(used) for j in range(nb[i])]
        table[i, :nb[i]] = torch.tensor(blocks)
        if i == 0 or shared_prefix == 0:
            keys = torch.randn(n, HKV, D, generator=g).to(dtype)
            values = torch.randn(n, HKV, D, generator=g).to(dtype)
        else:  # the shared blocks hold the first sequence's keys
            k0, v0 = hist[0]
            m = shared_prefix * bs
            keys = torch.cat([k0[:m], torch.randn(n - m, HKV, D, generator=g).to(dtype)])
            values = torch.cat([v0[:m], torch.randn(n - m, HKV, D, generator=g).to(dtype)])
        arena.write(blocks, keys, values)
        hist.append((keys, values))
    # padding entries point at a never-written (NaN) block when there is one
    spare = next(used, None)
    if spare is not None:
        for i in range(len(lens)):
            table[i, nb[i]:] = spare
    T = len(lens) + extra_rows
    q = torch.randn(T, H, D, generator=g).to(dtype)
    rows = torch.randperm(T, generator=g)[:len(lens)]
    exp = {int(rows[i]): _reference(q[rows[i]].float(), k.float(), v.float(), D ** -0.5)
           for i, (k, v) in enumerate(hist)}
    return arena, q, rows, table, torch.tensor(lens), exp


def _check(out, exp, dtype, untouched):
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=1e-2)
    for r, ref in exp.items():
        assert torch.isfinite(out[r]).all()
        torch.testing.assert_close(out[r].double(), ref, **tol)
    for r in untouched:
        assert (out[r] == 12.5).all()  # rows not in `rows` are left as they were


IMPLS = ["native", "avx512", "portable"]  # native: AMX scores where they run; avx512: AMX off


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
def test_matches_float64_reference(impl, dtype, G, D):
    g = torch.Generator().manual_seed(G * 1000 + D)
    bs = 16
    lens = [1, bs - 1, bs, bs + 1, 9 * bs + 3, 2 * bs, 5, 77]
    HKV = 2
    arena, q, rows, table, lens_t, exp = _case(g, lens=lens, H=HKV * G, HKV=HKV, D=D,
                                               dtype=dtype, bs=bs)
    out = torch.full_like(q, 12.5)
    for threads in (1, 2):
        nd.paged_decode(q, arena.k, arena.v, table, lens_t, block_size=bs,
                        blocks_per_slot=arena.bps, scale=D ** -0.5, rows=rows, out=out,
                        num_threads=threads, portable=impl == "portable",
                        amx=impl != "avx512")
        _check(out, exp, dtype, set(range(q.shape[0])) - set(exp))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_odd_block_size_and_head_dims(impl, dtype):
    """Shared prefix blocks; block_size 24 (tiles of 16 cross block boundaries), 1, 5 and 128
    (the flag default); head_dim 80 (an AVX-512 tail chunk) and 72 (not a multiple of 16: the
    portable path)."""
    g = torch.Generator().manual_seed(5)
    for D, bs in ((80, 24), (72, 24), (64, 1), (128, 5), (64, 128)):
        lens = [3 * bs + 1, 4 * bs, 3 * bs + 7, bs * 6 - 1]
        arena, q, rows, table, lens_t, exp = _case(g, lens=lens, H=8, HKV=2, D=D, dtype=dtype,
                                                   bs=bs, bps=3, shared_prefix=3)
        out = torch.full_like(q, 12.5)
        nd.paged_decode(q, arena.k, arena.v, table, lens_t, block_size=bs,
                        blocks_per_slot=arena.bps, scale=D ** -0.5, rows=rows, out=out,
                        num_threads=2, portable=impl == "portable", amx=impl != "avx512")
        _check(out, exp, dtype, set(range(q.shape[0])) - set(exp))


def test_implementations_agree_and_dispatch():
    from xllm_vmm.engine import cpu_caps

    isa = nd.load().xllm_paged_attn_isa()  # bit 0 AVX-512, bit 1 AVX-512-BF16, less the hidden
    isa &= 0 if cpu_caps.hides("avx512") else ~2 if cpu_caps.hides("avx512_bf16") else ~0
    assert nd.implementation(torch.bfloat16, torch.bfloat16, 64, portable=True) == "portable"
    assert nd.implementation(torch.float32, torch.bfloat16, 64) == "portable"  # mixed types
    assert nd.implementation(torch.bfloat16, torch.bfloat16, 72) == "portable"
    from xllm_vmm.engine.attention import native_prefill as npf

    amx = npf.implementation(torch.bfloat16, torch.bfloat16, 64) == "amx-bf16"  # same check
    assert nd.implementation(torch.bfloat16, torch.bfloat16, 64) == (
        "amx-bf16" if amx else "avx512-bf16" if isa & 2 else "portable")
    assert nd.implementation(torch.bfloat16, torch.bfloat16, 64, amx=False) == (
        "avx512-bf16" if isa & 2 else "portable")
    for d in (80, 160):  # AMX scores: head_dim a multiple of 32 up to 128
        assert nd.implementation(torch.bfloat16, torch.bfloat16, d) == (
            "avx512-bf16" if isa & 2 else "portable")
    assert nd.implementation(torch.float32, torch.float32, 64) != "amx-bf16"
    assert nd.implementation(torch.float32, torch.float32, 128) == (
        "avx512-f32" if isa & 1 else "portable")
    g = torch.Generator().manual_seed(9)
    arena, q, rows, table, lens_t, exp = _case(g, lens=[40, 300, 1], H=8, HKV=4, D=64,
                                               dtype=torch.float32, extra_rows=0)
    kw = dict(block_size=16, blocks_per_slot=arena.bps, scale=0.125, rows=rows)
    a = nd.paged_decode(q, arena.k, arena.v, table, lens_t, portable=True, **kw)
    b = nd.paged_decode(q, arena.k, arena.v, table, lens_t, portable=False, **kw)
    torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


def test_env_forces_the_portable_path(monkeypatch):
    monkeypatch.setenv(nd.ENV, "portable")
    assert nd.portable_by_env() and nd.enabled_by_env()
    monkeypatch.setenv(nd.ENV, "0")
    assert not nd.portable_by_env() and not nd.enabled_by_env()
    monkeypatch.delenv(nd.ENV)
    assert nd.enabled_by_env() and not nd.portable_by_env()  # on by default
    assert nd.amx_by_env()
    monkeypatch.setenv(nd.ENV, "avx512")  # on, AMX scores off (A/B runs)
    assert nd.enabled_by_env() and not nd.portable_by_env() and not nd.amx_by_env()
    from xllm_vmm.engine.attention.torch_sdpa import TorchSDPABackend
    from xllm_vmm.engine.attention.kv import KVGeometry

    be = TorchSDPABackend(KVGeometry("attn", 16, 4, 64), num_heads=4,
                          num_kv_heads=2, head_dim=64, device="cpu")
    assert be.native_decode and not be.native_amx


def test_mixed_q_and_kv_dtypes():
    """float32 queries over bfloat16 K/V (a 2-byte KV cache under fp32 compute): portable."""
    g = torch.Generator().manual_seed(11)
    arena, q, rows, table, lens_t, exp = _case(g, lens=[17, 33], H=4, HKV=2, D=64,
                                               dtype=torch.bfloat16, extra_rows=0)
    out = nd.paged_decode(q.float(), arena.k, arena.v, table, lens_t, block_size=16,
                          blocks_per_slot=arena.bps, scale=0.125, rows=rows)
    assert out.dtype == torch.float32
    _check(out, exp, torch.float32, ())


def test_concurrent_callers_share_the_pool():
    """Two Python threads calling at once (ctypes releases the GIL): the pool's busy path runs
    the second call on its own thread; both results are right."""
    g = torch.Generator().manual_seed(13)
    cases = [_case(g, lens=[200, 90, 31, 64] * 4, H=8, HKV=4, D=64, dtype=torch.bfloat16,
                   extra_rows=0) for _ in range(2)]
    errors = []

    def work(c):
        arena, q, rows, table, lens_t, exp = c
        try:
            for _ in range(20):
                out = nd.paged_decode(q, arena.k, arena.v, table, lens_t, block_size=16,
                                      blocks_per_slot=arena.bps, scale=0.125, rows=rows,
                                      num_threads=2)
                _check(out, exp, torch.bfloat16, ())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(c,)) for c in cases]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


def test_bad_arguments_raise_value_error_naming_them():
    g = torch.Generator().manual_seed(17)
    arena, q, rows, table, lens_t, _ = _case(g, lens=[20, 5], H=4, HKV=2, D=64,
                                             dtype=torch.float32, extra_rows=0)
    kw = dict(block_size=16, blocks_per_slot=arena.bps, scale=0.125)

    def call(**over):
        a = dict(q=q, k_slots=arena.k, v_slots=arena.v, block_table=table, seq_lens=lens_t)
        a.update(over)
        return nd.paged_decode(a.pop("q"), a.pop("k_slots"), a.pop("v_slots"),
                               a.pop("block_table"), a.pop("seq_lens"), **{**kw, **a})

    with pytest.raises(ValueError, match="q must be float32 or bfloat16"):
        call(q=q.half())
    with pytest.raises(ValueError, match=r"q must be \(T, H, D\)"):
        call(q=q[0])
    with pytest.raises(ValueError, match="k_slots/v_slots must be float32 or bfloat16"):
        call(v_slots=arena.v.to(torch.bfloat16))
    with pytest.raises(ValueError, match="head_dim 64 differs"):
        call(q=q[..., :32].contiguous())
    with pytest.raises(ValueError, match="q heads 3"):
        call(q=q[:, :3].contiguous())
    with pytest.raises(ValueError, match="seq_lens must be in"):
        call(seq_lens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="seq_lens must be in"):
        call(seq_lens=torch.tensor([20, table.shape[1] * 16 + 1]))
    with pytest.raises(ValueError, match="block id outside"):
        bad = table.clone()
        bad[1, 0] = arena.S * arena.bps
        call(block_table=bad)
    with pytest.raises(ValueError, match="block id outside"):
        bad = table.clone()
        bad[0, 1] = -1
        call(block_table=bad)
    with pytest.raises(ValueError, match="row outside"):
        call(rows=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"rows \(3,\) must be \(2,\)"):
        call(rows=torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="block_table must be an integer tensor"):
        call(block_table=table.float())
    with pytest.raises(ValueError, match="out must be a contiguous"):
        call(out=torch.empty(2, 4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="tokens per slot"):
        call(block_size=8)
    with pytest.raises(ValueError, match="runs on CPU"):
        call(q=q.to("meta"))


def test_backend_default_and_switches(monkeypatch):
    """The torch backend runs decodes on the kernel by default; ``XLLM_VMM_NATIVE_DECODE=0``
    or ``native_decode=False`` turn it off; ``portable`` forces the portable C."""
    from xllm_vmm.engine.attention.kv import KVGeometry
    from xllm_vmm.engine.attention.torch_sdpa import TorchSDPABackend

    geo = KVGeometry("attn", 16, 4, 64)

    def backend(**kw):
        return TorchSDPABackend(geo, num_heads=8, num_kv_heads=4, head_dim=64, device="cpu", **kw)

    monkeypatch.delenv(nd.ENV, raising=False)
    be = backend()
    assert be.native_decode and not be.native_portable
    assert not backend(native_decode=False).native_decode
    assert not backend(batch_decodes=False).native_decode  # per-sequence views: no kernel
    monkeypatch.setenv(nd.ENV, "0")
    assert not backend().native_decode
    assert backend(native_decode=True).native_decode
    monkeypatch.setenv(nd.ENV, "portable")
    be = backend()
    assert be.native_decode and be.native_portable
    # unsupported configurations fall back to gather + SDPA
    assert not be._use_native(torch.empty(1, 8, 64, dtype=torch.float16),
                              type("KV", (), {"k_slots": torch.empty(1, dtype=torch.float16)})())


def test_pool_survives_fork_and_odd_thread_counts():
    """More threads than work items or cores, then a fork: the child's pool starts empty
    (pthread_atfork) and is created again; results stay right in parent and child."""
    import os

    g = torch.Generator().manual_seed(19)
    arena, q, rows, table, lens_t, exp = _case(g, lens=[50, 3], H=4, HKV=2, D=64,
                                               dtype=torch.bfloat16, extra_rows=0)
    kw = dict(block_size=16, blocks_per_slot=arena.bps, scale=0.125, rows=rows)
    for n in (3, 7, 64, 1000):  # clamped to the work items (4) and to the pool's maximum
        _check(nd.paged_decode(q, arena.k, arena.v, table, lens_t, num_threads=n, **kw),
               exp, torch.bfloat16, ())
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            import signal

            signal.alarm(60)  # a child waiting on workers it does not have dies, not hangs
            out = nd.paged_decode(q, arena.k, arena.v, table, lens_t, num_threads=2, **kw)
            _check(out, exp, torch.bfloat16, ())
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    _check(nd.paged_decode(q, arena.k, arena.v, table, lens_t, num_threads=2, **kw),
           exp, torch.bfloat16, ())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_index_put(dtype):
    """One native copy call stores what ``index_put_`` stores, from contiguous rows and from
    rows of a wider projection output (a row stride), and nothing else changes."""
    g = torch.Generator().manual_seed(23)
    a, b = Arena(6, 3, 16, 2, 64, dtype), Arena(6, 3, 16, 2, 64, dtype)
    flat = torch.randperm(6 * 48, generator=g)[:37]
    page, off = flat // 48, flat % 48
    wide = torch.randn(37, 3, 2, 64, generator=g).to(dtype)  # e.g. a fused qkv output
    for k, v in ((torch.randn(37, 2, 64, generator=g).to(dtype),
                  torch.randn(37, 2, 64, generator=g).to(dtype)), (wide[:, 1], wide[:, 2])):
        assert nd.write_kv(k, v, a.k, a.v, page, off)
        b.k.index_put_((page, off), k)
        b.v.index_put_((page, off), v)
        assert torch.equal(a.flat_k.nan_to_num(7.0), b.flat_k.nan_to_num(7.0))
        assert torch.equal(a.flat_v.nan_to_num(7.0), b.flat_v.nan_to_num(7.0))
    # what it does not take is left to torch (False, nothing written)
    assert not nd.write_kv(k.half(), v.half(), a.k, a.v, page, off)
    assert not nd.write_kv(k, v, a.k, a.v, page.int(), off)
    with pytest.raises(ValueError, match="a page outside"):
        nd.write_kv(k, v, a.k, a.v, torch.full_like(page, 6), off)
    with pytest.raises(ValueError, match="an offset outside"):
        nd.write_kv(k, v, a.k, a.v, page, torch.full_like(off, 48))
    assert torch.equal(a.flat_k.nan_to_num(7.0), b.flat_k.nan_to_num(7.0))
