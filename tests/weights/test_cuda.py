"""The same load / sleep / wakeup / fork on CUDA through the driver interface (CUDA VMM);
skipped without a GPU and a CUDA build of torch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.weights.conftest import file_bytes, random_tensors, save_checkpoint  # noqa: E402


@pytest.fixture
def cuda_pool():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (or a CPU build of torch)")
    from tests.weights.conftest import make_pool
    from xllm_vmm.vmm import VmmUnavailable, open_driver

    try:
        d = open_driver("cuda")
    except VmmUnavailable as e:
        pytest.skip(f"CUDA VMM driver unavailable: {e}")
    pool = make_pool(d, 64 << 20)
    yield d, pool
    import gc

    gc.collect()
    pool.close()
    d.close()


def test_cuda_load_sleep_wake_fork_are_exact(tmp_path, cuda_pool):
    from xllm_vmm.weights import load_weights

    d, pool = cuda_pool
    model = save_checkpoint(tmp_path / "m", random_tensors("bfloat16", hidden=128), shards=2)
    raw = file_bytes(model)
    w = load_weights(model, pool=pool)

    def exact(x):
        for name, b in raw.items():
            t = x[name]
            assert t.is_cuda
            assert t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() == b, name

    exact(w)
    free = d.mem_info().free
    assert w.sleep(1).bytes_freed == w.device_bytes
    assert d.mem_info().free >= free + w.device_bytes - (2 << 20)
    w.wake_up()
    exact(w)
    w.sleep(2)
    w.wake_up()
    exact(w)
    child = w.fork()
    w.sleep(1)
    exact(child)
    child.close()
    w.close()


def test_cuda_sleep_and_wakeup_take_the_shared_path(tmp_path, cuda_pool):
    """The phases of the host and ACL paths (one store, one pool call each way): the pages are
    unmapped and released, then committed, mapped and copied; the device's free memory comes
    back over cycles (nothing leaked per cycle)."""
    from xllm_vmm.weights import load_weights

    d, pool = cuda_pool
    model = save_checkpoint(tmp_path / "m", random_tensors("float32", hidden=256), shards=2)
    w = load_weights(model, pool=pool)
    light = w.sleep(1)
    assert {"unmap", "release"} <= set(light.phases)
    wake = w.wake_up()
    assert wake.source == "host_copy" and {"commit", "map", "copy"} <= set(wake.phases)
    free = d.mem_info().free
    for i in range(6):
        w.sleep(1 + i % 2)
        w.wake_up()
    assert d.mem_info().free >= free - (2 << 20)  # the CUDA allocator may round by a page
    w.close()
