"""Row buckets (``engine/row_buckets.py``): products of a 16-bit model on the CPU run over a
bounded set of row counts, so a server's varying step sizes stop JIT-compiling new oneDNN
primitives, and the real rows' bits do not move."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.engine import checkpoints as C
from tests.engine.paged_stack import PagedStack
from xllm_vmm.engine import row_buckets as rb
from xllm_vmm.engine.layers import layer_ops, packed


@pytest.fixture
def padding_on():
    """Padding on, and 16-bit products in their own dtype (where they run in float32 nothing is
    padded: :func:`test_16_bit_in_fp32_is_not_padded`)."""
    from xllm_vmm.engine import cpu_caps

    old = rb.set_enabled(True)
    old_bf16 = cpu_caps.set_bf16_as_fp32(False)
    old_fp16 = cpu_caps.set_fp16_as_fp32(False)
    yield
    rb.set_enabled(old)
    cpu_caps.set_bf16_as_fp32(old_bf16)
    cpu_caps.set_fp16_as_fp32(old_fp16)


@pytest.mark.parametrize("in_fp32, kept", [(torch.bfloat16, torch.float16),
                                            (torch.float16, torch.bfloat16)])
def test_16_bit_in_fp32_is_not_padded(padding_on, in_fp32, kept):
    """Where one 16-bit dtype's products run in float32 (MKL ``sgemm``, no per-shape
    compilation) its tensors keep their exact rows; the other 16-bit dtype is still padded."""
    from xllm_vmm.engine import cpu_caps

    (cpu_caps.set_bf16_as_fp32 if in_fp32 is torch.bfloat16 else cpu_caps.set_fp16_as_fp32)(True)
    x = rb.empty_rows(100, (8,), in_fp32)
    assert x.untyped_storage().nbytes() == 100 * 8 * 2 and rb.widen(x) is x
    assert rb.empty_rows(100, (8,), kept).untyped_storage().nbytes() == 104 * 8 * 2


def test_padded_rows_is_bounded_monotone_and_at_most_an_eighth_more():
    sizes = [rb.padded_rows(n) for n in range(1, 16385)]
    assert sizes[:16] == list(range(1, 17))  # decode batches of a few sequences: exact
    assert len(set(sizes)) == 96  # 16 exact + 8 per octave over 10 octaves
    for n, p in enumerate(sizes, start=1):
        assert p >= n and (p - n) * 8 < n and rb.padded_rows(p) == p
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))
    assert [rb.padded_rows(n) for n in (17, 33, 100, 129, 300, 2049, 10240)] == [
        18, 36, 104, 144, 320, 2304, 10240]


def test_empty_rows_pads_only_16_bit_cpu_tensors(padding_on):
    t = rb.empty_rows(100, (64,), torch.bfloat16)
    assert t.shape == (100, 64) and t.is_contiguous() and t.storage_offset() == 0
    assert t.untyped_storage().nbytes() == 104 * 64 * 2
    assert rb.widen(t).shape == (104, 64) and rb.widen(t).data_ptr() == t.data_ptr()
    f = rb.empty_rows(100, (64,), torch.float32)  # float32: MKL sgemm, never padded
    assert f.untyped_storage().nbytes() == 100 * 64 * 4 and rb.widen(f) is f
    assert rb.empty_rows_like(torch.zeros(33, 2, 8, dtype=torch.float16)).untyped_storage(
    ).nbytes() == 36 * 16 * 2
    rb.set_enabled(False)
    assert rb.empty_rows(100, (64,), torch.bfloat16).untyped_storage().nbytes() == 100 * 128


def test_widen_leaves_tensors_it_cannot_pad(padding_on):
    exact = torch.empty(100, 64, dtype=torch.bfloat16)  # no room for the padded rows
    assert rb.widen(exact) is exact
    big = torch.empty(200, 64, dtype=torch.bfloat16)
    off = big[1:101]  # storage offset 1: left as it is
    assert rb.widen(off) is off
    assert rb.widen(big[:100]).shape == (104, 64)  # offset 0 with room: widened
    strided = torch.empty(104, 128, dtype=torch.bfloat16)[:100, :64]
    assert rb.widen(strided) is strided
    assert rb.widen(torch.empty(16, 64, dtype=torch.bfloat16)).shape == (16, 64)


@pytest.mark.parametrize("rows", [17, 100, 300, 1000])
def test_products_over_padded_rows_keep_the_real_rows_bits(padding_on, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 128, generator=g).to(torch.bfloat16)
    b = torch.randn(384, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
    xp = rb.empty_rows(rows, (128,), torch.bfloat16)
    xp.copy_(x)
    want = F.linear(x, w, b)
    got = rb.on_padded_rows(F.linear, xp, w, b)
    assert got.shape == want.shape and got.is_contiguous() and torch.equal(got, want)
    if packed.enabled():
        p = packed.pack(w)
        assert torch.equal(packed.linear(xp, p, b), want)


def test_layer_ops_outputs_have_padded_rows(padding_on):
    if not layer_ops.enabled():
        pytest.skip("native layer ops unavailable")
    x = torch.randn(300, 64).to(torch.bfloat16)
    out = layer_ops.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    assert out.shape == (300, 64) and rb.widen(out).shape == (320, 64)
    gu = torch.randn(300, 128).to(torch.bfloat16)
    act = layer_ops.silu_and_mul(gu[:, :64], gu[:, 64:])
    assert act.shape == (300, 64) and rb.widen(act).shape == (320, 64)


_COUNT = textwrap.dedent("""
    import random, torch
    from xllm_vmm.engine.layers import packed
    from xllm_vmm.engine.row_buckets import empty_rows
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ws = [packed.pack(torch.randn(n, 64, generator=g).to(torch.bfloat16)) for n in (96, 160)]
    rows = random.Random(0).sample(range(100, 1100), 60)
    for n in rows:
        x = empty_rows(n, (64,), torch.bfloat16)
        x.zero_()
        for w in ws:
            assert packed.linear(x, w, None).shape[0] == n
""")


@pytest.mark.skipif(not packed.enabled(),
                    reason=f"packed linear off here: {packed.disabled_reason()}")
def test_sixty_step_sizes_compile_at_most_the_buckets_primitives():
    """What a server sees: 60 distinct step sizes through two products. Without buckets oneDNN
    JIT-compiles one primitive per size and product (120); with them one per bucket."""
    def misses(on: str) -> int:
        env = dict(os.environ, ONEDNN_VERBOSE="profile_create", **{rb.ENV: on})
        r = subprocess.run([sys.executable, "-c", _COUNT], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return sum(1 for line in r.stdout.splitlines()
                   if "create:cache_miss" in line and ",inner_product," in line)

    import random

    buckets = {rb.padded_rows(n) for n in random.Random(0).sample(range(100, 1100), 60)}
    exact, padded = misses("0"), misses("1")
    assert exact == 120
    assert padded == 2 * len(buckets) and len(buckets) <= 30


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_bf16_model_gives_the_same_tokens_and_logits_with_and_without_buckets(tmp_path, family):
    make = C.llama_checkpoint if family == "llama" else C.qwen3_moe_checkpoint
    d = make(tmp_path / "m", tie_word_embeddings=family != "llama")
    prompts = {"a": C.random_prompt(37, 3), "b": C.random_prompt(19, 4), "c": C.random_prompt(5, 5)}
    results = []
    for on in (True, False):
        old = rb.set_enabled(on)
        s = PagedStack(d, block_size=16, dtype="bfloat16")
        try:
            got = s.greedy(prompts, 6, chunk=23)
            ids = prompts["a"] + got["a"]
            results.append((got, s.step([s.chunk("x", ids)]).logits[0]))
        finally:
            s.close()
            rb.set_enabled(old)
    (tok_on, logits_on), (tok_off, logits_off) = results
    assert tok_on == tok_off
    assert torch.equal(logits_on, logits_off)
