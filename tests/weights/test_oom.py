"""Wakeup is all or nothing: an out-of-memory injected at every page index of a wakeup (and a
failing restore copy) leaves the instance asleep with no page, handle or host buffer leaked,
and a later wakeup restores every byte; a real shortage names the missing bytes exactly."""

from __future__ import annotations

import errno

import pytest

torch = pytest.importorskip("torch")

from tests.weights.conftest import (PAGE, checksums, make_pool, open_test_driver,  # noqa: E402
                                    save_checkpoint)
from xllm_vmm.vmm.driver import CopyKind, VmmError, VmmOutOfMemory  # noqa: E402
from xllm_vmm.weights import (DEEP_SLEEP, LIGHT_SLEEP, WakeupFailed,  # noqa: E402
                              WakeupOutOfMemory, WeightsNotLoaded, load_weights)


class FaultyDriver:
    """Delegates to a real driver; ``fail_create_at = k`` makes the k-th next create_handle
    (0-based) raise out-of-memory, ``fail_h2d`` makes the next host-to-device copy fail."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.fail_create_at: int | None = None
        self.fail_h2d = False
        self.creates = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def create_handle(self, size: int) -> int:
        if self.fail_create_at is not None:
            k, self.creates = self.creates, self.creates + 1
            if k == self.fail_create_at:
                self.fail_create_at = None
                raise VmmOutOfMemory("create_handle", errno.ENOMEM, "", "injected")
        return self._inner.create_handle(size)

    def copy_batch(self, dsts, srcs, sizes, kind):
        if self.fail_h2d and CopyKind(kind) is CopyKind.H2D:
            self.fail_h2d = False
            raise VmmError("copy_batch", errno.EIO, "", "injected copy failure")
        return self._inner.copy_batch(dsts, srcs, sizes, kind)

    def copy_batch_async(self, dsts, srcs, sizes, kind):
        if self.fail_h2d and CopyKind(kind) is CopyKind.H2D:
            self.fail_h2d = False
            return _FailedTransfer()  # the error comes out of wait(), as from a device
        return self._inner.copy_batch_async(dsts, srcs, sizes, kind)


class _FailedTransfer:
    def done(self) -> bool:
        return True

    def wait(self, timeout=None) -> None:
        raise VmmError("copy_batch_async", errno.EIO, "", "injected copy failure")


def _leak_free(inner, pool, host_buffers: int) -> None:
    stats = inner.stats() if hasattr(inner, "stats") else None
    assert pool.held_bytes == 0 and pool.stats().mapped_bytes == 0
    if stats is not None:
        assert stats["handles"] == 0 and stats["mappings"] == 0
    if hasattr(inner, "_host_buffers"):
        assert len(inner._host_buffers) == host_buffers


@pytest.mark.parametrize("batch_pages", [None, 1])
@pytest.mark.parametrize("level", [1, 2])
def test_injected_oom_at_every_page_index(tmp_path, backing_kind, level, batch_pages,
                                          monkeypatch):
    """On the ACL emulation and the host driver on every huge-page backing; a wakeup from
    the host copy maps in batches with the copies overlapping (``batch_pages=1``: one page
    per batch, so a failure at page k comes after k batches mapped and copying)."""
    if batch_pages is not None:
        monkeypatch.setattr("xllm_vmm.weights.store.WAKE_BATCH_BYTES", batch_pages * PAGE)
    model = save_checkpoint(tmp_path / "m", {"a": torch.randn(PAGE // 4 * 3),  # 6 MiB f32
                                             "b": torch.randn(1000)})
    inner = open_test_driver(backing_kind, 256 << 20)
    d = FaultyDriver(inner)
    pool = make_pool(d, 32 << 20)
    w = load_weights(model, pool=pool)
    want = checksums(w)
    pages = w.device_bytes // PAGE
    assert pages == 4
    state = LIGHT_SLEEP if level == 1 else DEEP_SLEEP
    w.sleep(level)
    buffers = 1 if level == 1 else 0  # the host copy
    for k in range(pages):
        d.fail_create_at, d.creates = k, 0
        with pytest.raises(WakeupOutOfMemory, match="bytes missing") as e:
            w.wake_up()
        assert e.value.missing_bytes >= PAGE and e.value.state == state
        assert w.state == state
        with pytest.raises(WeightsNotLoaded):
            w.check_loaded()
        _leak_free(inner, pool, buffers)
    d.fail_h2d = True  # the pages map, the restore copy fails: unmapped again
    with pytest.raises(WakeupFailed, match="injected copy failure"):
        w.wake_up()
    assert w.state == state
    _leak_free(inner, pool, buffers)
    assert w.wake_up().bytes_mapped == w.device_bytes
    assert checksums(w) == want
    w.close()
    w = None
    pool.close()
    inner.close()


def test_real_shortage_names_the_missing_bytes(tmp_path, driver_kind):
    """Device of 8 pages: weights of 4 pages sleep, another tenant takes 6 pages; the wakeup
    misses exactly 2 pages, maps nothing, and succeeds once the tenant gives 2 pages back."""
    model = save_checkpoint(tmp_path / "m", {"a": torch.randn(PAGE // 4 * 3),
                                             "b": torch.randn(1000)})
    d = open_test_driver(driver_kind, 8 * PAGE)
    pool = make_pool(d, 16 * PAGE)
    w = load_weights(model, pool=pool)
    want = checksums(w)
    w.sleep(1)
    kv = pool.add_tenant("kv", 6 * PAGE)
    assert pool.map_pages(kv, list(range(6)))
    with pytest.raises(WakeupOutOfMemory) as e:
        w.wake_up()
    assert e.value.needed_bytes == 4 * PAGE
    assert e.value.missing_bytes == 2 * PAGE, str(e.value)
    assert "8388608 bytes (4 pages)" in str(e.value) and "4194304 bytes missing" in str(e.value)
    assert pool.held_bytes == 6 * PAGE and w.state == LIGHT_SLEEP
    pool.unmap_pages(kv, [4, 5])
    w.wake_up()
    assert checksums(w) == want
    w.close()
    w = None
    pool.close()
    d.close()


def test_failed_load_copy_leaves_nothing(tmp_path, driver_kind):
    model = save_checkpoint(tmp_path / "m", {"a": torch.randn(PAGE // 4 * 3)})
    inner = open_test_driver(driver_kind, 256 << 20)
    d = FaultyDriver(inner)
    pool = make_pool(d, 32 << 20)
    for keep in (True, False):
        d.fail_h2d = True
        with pytest.raises(VmmError, match="injected copy failure"):
            load_weights(model, pool=pool, keep_host_copy=keep)
        assert not pool.has_tenant("weights")
        _leak_free(inner, pool, 0)
    w = load_weights(model, pool=pool)  # and a load without the fault succeeds
    assert w.state == "WAKEUP" and pool.held_bytes == w.device_bytes
    w.close()
    w = None
    pool.close()
    inner.close()
