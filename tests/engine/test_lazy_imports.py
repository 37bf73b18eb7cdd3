"""`import xllm_vmm` stays torch-free: LLM and SamplingParams resolve lazily, and
SamplingParams (which the server front builds for every request) never needs torch."""

import subprocess
import sys


def test_lazy_exports_do_not_import_torch():
    code = ("import sys, xllm_vmm\n"
            "from xllm_vmm import LLM, SamplingParams\n"
            "from xllm_vmm.engine import OutputProcessor, RequestOutput, EngineOutput\n"
            "SamplingParams(temperature=0, stop=['x'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert LLM.__name__ == 'LLM'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
