"""Start-up warm-up (``engine/warmup.py``): a bf16 engine on the CPU compiles its products for
every row bucket before serving, so steps of any size afterwards compile nothing; float32 and
a zero budget skip it and say why; a malformed budget is refused naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.engine import checkpoints as C
from xllm_vmm.engine import row_buckets as rb
from xllm_vmm.engine import warmup
from xllm_vmm.engine.layers import packed


def _llm(model_dir, dtype):
    from xllm_vmm import LLM

    return LLM(model=str(model_dir), device_memory="256MiB", max_model_len=128, block_size=16,
               dtype=dtype, max_tokens_per_batch=300)


@pytest.fixture
def bf16_compute():
    """``bf16_compute(True)``: bfloat16 products run in bfloat16 for the test (False: in
    float32, as where oneDNN has no bfloat16 kernels)."""
    from xllm_vmm.engine import cpu_caps

    old = cpu_caps.set_bf16_as_fp32(None)
    yield lambda native: cpu_caps.set_bf16_as_fp32(not native)
    cpu_caps.set_bf16_as_fp32(old)


def test_bf16_in_fp32_skips_with_the_reason(tmp_path, bf16_compute):
    bf16_compute(False)
    llm = _llm(C.llama_checkpoint(tmp_path / "m"), "bfloat16")
    try:
        rep = llm.llm_engine.warm_up(60.0)
    finally:
        llm.llm_engine.shutdown()
    assert rep.line() == ("warm-up: skipped (bfloat16 products run in float32 here: no "
                          "per-shape compilation)")


def test_bf16_engine_warms_every_bucket_of_its_budget(tmp_path, bf16_compute):
    bf16_compute(True)
    llm = _llm(C.llama_checkpoint(tmp_path / "m"), "bfloat16")
    try:
        rep = llm.llm_engine.warm_up(60.0)
    finally:
        llm.llm_engine.shutdown()
    want = len({rb.padded_rows(n) for n in range(1, 301)})
    assert rep.reason == "" and rep.complete
    assert (rep.products, rep.buckets, rep.max_rows) == (5, want, 320)  # qkv, o, gate_up, down, head
    assert "5 products x all" in rep.line() and "up to 320 rows" in rep.line()


def test_float32_and_zero_budget_skip_with_the_reason(tmp_path):
    llm = _llm(C.llama_checkpoint(tmp_path / "m"), "float32")
    try:
        assert llm.llm_engine.warm_up(60.0).line() == (
            "warm-up: skipped (float32: no per-shape compilation)")
        assert llm.llm_engine.warm_up(0).reason == f"{warmup.ENV}=0"
    finally:
        llm.llm_engine.shutdown()


def test_budget_from_env_names_the_variable():
    assert warmup.budget_from_env({}) == warmup.DEFAULT_BUDGET_S
    assert warmup.budget_from_env({warmup.ENV: "2.5"}) == 2.5
    assert warmup.budget_from_env({warmup.ENV: "0"}) == 0
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ValueError, match=warmup.ENV):
            warmup.budget_from_env({warmup.ENV: bad})


_AFTER = textwrap.dedent("""
    import sys
    from xllm_vmm import LLM
    from xllm_vmm.engine.sampling_params import SamplingParams
    llm = LLM(model=sys.argv[1], device_memory="256MiB", max_model_len=256, block_size=16,
              dtype="bfloat16", max_tokens_per_batch=400)
    if sys.argv[2] == "warm":
        print(llm.llm_engine.warm_up(120.0).line(), flush=True)
    print("=== requests", flush=True)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 37, 90, 161, 23, 250))]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                                         detokenize=False))
    llm.llm_engine.shutdown()
""")


@pytest.mark.skipif(not packed.enabled(),
                    reason=f"packed linear off here: {packed.disabled_reason()}")
def test_after_the_warm_up_requests_compile_no_product(tmp_path):
    """What the warm-up is for: prompts of several lengths batched with decodes (step sizes the
    warm-up never saw as such) compile no oneDNN product once it ran; without it they do."""
    d = C.llama_checkpoint(tmp_path / "m")

    def compiled_during_requests(mode: str) -> int:
        env = dict(os.environ, ONEDNN_VERBOSE="profile_create")
        r = subprocess.run([sys.executable, "-c", _AFTER, str(d), mode], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        after = r.stdout.split("=== requests", 1)[1]
        return sum(1 for line in after.splitlines()
                   if "create:cache_miss" in line and (",inner_product," in line
                                                       or ",matmul," in line))

    assert compiled_during_requests("cold") > 10
    assert compiled_during_requests("warm") == 0
