"""Host-driver specifics: no leaked mappings, file descriptors or shared memory; the mapping
cap; stats; the native library's error messages."""

from __future__ import annotations

import ctypes as C
import os

import pytest

from xllm_vmm.vmm import CopyKind, VmmInvalidArgument, VmmOutOfMemory, open_driver
from xllm_vmm.vmm.sysmem import host_memory, meminfo

MiB = 1024 * 1024


def _maps() -> list[str]:
    """The mappings a VMM driver can leave behind: its memfd's mappings and PROT_NONE
    reservations of 2 MiB or more. The rest of the address space moves on its own (Python's
    arenas and glibc's large allocations come and go with garbage collection), so comparing it
    would make the test flaky without checking anything about the driver."""
    import gc

    gc.collect()
    out = []
    with open("/proc/self/maps") as f:
        for line in f.read().splitlines():
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5] if len(fields) > 5 else ""
            if "memfd:xllm-vmm" in path or (fields[1] == "---p" and not path
                                               and hi - lo >= 2 * MiB):
                out.append(line)
    return out


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _cycle(kind: str) -> None:
    d = open_driver("host") if kind == "host" else open_driver("acl", library="emulation")
    g = d.granularity
    va = d.reserve(64 * g)
    hs = d.create_handles(32, g)
    # gapped maps split the reservation into many VMAs
    d.map_batch([va + 2 * i * g for i in range(32)], hs)
    buf = C.create_string_buffer(b"x" * 4096)
    d.copy_batch([va + 2 * i * g for i in range(32)], [C.addressof(buf)] * 32, [4096] * 32, CopyKind.H2D)
    assert sum("memfd:xllm-vmm-host" in m for m in _maps()) >= 32
    if kind == "host":
        st = os.fstat(d.memfd)
        assert st.st_blocks * 512 >= 32 * g  # committed eagerly by fallocate
        d.unmap_batch([va + 2 * i * g for i in range(32)])
        for h in hs:
            d.free_handle(h)
        assert os.fstat(d.memfd).st_blocks == 0  # every hole punched: no memory held
        d.release(va, 64 * g)
    d.close()


@pytest.mark.parametrize("kind", ["host", "acl-emu"])
def test_no_leaked_mappings_fds_or_memory_after_release(kind):
    _cycle(kind)  # warm up: libraries loaded, allocator arenas grown
    before_maps, before_fds = _maps(), _fds()
    _cycle(kind)
    assert _maps() == before_maps
    assert _fds() == before_fds


def test_shmem_grows_with_handles_and_returns_after_free():
    """Handles are shared memory the kernel accounts (Shmem), committed at creation and given
    back when freed. The driver's own share is exact (its memfd's allocated blocks); the
    system-wide Shmem figure is checked too, retried because other processes — the other test
    worker among them — move it while this runs."""
    d = open_driver("host")
    g = d.granularity
    try:
        for attempt in range(3):
            shmem0 = meminfo()["Shmem"]
            hs = d.create_handles(64, g)  # 128 MiB
            assert os.fstat(d.memfd).st_blocks * 512 == 64 * g
            grown = meminfo()["Shmem"] - shmem0
            for h in hs:
                d.free_handle(h)
            assert os.fstat(d.memfd).st_blocks == 0
            back = meminfo()["Shmem"] - shmem0
            if grown > 96 * MiB and back < 32 * MiB:
                break
        else:
            pytest.fail(f"Shmem grew by {grown} bytes for 128 MiB of handles and stayed "
                        f"{back} bytes above the start after freeing them (3 attempts)")
    finally:
        d.close()


def test_mapping_cap_fails_a_batch_mid_way_with_out_of_memory_and_rolls_back():
    from xllm_vmm.vmm.host import HostDriver

    d = HostDriver(max_mappings=3)
    g = d.granularity
    va = d.reserve(8 * g)
    hs = d.create_handles(5, g)
    d.map(va + 7 * g, hs[4])
    with pytest.raises(VmmOutOfMemory) as err:
        d.map_batch([va, va + g, va + 2 * g], hs[:3])  # the third exceeds the cap of 3
    assert "mapping limit of 3" in str(err.value) and "batch entry 2 of 3" in str(err.value)
    assert d.stats()["mappings"] == 1  # the two made by the failed call are gone
    d.map_batch([va, va + g], hs[:2])
    assert d.stats()["mapped_bytes"] == 3 * g
    d.close()


def test_stats_count_bytes_handles_and_mappings():
    d = open_driver("host", device_memory=32 * MiB)
    g = d.granularity
    va = d.reserve(4 * g)
    h2 = d.create_handle(2 * g)
    h1 = d.create_handle(g)
    d.map_batch([va, va + 2 * g, va + 3 * g], [h2, h1, h1])
    s = d.stats()
    assert (s["committed_bytes"], s["handles"], s["reserved_bytes"], s["mapped_bytes"], s["mappings"]) == (
        3 * g, 2, 4 * g, 4 * g, 3)
    assert d.mem_info().free == 32 * MiB - 3 * g
    d.close()
    with pytest.raises(VmmInvalidArgument):
        d.reserve(g)  # closed


def test_freed_handles_are_reused_and_never_zero():
    d = open_driver("host")
    g = d.granularity
    a, b = d.create_handle(g), d.create_handle(g)
    assert 0 not in (a, b)
    d.free_handle(a)
    assert d.create_handle(g) == a
    d.close()


def test_host_memory_is_positive_and_bounded():
    info = host_memory()
    assert 0 < info.free <= info.total


def test_host_buffers_are_tracked():
    d = open_driver("host")
    p = d.alloc_host(1 << 20)
    C.memset(p, 1, 1 << 20)
    d.free_host(p)
    with pytest.raises(VmmInvalidArgument):
        d.free_host(p)
    d.close()


def test_async_copies_complete_in_order_off_the_calling_thread():
    d = open_driver("host")
    g = d.granularity
    va = d.reserve(g)
    d.map(va, d.create_handle(g))
    src = C.create_string_buffer(b"a" * g, g)
    src2 = C.create_string_buffer(b"b" * g, g)
    t1 = d.copy_batch_async([va], [C.addressof(src)], [g], CopyKind.H2D)
    t2 = d.copy_batch_async([va], [C.addressof(src2)], [g], CopyKind.H2D)
    t2.wait(30)
    assert t1.done()
    out = C.create_string_buffer(4)
    d.copy(C.addressof(out), va + g - 4, 4, CopyKind.D2H)
    assert out.raw == b"bbbb"
    bad = d.copy_batch_async([va + g], [C.addressof(src)], [16], CopyKind.H2D)  # past the mapping
    with pytest.raises(Exception) as err:
        bad.wait(30)
    assert "not inside a reservation" in str(err.value)
    d.close()


def test_missing_native_library_is_a_clear_error(monkeypatch, tmp_path):
    import xllm_vmm.vmm.native as native

    monkeypatch.setenv("XLLM_VMM_NATIVE_DIR", str(tmp_path))
    with pytest.raises(Exception) as err:
        native.library_path(native.HOST_LIBRARY)
    assert "libxllm_hostvmm.so not found" in str(err.value) and "pip install" in str(err.value)


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _shmem_thp_never() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return "[never]" in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("populate", [True, False])
def test_populated_maps_take_no_page_faults_on_the_first_writes(populate):
    d = open_driver("host", populate=populate)
    try:
        assert d.populate is populate
        g = d.granularity
        va = d.reserve(4 * g)
        hs = d.create_handles(2, g)
        d.map_batch([va, va + g], hs)
        before = _minor_faults()
        C.memset(va, 0x3C, 2 * g)
        faults = _minor_faults() - before
        if populate:
            assert faults < 16  # 1024 pages of 4 KiB written, page tables filled at map time
        elif _shmem_thp_never():
            assert faults >= 1024 // 16  # at least one fault per 16 pages (fault-around)
        # same data through the handle after a populated re-map elsewhere
        d.unmap_batch([va, va + g])
        d.map_batch([va + 2 * g, va + 3 * g], hs)
        assert C.string_at(va + 3 * g + g - 4, 4) == b"\x3c" * 4
        d.unmap_batch([va + 2 * g, va + 3 * g])
        for h in hs:
            d.free_handle(h)
        d.release(va, 4 * g)
    finally:
        d.close()


def test_populate_can_be_switched_and_keeps_the_batch_rollback():
    d = open_driver("host")
    try:
        assert d.populate is False and "populate" not in repr(d)
        d.populate = True
        assert "populate=True" in repr(d)
        g = d.granularity
        va = d.reserve(2 * g)
        hs = d.create_handles(2, g)
        with pytest.raises(VmmInvalidArgument, match="already mapped"):
            d.map_batch([va, va], hs)
        assert not d.is_mapped(va, 1)  # the first entry was rolled back
        assert d.stats()["mappings"] == 0
        for h in hs:
            d.free_handle(h)
        d.release(va, 2 * g)
    finally:
        d.close()


def test_unmap_batch_with_a_bad_entry_unmaps_nothing_even_for_a_deferred_freed_handle():
    """The whole batch is checked before anything is unmapped: a deferred-freed handle stays
    mapped (and its memory committed) when a later entry is bad, and is released once a good
    batch unmaps it (the reviewer's reproduction of the old rollback bug)."""
    from xllm_vmm.vmm import VmmError

    d = open_driver("host", device_memory=16 * MiB)
    g = d.granularity
    va = d.reserve(4 * g)
    h = d.create_handle(g)
    d.map(va, h)
    C.memset(va, 0x42, 64)
    assert d._lib.hv_free_deferred(d._pool, h) == 0
    for bad in ([va, va + g], [va, va]):
        with pytest.raises(VmmError) as err:
            d.unmap_batch(bad)
        assert err.value.code == 2  # ENOENT
        assert "batch entry 1 of 2" in str(err.value) and "nothing was unmapped" in str(err.value)
        assert d.is_mapped(va, g) and C.string_at(va, 64) == b"\x42" * 64
        assert d.stats()["committed_bytes"] == g and d.stats()["mappings"] == 1
    d.unmap_batch([va])
    assert d.stats()["committed_bytes"] == 0 and d.stats()["handles"] == 0
    assert d.stats()["release_pending"] == 0 and not d.is_mapped(va, 1)
    d.release(va, 4 * g)
    d.close()


class _FakeHost:
    """A host of ``free`` bytes available besides what the driver holds (MemAvailable drops
    as the driver commits, as on a real host)."""

    def __init__(self, free: int, total: int = 1024 * MiB) -> None:
        self.free, self.total, self.driver = free, total, None

    def __call__(self):
        from xllm_vmm.vmm import MemInfo

        held = 0
        if self.driver is not None:
            held = self.driver.stats()["committed_bytes"] + self.driver._hb_bytes
        return MemInfo(free=self.free - held, total=self.total)


def _fake_host_driver(free: int, margin: int = 4 * MiB, **kw):
    from xllm_vmm.vmm.host import HostDriver

    host = _FakeHost(free)
    kw.setdefault("hugepages", "off")  # the fake host is RAM: no hugetlb pages from the real one
    d = HostDriver(host_margin=margin, host_memory_reader=host, **kw)
    host.driver = d
    return d, host


def test_without_device_memory_handles_are_bounded_by_host_memory_less_the_margin():
    d, host = _fake_host_driver(16 * MiB)
    g = d.granularity
    assert (d.mem_info().free, d.mem_info().total) == (12 * MiB, 1024 * MiB)
    hs = d.create_handles(6, g)  # 12 MiB: all the host can give above the 4 MiB margin
    assert d.mem_info().free == 0
    with pytest.raises(VmmOutOfMemory) as err:
        d.create_handle(g)
    msg = str(err.value)
    assert "out of host memory: 2097152 bytes" in msg and "0 bytes (0.00 GiB) can be committed" in msg
    assert "safety margin" in msg
    assert d.stats()["committed_bytes"] == 6 * g  # the refused handle took nothing
    with pytest.raises(VmmOutOfMemory):
        d.create_handles(2, g)
    host.free += 4 * MiB  # memory freed elsewhere becomes usable (re-read on demand)
    hs += d.create_handles(2, g)
    assert d.mem_info().free == 0
    for h in hs:
        d.free_handle(h)
    assert d.mem_info().free == 16 * MiB
    d.close()


def test_host_buffers_count_against_the_host_capacity():
    d, _ = _fake_host_driver(16 * MiB)
    with pytest.raises(VmmOutOfMemory, match="alloc_host failed .*out of host memory: 16777216"):
        d.alloc_host(16 * MiB)
    buf = d.alloc_host(8 * MiB)
    assert d.mem_info().free == 4 * MiB
    with pytest.raises(VmmOutOfMemory):
        d.create_handles(3, d.granularity)
    d.free_host(buf)
    assert d.mem_info().free == 12 * MiB
    d.close()


def test_device_memory_is_also_bounded_by_the_host():
    d, _ = _fake_host_driver(10 * MiB, device_memory=64 * MiB)
    assert (d.mem_info().free, d.mem_info().total) == (6 * MiB, 64 * MiB)  # the host gives less than the emulated device
    d.create_handles(3, d.granularity)
    with pytest.raises(VmmOutOfMemory, match="out of host memory"):
        d.create_handle(d.granularity)
    d.close()


def test_a_handle_larger_than_the_host_is_refused_before_anything_is_committed():
    d = open_driver("host")
    g = d.granularity
    huge = (host_memory().total // g + 1) * g
    with pytest.raises(VmmOutOfMemory, match="out of host memory"):
        d.create_handle(huge)
    with pytest.raises(VmmOutOfMemory, match="out of host memory"):
        d.alloc_host(huge)
    assert d.stats()["committed_bytes"] == 0
    assert 0 < d.mem_info().free <= host_memory().free - d.host_margin + 64 * MiB
    d.close()


class _SharedFakeHost:
    """One fake host under several drivers of this process: MemAvailable drops by what all of
    them hold (what the kernel would report)."""

    def __init__(self, free: int, total: int = 1024 * MiB) -> None:
        self.free, self.total, self.drivers = free, total, []

    def __call__(self):
        from xllm_vmm.vmm import MemInfo

        held = sum(d.stats()["committed_bytes"] + d._hb_bytes for d in self.drivers if not d._closed)
        return MemInfo(free=self.free - held, total=self.total)


def test_two_host_drivers_in_one_process_cannot_together_over_commit():
    """150 MiB host, margin 0: driver B opened before A commits 100 MiB; B's own reading (under
    a second old) still says 150 MiB, but the process-wide ledger counts A's commit."""
    from xllm_vmm.vmm.host import HostDriver

    host = _SharedFakeHost(150 * MiB)
    a = HostDriver(host_margin=0, host_memory_reader=host, hugepages="off")
    b = HostDriver(host_margin=0, host_memory_reader=host, hugepages="off")
    host.drivers += [a, b]
    ha = a.create_handle(100 * MiB)
    assert (a.mem_info().free, b.mem_info().free) == (50 * MiB, 50 * MiB)
    with pytest.raises(VmmOutOfMemory, match="out of host memory: 104857600 bytes .*52428800 bytes"):
        b.create_handle(100 * MiB)
    with pytest.raises(VmmOutOfMemory, match="out of host memory"):
        b.alloc_host(60 * MiB)
    assert b.stats()["committed_bytes"] == 0
    buf = b.alloc_host(50 * MiB)
    assert (a.mem_info().free, b.mem_info().free) == (0, 0)
    a.free_handle(ha)  # freed memory is usable by the other driver at once
    assert b.mem_info().free == 100 * MiB
    hb = b.create_handle(100 * MiB)
    assert a.mem_info().free == 0
    a.close()  # a closed driver leaves the ledger
    b.free_host(buf)
    assert b.mem_info().free == 50 * MiB
    b.free_handle(hb)
    b.close()


def test_concurrent_commits_of_two_drivers_never_exceed_the_host():
    import threading

    from xllm_vmm.vmm.host import HostDriver

    host = _SharedFakeHost(40 * MiB)
    drivers = [HostDriver(host_margin=0, host_memory_reader=host, hugepages="off") for _ in range(2)]
    host.drivers += drivers
    got = [[], []]

    def grab(i):
        for _ in range(20):
            try:
                got[i].append(drivers[i].create_handle(2 * MiB))
            except VmmOutOfMemory:
                pass

    threads = [threading.Thread(target=grab, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got[0]) + len(got[1]) == 20  # exactly 40 MiB, never more
    for d in drivers:
        d.close()
