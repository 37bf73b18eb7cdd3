"""The device backends behind the same code: gloo on CPU (every other test), NCCL on CUDA and
HCCL on NPU — run only where two such devices exist, skipped elsewhere."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.distributed.conftest import BASE
from xllm_vmm.engine.distributed.errors import DistributedError
from xllm_vmm.engine.distributed.group import backend_for

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


def test_backend_per_device():
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda:1") == "nccl"
    with pytest.raises(DistributedError, match="no collective backend"):
        backend_for("xpu:0")
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(DistributedError, match="torch_npu"):
            backend_for("npu:0")


def _tokens(model, **flags):
    from xllm_vmm import LLM, SamplingParams

    llm = LLM(model=str(model), **BASE, **flags)
    try:
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], SamplingParams(**GREEDY))
        return list(out[0].outputs[0].token_ids)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two NVIDIA GPUs")
def test_nccl_two_gpus_equal_one(llama_dir):
    assert _tokens(llama_dir, devices="cuda:0", nnodes=2) == _tokens(llama_dir, devices="cuda:0")


def _npus() -> int:
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    import torch_npu  # noqa: F401

    return torch.npu.device_count()


@pytest.mark.skipif(_npus() < 2, reason="needs two Ascend NPUs with torch_npu")
def test_hccl_two_npus_equal_one(llama_dir):
    assert _tokens(llama_dir, devices="npu:0", nnodes=2) == _tokens(llama_dir, devices="npu:0")
