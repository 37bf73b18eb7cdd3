"""Huge-page backing of the host driver: choosing it (auto / env / explicit, refusals naming the
setting), and each backing end to end — create, map (batched, contiguous, populated), write,
read, unmap, free with the memory really back — and the capacity ledger (hugetlb handles count
against the free huge pages, host buffers against host memory).

The hugetlb and thp tests set ``vm.nr_hugepages`` / ``shmem_enabled`` for their duration (root
only; skipped with the reason otherwise) under a file lock shared by every test process, and
restore the previous value; the fresh-machine default (both off) is tested as it is."""

from __future__ import annotations

import contextlib
import ctypes as C
import os
from pathlib import Path

import pytest

from xllm_vmm.vmm import MemInfo, VmmInvalidArgument, VmmOutOfMemory, open_driver
from xllm_vmm.vmm import hugepages as hp
from xllm_vmm.vmm.host import HostDriver
from xllm_vmm.vmm.sysmem import meminfo

MiB = 1024 * 1024
G = 2 * MiB


# ---- choosing the backing (no machine setting touched) --------------------------------------

@pytest.mark.parametrize("mode,need,huge_free,thp,expect", [
    ("off", G, 64 * G, True, "off"),
    ("auto", 8 * G, 8 * G, True, "hugetlb"),     # the free huge pages hold all it may take
    ("auto", 9 * G, 8 * G, True, "thp"),         # not enough: never a smaller driver
    ("auto", 9 * G, 8 * G, False, "off"),
    ("auto", 8 * G, 0, False, "off"),             # the fresh machine
    ("hugetlb", 100 * G, G, False, "hugetlb"),   # explicit: as many as there are
    ("thp", G, 0, True, "thp"),
    ("AUTO", G, G, False, "hugetlb"),
])
def test_resolve_picks_the_backing(mode, need, huge_free, thp, expect):
    got, why = hp.resolve(mode, need, hugetlb=MemInfo(free=huge_free, total=huge_free),
                          thp_allowed=thp)
    assert got == expect and why


@pytest.mark.parametrize("mode,msg", [
    ("hugetlb", "sysctl vm.nr_hugepages=N"),
    ("thp", "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled"),
    ("huge", "hugepages='huge' is not a huge-page backing; choose one of auto, hugetlb, thp, off"),
])
def test_resolve_refuses_what_the_machine_forbids_naming_the_setting(mode, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace(".", r"\.")):
        hp.resolve(mode, G, hugetlb=MemInfo(free=0, total=0), thp_allowed=False)


def test_sysfs_readers(tmp_path):
    d = tmp_path / "hugepages-2048kB"
    d.mkdir()
    for name, value in (("nr_hugepages", 10), ("free_hugepages", 7), ("resv_hugepages", 2)):
        (d / name).write_text(f"{value}\n")
    assert hp.hugetlb_memory(d) == MemInfo(free=5 * G, total=10 * G)
    assert hp.hugetlb_memory(tmp_path / "absent") == MemInfo(free=0, total=0)
    t = tmp_path / "thp"
    (t / "hugepages-2048kB").mkdir(parents=True)
    (t / "shmem_enabled").write_text("always within_size [advise] never deny force\n")
    (t / "hugepages-2048kB" / "shmem_enabled").write_text("always [inherit] within_size advise never\n")
    assert hp.thp_shmem_setting(t) == "advise" and hp.thp_shmem_allowed(t)
    (t / "hugepages-2048kB" / "shmem_enabled").write_text("always inherit within_size advise [never]\n")
    assert hp.thp_shmem_setting(t) == "never" and not hp.thp_shmem_allowed(t)
    (t / "hugepages-2048kB" / "shmem_enabled").unlink()
    (t / "shmem_enabled").write_text("always within_size advise [never] deny force\n")
    assert not hp.thp_shmem_allowed(t)
    (t / "shmem_enabled").write_text("always within_size advise never [deny] force\n")
    assert not hp.thp_shmem_allowed(t)
    assert hp.thp_shmem_setting(tmp_path / "none") == "never"


def test_env_chooses_the_backing_and_a_bad_value_names_it(monkeypatch):
    monkeypatch.setenv(hp.ENV, "off")
    d = HostDriver()
    assert d.hugepages == "off" and d.stats()["backing"] == 0
    d.close()
    monkeypatch.setenv(hp.ENV, "gigantic")
    with pytest.raises(VmmInvalidArgument, match=f"{hp.ENV}='gigantic' is not a huge-page backing"):
        HostDriver()
    d = HostDriver(hugepages="off")  # an explicit argument wins over the environment
    assert d.hugepages == "off"
    d.close()


def test_explicit_backing_the_machine_forbids_is_a_clear_error():
    with pytest.raises(VmmInvalidArgument, match="hugepages=hugetlb needs free 2 MiB huge pages"):
        HostDriver(hugepages="hugetlb", hugetlb_memory_reader=lambda: MemInfo(free=0, total=0))
    with pytest.raises(VmmInvalidArgument, match="needs a granularity that is a multiple of 2 MiB"):
        HostDriver(hugepages="hugetlb", granularity=1 * MiB,
                   hugetlb_memory_reader=lambda: MemInfo(free=G, total=G))


def test_fresh_machine_default_is_4k_pages(monkeypatch):
    """auto on a machine with no huge pages (none free, shmem THP never): 4 KiB pages — the
    machine's own settings are replaced by those of a fresh one."""
    monkeypatch.delenv(hp.ENV, raising=False)
    monkeypatch.setattr(hp, "thp_shmem_allowed", lambda directory=hp.THP_DIR: False)
    d = HostDriver(device_memory=8 * G, hugetlb_memory_reader=lambda: MemInfo(free=0, total=0))
    assert (d.hugepages, d.stats()["backing"]) == ("off", 0)
    assert "auto: 4 KiB pages" in d.hugepages_reason
    _round_trip(d, 4)
    d.close()


# ---- machine settings, for the duration of a test -------------------------------------------

@pytest.fixture
def huge_pages():
    """``huge_pages(n)``: a context with ``n`` more free 2 MiB hugetlb pages than the machine
    had (skipped with the reason where that cannot be set)."""
    @contextlib.contextmanager
    def run(extra: int = 8):
        try:
            with hp.extra_hugetlb_pages(extra) as free:
                if free < extra:
                    pytest.skip(f"the kernel could not provide {extra} free 2 MiB huge pages")
                yield
        except hp.SettingUnavailable as exc:
            pytest.skip(str(exc))
    return run


@pytest.fixture
def shmem_thp():
    """``shmem_thp()``: a context with shmem_enabled=advise (skipped where it cannot be set)."""
    @contextlib.contextmanager
    def run():
        try:
            with hp.shmem_thp_advise():
                yield
        except hp.SettingUnavailable as exc:
            pytest.skip(str(exc))
    return run


def _round_trip(d: HostDriver, n: int) -> None:
    """create → contiguous map_batch → write/read → unmap → scattered single maps → free: the
    data a handle holds survives remapping; nothing is left."""
    g = d.granularity
    hs = d.create_handles(n, g)
    va = d.reserve(2 * n * g)
    vas = [va + i * g for i in range(n)]
    d.map_batch(vas, hs)
    assert d.stats()["mappings"] == n
    for i in range(n):
        C.memset(va + i * g, 0x10 + i, g)
    d.unmap_batch(vas)
    svas = [va + 2 * i * g for i in range(n)]
    d.map_batch(svas, hs[::-1])  # scattered, reversed: one mmap each
    for i, h in enumerate(hs[::-1]):
        got = C.string_at(svas[i] + g - 64, 64)
        assert got == bytes([0x10 + hs.index(h)]) * 64
    d.unmap_batch(svas)
    d.map(va, hs[0])
    d.unmap(va)
    for h in hs:
        d.free_handle(h)
    d.release(va, 2 * n * g)
    st = d.stats()
    assert (st["committed_bytes"], st["mappings"], st["handles"]) == (0, 0, 0)


def _free_huge_pages() -> int:
    return hp.hugetlb_memory().free // G


def _smaps_rollup(field: str) -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _file_bytes(d: HostDriver) -> int:
    """Bytes the driver's memfd really holds (allocated blocks; hugetlbfs counts whole pages)."""
    return os.fstat(d.memfd).st_blocks * 512


def test_hugetlb_backing_end_to_end(huge_pages):
    with huge_pages(8):
        d = HostDriver(hugepages="hugetlb")
        assert (d.hugepages, d.stats()["backing"]) == ("hugetlb", 1)
        assert d.mem_info().free == hp.hugetlb_memory().free and d.mem_info().total >= 8 * G
        hs = d.create_handles(4, G)
        assert _file_bytes(d) == 4 * G  # committed at create
        va = d.reserve(4 * G)
        d.map_batch([va + i * G for i in range(4)], hs)
        C.memset(va, 0x44, 4 * G)
        assert _smaps_rollup("Shared_Hugetlb") + _smaps_rollup("Private_Hugetlb") >= 4 * G
        d.unmap_batch([va + i * G for i in range(4)])
        d.release(va, 4 * G)
        for h in hs:
            d.free_handle(h)
        assert _file_bytes(d) == 0  # a freed handle's huge pages are back at once
        _round_trip(d, 4)
        d.populate = True
        _round_trip(d, 4)
        assert _file_bytes(d) == 0
        d.close()


def test_hugetlb_handles_count_against_the_free_huge_pages_and_buffers_against_host_memory(
        huge_pages):
    with huge_pages(4):
        free = _free_huge_pages()
        d = HostDriver(hugepages="hugetlb", host_margin=0)
        hs = d.create_handles(free, G)
        assert d.mem_info().free == 0
        with pytest.raises(VmmOutOfMemory, match="out of huge pages: 2097152 bytes .*vm.nr_hugepages"):
            d.create_handle(G)
        assert d.stats()["handles"] == free  # the refused handle took nothing
        buf = d.alloc_host(4 * G)  # host buffers are ordinary memory: still allowed
        d.free_host(buf)
        for h in hs:
            d.free_handle(h)
        assert d.mem_info().free == free * G
        d.close()


def test_hugetlb_capacity_uses_the_hugetlb_reader_and_no_margin(huge_pages):
    with huge_pages(4):
        box: list[HostDriver] = []

        def pool():  # a 2-page hugetlb pool whose free pages drop as the driver commits
            held = box[0].stats()["committed_bytes"] if box and not box[0]._closed else 0
            return MemInfo(free=2 * G - held, total=2 * G)

        d = HostDriver(hugepages="hugetlb", host_margin=1 << 40,  # the host margin is for RAM
                       hugetlb_memory_reader=pool)
        box.append(d)
        assert d.mem_info() == MemInfo(free=2 * G, total=2 * G)
        a = d.create_handle(2 * G)
        with pytest.raises(VmmOutOfMemory, match="out of huge pages"):
            d.create_handle(G)
        with pytest.raises(VmmOutOfMemory, match="out of host memory"):
            d.alloc_host(G)  # a 1 TiB margin on host memory
        d.free_handle(a)
        d.close()


def test_auto_picks_hugetlb_when_the_free_huge_pages_hold_device_memory(huge_pages, monkeypatch):
    monkeypatch.delenv(hp.ENV, raising=False)
    with huge_pages(4):
        d = open_driver("host", device_memory=4 * G)
        assert d.hugepages == "hugetlb", d.hugepages_reason
        _round_trip(d, 2)
        d.close()
        d = open_driver("host", device_memory=(_free_huge_pages() + 1) * G)
        assert d.hugepages != "hugetlb", d.hugepages_reason
        d.close()


def test_thp_backing_end_to_end(shmem_thp):
    before = hp.thp_shmem_setting()
    with shmem_thp():
        assert hp.thp_shmem_allowed()
        d = HostDriver(hugepages="thp")
        assert (d.hugepages, d.stats()["backing"]) == ("thp", 2)
        huge0 = meminfo().get("ShmemHugePages", 0)
        hs = d.create_handles(4, G)
        assert _file_bytes(d) == 4 * G  # committed at create
        assert meminfo().get("ShmemHugePages", 0) - huge0 >= 2 * G  # as 2 MiB pages
        va = d.reserve(4 * G)
        d.map_batch([va + i * G for i in range(4)], hs)
        C.memset(va, 0x33, 4 * G)
        assert _smaps_rollup("ShmemPmdMapped") >= 2 * G  # mapped by the PMD: one entry per 2 MiB
        assert C.string_at(va + 4 * G - 8, 8) == b"\x33" * 8
        d.unmap_batch([va + i * G for i in range(4)])
        d.release(va, 4 * G)
        for h in hs:
            d.free_handle(h)
        assert d.stats()["committed_bytes"] == 0 and _file_bytes(d) == 0
        _round_trip(d, 3)
        d.populate = True
        _round_trip(d, 3)
        d.close()
    assert hp.thp_shmem_setting() == before  # restored


def test_thp_handles_read_zero_and_count_as_host_memory(shmem_thp):
    with shmem_thp():
        box: list[HostDriver] = []

        def host():  # 3 pages available, dropping as the driver commits (as MemAvailable does)
            held = box[0]._own_held() if box else 0
            return MemInfo(free=3 * G - held, total=64 * G)

        d = HostDriver(hugepages="thp", host_margin=0, host_memory_reader=host)
        box.append(d)
        h = d.create_handle(2 * G)
        with pytest.raises(VmmOutOfMemory, match="out of host memory"):
            d.alloc_host(2 * G)  # handles and buffers share host memory
        va = d.reserve(2 * G)
        d.map(va, h)
        assert C.string_at(va, 4096) == bytes(4096) and C.string_at(va + 2 * G - 16, 16) == bytes(16)
        d.unmap(va)
        d.release(va, 2 * G)
        d.free_handle(h)
        d.close()
