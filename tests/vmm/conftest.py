"""Fixtures for the device-layer tests: one parametrised ``driver_factory`` that opens every
driver available here (host; ACL over the bundled emulation; CUDA when a GPU is present)."""

from __future__ import annotations

import os

import pytest

from xllm_vmm.vmm import VmmUnavailable, open_driver

MiB = 1024 * 1024


def _open(kind: str, **kw):
    if kind == "host":
        return open_driver("host", **kw)
    if kind == "acl-emu":
        return open_driver("acl", library="emulation", **kw)
    if kind == "cuda":
        return open_driver("cuda", **kw)
    raise AssertionError(kind)


def _available(kind: str) -> str | None:
    """None when the driver can be opened here, else the reason it cannot."""
    if kind == "cuda" and os.environ.get("XLLM_VMM_TEST_CUDA", "1") == "0":
        return "CUDA tests disabled by XLLM_VMM_TEST_CUDA=0"
    try:
        d = _open(kind)
    except VmmUnavailable as exc:
        return str(exc)
    d.close()
    return None


DRIVER_KINDS = ["host", "acl-emu", "cuda"]


@pytest.fixture(params=DRIVER_KINDS)
def driver_factory(request):
    """Returns ``open(**kwargs)`` for one driver kind; closes every driver it opened."""
    kind = request.param
    reason = _available(kind)
    if reason:
        pytest.skip(f"{kind} driver unavailable: {reason}")
    opened = []

    def factory(**kw):
        d = _open(kind, **kw)
        opened.append(d)
        return d

    factory.kind = kind
    yield factory
    for d in opened:
        d.close()


@pytest.fixture
def driver(driver_factory):
    return driver_factory()
