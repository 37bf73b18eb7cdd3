"""Drivers for the pool and cache tests: the simulated driver always; the host (memfd/mmap)
driver and the ACL emulation when the device layer provides them (skipped otherwise)."""

from __future__ import annotations

import pytest

from xllm_vmm.vmm.sim import SimDriver

DRIVER_KINDS = ["sim", "host", "acl-emulation"]


def make_driver(kind: str, device_memory: int):
    """A driver of ``kind`` emulating ``device_memory`` bytes; skips the test when the device
    layer does not provide that driver here."""
    if kind == "sim":
        return SimDriver(device_memory)
    try:
        from xllm_vmm.vmm import VmmUnavailable, open_driver
    except ImportError as e:  # pragma: no cover - device layer not there yet
        pytest.skip(f"device layer has no open_driver yet: {e}")
    try:
        if kind == "host":
            return open_driver("host", device_memory=device_memory)
        return open_driver("acl", library="emulation", device_memory=device_memory)
    except (VmmUnavailable, ImportError, ModuleNotFoundError) as e:
        pytest.skip(f"{kind} driver unavailable here: {e}")


@pytest.fixture(params=DRIVER_KINDS)
def driver_factory(request):
    """``factory(device_memory) -> driver`` for every driver kind; closes what it opened."""
    opened = []

    def factory(device_memory: int = 64 << 20):
        d = make_driver(request.param, device_memory)
        opened.append(d)
        return d

    factory.kind = request.param
    yield factory
    for d in opened:
        d.close()
