"""Tensor views over the arena alias the mapped memory and never outlive their reservation."""

from __future__ import annotations

import ctypes as C
import gc

import pytest

torch = pytest.importorskip("torch")

from xllm_vmm.vmm import CopyKind, VmmBusy, VmmInvalidArgument  # noqa: E402
from xllm_vmm.vmm.tensor import view  # noqa: E402


def test_view_aliases_mapped_memory_and_blocks_release_until_dropped(driver):
    if driver.device_kind not in ("cpu", "cuda") and not getattr(driver, "emulated", False):
        pytest.skip("tensor views are tracked on host and CUDA memory only")
    g = driver.granularity
    va = driver.reserve(2 * g)
    hs = driver.create_handles(2, g)
    driver.map_batch([va, va + g], hs)
    t = view(driver, va, 2 * g, torch.float16, (2, g // 2))
    t[1, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float16)
    buf = (C.c_uint16 * 4)()
    driver.copy(C.addressof(buf), va + g, 8, CopyKind.D2H)
    assert list(buf) == [0x3C00, 0x4000, 0x4200, 0x4400]  # 1.0, 2.0, 3.0, 4.0 in IEEE half
    driver.unmap_batch([va, va + g])  # pages may go while the view lives...
    with pytest.raises(VmmBusy) as err:
        driver.release(va, 2 * g)  # ...the reservation may not
    assert "still alive" in str(err.value)
    row = t[1]  # a derived tensor keeps the owner alive too
    del t
    gc.collect()
    with pytest.raises(VmmBusy):
        driver.release(va, 2 * g)
    del row
    gc.collect()
    driver.release(va, 2 * g)
    for h in hs:
        driver.free_handle(h)


def test_view_shape_must_match_bytes(driver):
    g = driver.granularity
    va = driver.reserve(g)
    with pytest.raises(VmmInvalidArgument) as err:
        view(driver, va, g, torch.float32, (3, 7))
    assert "shape (3, 7)" in str(err.value)
    with pytest.raises(VmmInvalidArgument):
        view(driver, va, 6, torch.float32)
    driver.release(va, g)
