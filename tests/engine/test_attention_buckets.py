"""The batched decode paths — the native paged kernel (blocks read in place) and the gather +
SDPA path with several length buckets (more than ``DECODE_BUCKET_MIN`` decodes of mixed
lengths): every decode's output equals the reference over its whole history, in a decode-only
step and in one mixed with a prefill, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from tests.engine import checkpoints as C
from tests.engine.paged_stack import PagedStack
from tests.engine.test_attention_backends import D, H, HKV, _reference
from xllm_vmm.engine.attention import backend_class
from xllm_vmm.engine.attention.torch_sdpa import DECODE_BUCKET_MIN, MAX_DECODE_BUCKETS
from xllm_vmm.engine.step import StepInput


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return C.llama_checkpoint(tmp_path_factory.mktemp("buckets") / "m")


@pytest.mark.parametrize("native", [True, "portable", False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucketed_decodes_match_reference(model_dir, monkeypatch, dtype, native):
    from xllm_vmm.engine.attention import native_decode

    if native == "portable":  # the kernel's portable C, forced through the environment
        monkeypatch.setenv(native_decode.ENV, "portable")
    if native and native_decode.load() is None:
        pytest.skip("libxllm_paged_attn.so is not built (python setup.py build_ext --inplace)")
    g = torch.Generator().manual_seed(3)
    n_seq = DECODE_BUCKET_MIN * MAX_DECODE_BUCKETS + 5
    stack = PagedStack(model_dir, block_size=16, shuffle_blocks=1500)
    try:
        _run(stack, g, n_seq, dtype, native)
    finally:
        stack.close()


def _run(stack, g, n_seq, dtype, native):
    views = stack.worker.kv_views
    be = backend_class("torch", "cpu")(views.geometry, num_heads=H, num_kv_heads=HKV,
                                       head_dim=D, device="cpu", native_decode=bool(native))
    assert be.native_portable is (native == "portable")
    layer = views.layers[0]
    history: dict[str, tuple[list, list]] = {}
    lens = torch.randint(1, 70, (n_seq,), generator=g).tolist()
    plans = [[(f"r{i}", n) for i, n in enumerate(lens)],
             [(f"r{i}", 1) for i in range(n_seq)],
             [(f"r{i}", 1) for i in range(n_seq)] + [("late", 21)]]
    for plan in plans:
        chunks = [stack.chunk(r, list(range(3, 3 + n))) for r, n in plan]
        step = StepInput.build(chunks, stack.block_size)
        t = step.num_tokens
        q = torch.randn(t, H, D, generator=g).to(dtype)
        k = torch.randn(t, HKV, D, generator=g).to(dtype)
        v = torch.randn(t, HKV, D, generator=g).to(dtype)
        meta = be.prepare(step)
        if plan is not plans[0]:
            assert len(meta.decode_buckets) == MAX_DECODE_BUCKETS
        be.write_kv(layer, k, v, meta)
        assert be._use_native(q, layer) is bool(native)
        out = be.attend(q, k, v, layer, meta)
        qsl = step.query_start_loc.tolist()
        for i, (rid, n) in enumerate(plan):
            ks, vs = history.setdefault(rid, ([], []))
            ks.append(k[qsl[i]:qsl[i + 1]].to(layer.k_slots.dtype).to(dtype))
            vs.append(v[qsl[i]:qsl[i + 1]].to(layer.k_slots.dtype).to(dtype))
            keys, values = torch.cat(ks), torch.cat(vs)
            ref = _reference(q[qsl[i]:qsl[i + 1]].float(), keys.float(), values.float(),
                             keys.shape[0] - n)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref, atol=tol, rtol=tol)
