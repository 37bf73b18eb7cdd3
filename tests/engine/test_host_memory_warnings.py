"""A device emulated in host memory, or a pool quota, larger than the host's memory is accepted
(the pool maps lazily) but warned about at start-up with the host's figure and what was given."""

from __future__ import annotations

import pytest

from tests.engine.checkpoints import llama_checkpoint
from xllm_vmm.vmm import sysmem

GiB = 2 ** 30


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return llama_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture
def small_host(monkeypatch):
    monkeypatch.setattr(sysmem, "host_memory", lambda: sysmem.MemInfo(free=1 * GiB, total=2 * GiB))


def _warnings(model, **kw):
    from xllm_vmm.engine import LLMEngine

    eng = LLMEngine.from_flags(str(model), enable_vmm_kvcache=True, vmm_elastic=True,
                               max_model_len=64, **kw)
    try:
        return [f for f in eng.warnings if f.id == "HOST-MEM"]
    finally:
        eng.shutdown()


def test_device_memory_past_the_host_is_warned(model, small_host):
    (w,) = _warnings(model, device_memory="4GiB")
    assert "device_memory=4.0 GiB" in w.message and "this host has 2.0 GiB" in w.message
    assert "--device-memory at most 2.0 GiB" in w.hint


def test_max_cache_size_past_the_host_is_warned(model, small_host):
    (w,) = _warnings(model, device_memory="256MiB", max_cache_size=10 ** 14)
    assert "max_cache_size=100000000000000 bytes" in w.message and "2.0 GiB" in w.message


def test_sizes_within_the_host_are_not_warned(model, small_host):
    assert _warnings(model, device_memory="256MiB") == []
