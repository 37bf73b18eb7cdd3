"""Compute paths chosen from the CPU (``engine.cpu_caps``): each path forced by hiding what
this CPU has, so a machine with AVX-512 also runs the AVX2 / portable paths; the engine stays
token-for-token equal to transformers on them, and a bfloat16 checkpoint serves without
oneDNN's bfloat16 kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine.checkpoints import build_checkpoint, hf_greedy, llama_checkpoint, load_hf_model
from xllm_vmm import LLM, SamplingParams
from xllm_vmm.engine import cpu_caps
from xllm_vmm.engine import paths as path_record
from xllm_vmm.engine.layers import layer_ops, packed

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 11 * salt + 5) % 300 + 4 for i in range(n)]


def _apply() -> None:
    cpu_caps.reset()
    if layer_ops.load() is not None:
        layer_ops.force_portable(False)  # the CPU's best, less what is hidden


@pytest.fixture
def hidden(monkeypatch):
    """``hidden("avx512")``: this process runs as if the CPU lacked it, until the test ends."""
    def hide(value: str) -> cpu_caps.CpuCaps:
        monkeypatch.setenv(cpu_caps.HIDE_ENV, value)
        _apply()
        return cpu_caps.caps()

    yield hide
    monkeypatch.delenv(cpu_caps.HIDE_ENV, raising=False)
    monkeypatch.undo()
    _apply()


def test_an_unknown_hidden_capability_names_the_variable_and_the_accepted_values():
    with pytest.raises(ValueError) as e:
        cpu_caps.parse_hidden("avx512,sse9")
    msg = str(e.value)
    assert cpu_caps.HIDE_ENV in msg and "'sse9'" in msg
    assert all(name in msg for name in cpu_caps.HIDEABLE)
    assert cpu_caps.parse_hidden(" AVX512 , ") == {"avx512", "avx512_bf16", "amx"}
    assert cpu_caps.parse_hidden("") == frozenset()


def test_a_bad_bf16_compute_value_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_caps.BF16_ENV, "fp8")
    with pytest.raises(ValueError, match=cpu_caps.BF16_ENV):
        cpu_caps.bf16_compute()
    monkeypatch.setenv(cpu_caps.BF16_ENV, "fp32")
    assert cpu_caps.bf16_compute()[0] == "fp32"


def test_a_bad_fp16_compute_value_is_refused_and_fp16_follows_torchs_check(monkeypatch):
    monkeypatch.setenv(cpu_caps.FP16_ENV, "bf16")
    with pytest.raises(ValueError, match=cpu_caps.FP16_ENV):
        cpu_caps.fp16_compute()
    monkeypatch.setenv(cpu_caps.FP16_ENV, "fp16")
    assert cpu_caps.fp16_compute() == ("fp16", f"{cpu_caps.FP16_ENV}=fp16")
    monkeypatch.delenv(cpu_caps.FP16_ENV)
    native = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())  # AVX512-FP16 or AMX-FP16
    assert cpu_caps.caps().onednn_fp16 == native
    assert cpu_caps.fp16_compute()[0] == ("fp16" if native else "fp32")


def test_caps_describe_this_cpu_and_torch():
    c = cpu_caps.caps()
    assert c.model and c.torch_capability
    assert c.onednn_bf16 == (not c.onednn_bf16_reason)
    assert c.amx <= c.avx512 and c.avx512_bf16 <= c.avx512
    d = c.as_dict()
    assert d["cpu_model"] == c.model and isinstance(d["hidden"], list)


def test_hidden_avx512_takes_every_portable_path(hidden):
    from xllm_vmm.engine import row_buckets
    from xllm_vmm.engine.attention import native_decode as nd
    from xllm_vmm.engine.attention import native_prefill as npf

    c = hidden("avx512")
    assert not c.avx512 and not c.amx and not c.onednn_bf16
    assert "avx512" in packed.disabled_reason() and not packed.enabled()
    assert cpu_caps.bf16_compute()[0] == "fp32" and cpu_caps.bf16_as_fp32()
    assert not c.onednn_fp16 and cpu_caps.fp16_as_fp32()
    # 16-bit products run in float32 (MKL sgemm): nothing to pad per shape
    assert row_buckets.empty_rows(100, (8,), torch.bfloat16).untyped_storage().nbytes() == 1600
    assert row_buckets.empty_rows(100, (8,), torch.float16).untyped_storage().nbytes() == 1600
    if nd.load() is not None:
        for dt in (torch.float32, torch.bfloat16):
            assert nd.implementation(dt, dt, 64) == "portable"
            assert npf.implementation(dt, dt, 64) == "portable"
            assert npf.default_limit(dt, dt, 64) == 0  # SDPA is faster than plain loops
    if layer_ops.load() is not None:
        assert layer_ops.isa() == "portable"
    paths = path_record.compute_paths()
    assert paths["bf16_compute"].startswith("fp32") and paths["hidden"] == "amx,avx512,avx512_bf16"
    assert path_record.parse_paths_line(path_record.paths_line(paths)) == paths


def test_hidden_avx512_bf16_keeps_avx512_for_fp32_only(hidden):
    from xllm_vmm.engine.attention import native_decode as nd

    c = hidden("avx512_bf16")
    if nd.load() is None or not c.avx512:
        pytest.skip("no native attention library or no AVX-512 here")
    assert nd.implementation(torch.bfloat16, torch.bfloat16, 64) == "portable"
    assert nd.implementation(torch.float32, torch.float32, 64) == "avx512-f32"
    assert c.onednn_bf16  # torch's oneDNN bfloat16 needs AVX-512 BW/VL/DQ, not AVX512_BF16


def test_hidden_amx_keeps_the_avx512_scores(hidden):
    from xllm_vmm.engine.attention import native_decode as nd

    hidden("amx")
    if nd.load() is None:
        pytest.skip("the native attention library is not built")
    assert nd.implementation(torch.bfloat16, torch.bfloat16, 64) != "amx-bf16"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_product_in_fp32_is_the_fp32_product_of_the_upcast_operands(dtype):
    from xllm_vmm.engine.layers.linear import dense

    force = cpu_caps.set_bf16_as_fp32 if dtype is torch.bfloat16 else cpu_caps.set_fp16_as_fp32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g).to(dtype)
    w = (torch.randn(96, 64, generator=g) / 8).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    old = force(True)
    try:
        y = dense(x, w, b)
        force(False)
        native = dense(x, w, b)
    finally:
        force(old)
    assert y.dtype is dtype
    assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).to(dtype))
    assert torch.equal(native, F.linear(x, w, b))
    torch.testing.assert_close(y, native, atol=0.05, rtol=0.02)
    assert torch.equal(dense(x.float(), w.float()), F.linear(x.float(), w.float()))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = llama_checkpoint(tmp_path_factory.mktemp("llama"))
    return d, load_hf_model(d)


@pytest.mark.parametrize("prefill", ["auto", "portable"])
def test_fp32_engine_matches_transformers_on_the_portable_paths(llama, hidden, monkeypatch,
                                                                prefill):
    """AVX-512 hidden: the native decode kernel and layer ops run their portable C (prefill:
    SDPA under ``auto``, the kernel's portable C under ``portable``); greedy tokens equal
    transformers' token for token."""
    d, hf = llama
    hidden("avx512")
    monkeypatch.setenv("XLLM_VMM_NATIVE_PREFILL", prefill)
    prompts = [_prompt(n, n) for n in (1, BS + 1, 3 * BS + 5)]
    with LLM(str(d), block_size=BS, device_memory="96MiB", max_tokens_per_batch=512) as llm:
        paths = llm.llm_engine.compute_paths()
        assert paths["hidden"] == "amx,avx512,avx512_bf16"
        if paths["attention_decode"] != "torch":
            assert paths["attention_decode"] == "portable"
        outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 6), f"prompt of {len(p)} tokens"


def test_a_bf16_checkpoint_serves_without_onednn_bf16(tmp_path, hidden):
    """No oneDNN bfloat16 (AVX-512 hidden): nothing is packed (the reason is stated), the
    products run in float32 over the bfloat16 weights, and the engine generates."""
    d = build_checkpoint(tmp_path / "bf16", "llama", dtype="bfloat16")
    hidden("avx512")
    with LLM(str(d), block_size=BS, device_memory="96MiB", max_tokens_per_batch=512) as llm:
        paths = llm.llm_engine.compute_paths()
        assert paths["packed_linear"].startswith("off (oneDNN bfloat16 linear unavailable")
        assert paths["bf16_compute"].startswith("fp32")
        model = llm.llm_engine.worker.model
        assert model.dtype is torch.bfloat16
        assert model.layers[0].mlp.down.weight.dtype is torch.bfloat16  # held as bfloat16
        warm = llm.llm_engine.warm_up(1.0)
        assert "run in float32" in warm.reason
        outs = llm.generate([_prompt(9), _prompt(BS + 3, 1)], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_generate_runs_16_bit_dtypes_as_on_an_avx2_only_cpu(llama, dtype):
    """``xllm-vmm generate`` in a fresh process with torch's kernels capped to AVX2 and AVX-512
    hidden: it runs without any other switch and states the paths it took (float32 there:
    :func:`test_fp32_engine_matches_transformers_on_the_portable_paths`)."""
    import os
    import subprocess
    import sys

    d = llama[0]
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", **{cpu_caps.HIDE_ENV: "avx512"})
    env.pop(cpu_caps.BF16_ENV, None)
    p = subprocess.run([sys.executable, "-m", "xllm_vmm.cli", "generate", "--model", str(d),
                        "--dtype", dtype, "--max-tokens", "4", "hello"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    line = next(x for x in p.stderr.splitlines() if "compute paths: " in x)
    paths = path_record.parse_paths_line(line)
    assert paths["torch_capability"] == "AVX2" and paths["layer_ops"] in ("portable", "off")
    assert paths["packed_linear"].startswith("off (")
    assert paths["bf16_compute"].startswith("fp32") and paths["fp16_compute"].startswith("fp32")
