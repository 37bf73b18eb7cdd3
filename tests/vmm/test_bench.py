"""Smoke tests of ``bench map`` and ``bench copy``: tiny sizes, field presence and sanity,
never speed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from xllm_vmm.cli.app import app


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_bench_map_json_fields(device, monkeypatch):
    monkeypatch.setenv("XLLM_VMM_ACL_LIBRARY", "emulation")
    r = CliRunner().invoke(app, ["bench", "map", "--device", device, "--pages", "4", "--rounds", "2",
                                 "--repeats", "1", "--release-pages", "2", "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["pages"] == 4 and out["page_bytes"] == 2 * 1024 * 1024
    if device == "cpu":  # unmap + release per GiB on each huge-page backing the machine allows
        assert out["backing"] in ("off", "thp", "hugetlb") and out["release_pages"] == 2
        assert out["release_ms_per_gib_off"] > 0 and out["release_ms_per_gib_off_median"] > 0
        for b in ("thp", "hugetlb"):
            assert (isinstance(out[f"release_ms_per_gib_{b}"], float)
                    or out[f"release_skipped_{b}"]), b
    else:
        assert "release_ms_per_gib_off" not in out and "backing" not in out
    for key in ("batched_vs_raw_ratio", "python_overhead_us_per_page", "batched_us_per_page",
                "raw_us_per_page", "per_call_us_per_page"):
        assert isinstance(out[key], float), key
    assert out["batched_us_per_page"] > 0 and out["raw_us_per_page"] > 0
    assert out["batched_vs_raw_ratio"] == pytest.approx(out["batched_us_per_page"] / out["raw_us_per_page"])
    populated = ("populated_batched_us_per_page", "populated_raw_us_per_page",
                 "populated_batched_vs_raw_ratio", "map_write_us_per_page",
                 "populated_map_write_us_per_page", "fresh_map_write_us_per_page",
                 "populated_fresh_map_write_us_per_page", "populate_map_write_speedup",
                 "populate_fresh_map_write_speedup")
    if device == "cpu":  # populated maps on both sides (MAP_POPULATE in the raw loop too)
        for key in populated:
            assert isinstance(out[key], float) and out[key] > 0, key
        assert out["populated_batched_vs_raw_ratio"] == pytest.approx(
            out["populated_batched_us_per_page"] / out["populated_raw_us_per_page"])
        assert out["populate_map_write_speedup"] == pytest.approx(
            out["map_write_us_per_page"] / out["populated_map_write_us_per_page"])
        # contiguous pages: the driver maps each run with one mmap; the limit is one call per run
        for key in ("contiguous_batched_us_per_page", "coalesced_raw_us_per_page",
                    "batched_vs_coalesced_ratio", "batched_vs_coalesced_ratio_median",
                    "coalescing_speedup", "batched_vs_raw_ratio_median"):
            assert isinstance(out[key], float) and out[key] > 0, key
        assert out["batched_vs_coalesced_ratio"] == pytest.approx(
            out["contiguous_batched_us_per_page"] / out["coalesced_raw_us_per_page"])
    else:  # device memory has no page faults to populate
        assert out["populated_batched_us_per_page"] is None and "map_write_us_per_page" not in out
        assert out["coalesced_raw_us_per_page"] is None  # no coalesced baseline off the host
        assert out["contiguous_batched_us_per_page"] > 0


def test_scattered_order_has_no_contiguous_neighbours():
    from xllm_vmm.bench.map import scattered_order

    for n in (1, 2, 3, 64, 65):
        order = scattered_order(n)
        assert sorted(order) == list(range(n))
        assert all(b != a + 1 for a, b in zip(order, order[1:])) or n == 2  # never a run


def test_host_driver_coalesced_batch_keeps_per_handle_semantics():
    """A batch contiguous in address and memfd offset is mapped in one call per run, but each
    handle stays its own mapping: data, single unmaps and the all-or-nothing refusal."""
    import ctypes

    from xllm_vmm.vmm import VmmAlreadyMapped, open_driver

    d = open_driver("host", device_memory=64 << 20)
    try:
        g = d.granularity
        va = d.reserve(8 * g)
        hs = d.create_handles(4, g)
        vas = [va + i * g for i in range(4)]
        d.map_batch(vas, hs)
        for i, v in enumerate(vas):
            ctypes.memset(v, 0x20 + i, g)
        assert d.stats()["mappings"] == 4
        d.unmap(vas[2])
        assert not d.is_mapped(vas[2], 1) and d.is_mapped(vas[3], g)
        d.map(vas[2], hs[2])
        assert ctypes.string_at(vas[2], 1) == b"\x22"
        with pytest.raises(VmmAlreadyMapped):
            d.map_batch([va + 4 * g, va + 5 * g, va + 2 * g], hs[:3])  # the third is mapped
        assert not d.is_mapped(va + 4 * g, 1) and not d.is_mapped(va + 5 * g, 1)
        d.unmap_batch(vas)
        assert d.stats()["mappings"] == 0
        for h in hs:
            d.free_handle(h)
        d.release(va, 8 * g)
    finally:
        d.close()


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_bench_copy_json_fields_and_data(device, monkeypatch):
    monkeypatch.setenv("XLLM_VMM_ACL_LIBRARY", "emulation")
    r = CliRunner().invoke(app, ["bench", "copy", "--device", device, "--blocks", "5", "--repeats", "1",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    # sizes cycle 64K, 128K, 256K, 512K, 1M
    assert out["total_bytes"] == (64 + 128 + 256 + 512 + 1024) * 1024
    assert out["copy_vs_memcpy_ratio"] > 0 and out["data_verified"] is True


def test_bench_rejects_bad_device_and_block_sizes():
    r = CliRunner().invoke(app, ["bench", "map", "--device", "tpu"])
    assert r.exit_code == 2 and "--device 'tpu'" in r.output
    r = CliRunner().invoke(app, ["bench", "copy", "--max-block", str(4 << 20)])
    assert r.exit_code == 2 and "--max-block" in r.output


@pytest.mark.parametrize("args,msg", [
    (["map", "--pages", "0"], "--pages must be an integer in [1, 1073741824], got 0"),
    (["map", "--rounds", "0"], "--rounds must be an integer in [1, 100000], got 0"),
    (["map", "--repeats", "101"], "--repeats must be an integer in [1, 100], got 101"),
    (["copy", "--blocks", "0"], "--blocks must be an integer in [1, 1073741824], got 0"),
    (["copy", "--repeats", "0"], "--repeats must be an integer in [1, 100], got 0"),
])
def test_bench_map_and_copy_option_ranges(args, msg):
    r = CliRunner().invoke(app, ["bench"] + args)
    assert r.exit_code == 2, r.output
    assert r.output.strip() == f"error: {msg}"


def _tiny_host(monkeypatch, free: int) -> None:
    """Every host driver the CLI opens sees a host with ``free`` bytes available (MemAvailable
    dropping as the driver commits) and a 4 MiB margin: refusals computed, nothing allocated."""
    from xllm_vmm.vmm import MemInfo
    from xllm_vmm.vmm import host as host_mod

    real = host_mod.HostDriver.__init__

    def init(self, *a, **kw):
        def reader():
            held = 0
            if hasattr(self, "_hb_bytes") and not self._closed:
                held = self.stats()["committed_bytes"] + self._hb_bytes
            return MemInfo(free=free - held, total=1 << 30)

        kw.setdefault("host_margin", 4 << 20)
        kw.setdefault("host_memory_reader", reader)
        if kw.get("hugepages") is None:  # the fake host is RAM: no hugetlb pages from the real one
            kw["hugepages"] = "off"
        real(self, *a, **kw)

    monkeypatch.setattr(host_mod.HostDriver, "__init__", init)


@pytest.mark.parametrize("args,expect", [
    (["map", "--pages", "100000000"],
     "error: bench map: --pages 100000000 needs 419430400000000 bytes (390625.00 GiB: 2 x "
     "100000000 pages of 2097152 bytes) but the host driver can commit 62914560 bytes "
     "(0.06 GiB) now; use --pages 15 or less"),
    (["map", "--pages", "16"],
     "error: bench map: --pages 16 needs 67108864 bytes (0.06 GiB: 2 x 16 pages of 2097152 "
     "bytes) but the host driver can commit 62914560 bytes (0.06 GiB) now; use --pages 15 or "
     "less"),
    (["copy", "--blocks", "100000000"], "error: bench copy: --blocks 100000000 needs "),
    (["copy", "--blocks", "30"], "error: bench copy: --blocks 30 needs 83589120 bytes (0.08 GiB: 30 pages of 2097152 "
     "bytes + a host buffer of 20643840 bytes + 30720 bytes of bookkeeping) but the host driver "
     "can commit 62914560 bytes (0.06 GiB) now; use --blocks 22 or less"),
])
def test_bench_map_and_copy_refuse_sizes_that_do_not_fit_with_the_numbers(monkeypatch, args,
                                                                          expect):
    _tiny_host(monkeypatch, 64 << 20)  # 60 MiB can be committed
    r = CliRunner().invoke(app, ["bench"] + args)
    assert r.exit_code == 2, r.output
    assert r.output.startswith(expect) and len(r.output.strip().splitlines()) == 1


def test_bench_map_fits_at_the_largest_size_it_suggests(monkeypatch):
    _tiny_host(monkeypatch, 64 << 20)
    r = CliRunner().invoke(app, ["bench", "map", "--pages", "15", "--rounds", "1", "--repeats",
                                 "1", "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["pages"] == 15


def test_bench_copy_fits_at_the_largest_size_it_suggests(monkeypatch):
    _tiny_host(monkeypatch, 64 << 20)
    r = CliRunner().invoke(app, ["bench", "copy", "--blocks", "22", "--repeats", "1",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["blocks"] == 22 and out["data_verified"] is True
    assert out["total_bytes"] == 3 * (64 + 128 + 256 + 512 + 1024 + 2048) * 1024 + (64 + 128 + 256 + 512) * 1024


def test_bench_copy_refuses_a_huge_block_count_without_listing_blocks(monkeypatch):
    """The fit check runs before any per-block list: refusing 10^8 blocks allocates (almost)
    nothing in Python (it took 810 MB and 4.7 s when the sizes were listed first)."""
    import tracemalloc

    _tiny_host(monkeypatch, 64 << 20)
    tracemalloc.start()
    try:
        r = CliRunner().invoke(app, ["bench", "copy", "--blocks", "100000000"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.exit_code == 2 and "use --blocks 22 or less" in r.output
    assert peak < 16 << 20


def test_copy_sizes_and_total_without_a_list():
    from xllm_vmm.bench.copy import block_size, total_bytes

    assert [block_size(i, 64 << 10, 256 << 10) for i in range(5)] == [
        64 << 10, 128 << 10, 256 << 10, 64 << 10, 128 << 10]
    assert total_bytes(5, 64 << 10, 256 << 10) == (64 + 128 + 256 + 64 + 128) << 10
    assert total_bytes(10 ** 12, 1 << 21, 1 << 21) == 10 ** 12 << 21


def test_copy_data_check_compares_in_place():
    import ctypes as C

    from xllm_vmm.bench.copy import buffer_is

    n = 3 * (1 << 20) + 5  # crosses chunk boundaries, ragged end
    buf = (C.c_char * n)()
    C.memset(buf, 0x11, n)
    assert buffer_is(C.addressof(buf), n, 0x11)
    buf[n - 1] = b"\x12"
    assert not buffer_is(C.addressof(buf), n, 0x11)
    buf[n - 1] = b"\x11"
    buf[(1 << 20) + 7] = b"\x00"
    assert not buffer_is(C.addressof(buf), n, 0x11)


def test_bench_copy_on_the_acl_emulation_checks_pages_and_buffer_together(monkeypatch):
    """Emulated device pages and the host buffer are both host memory: one check of their sum
    against the smaller of the driver's free bytes and the host's headroom."""
    from xllm_vmm.bench import copy as copy_bench
    from xllm_vmm.bench import limits
    from xllm_vmm.bench.limits import BenchTooLarge
    from xllm_vmm.vmm import MemInfo

    class Emu:
        name, emulated, granularity = "acl", True, 2 << 20

        def mem_info(self):
            return MemInfo(free=100 << 20, total=1 << 30)

    monkeypatch.setattr(limits, "host_headroom", lambda: 60 << 20)
    total = copy_bench.total_bytes(30, 64 << 10, 2 << 20)
    with pytest.raises(BenchTooLarge) as e:
        copy_bench.check_copy_fits(Emu(), 30, total)
    assert str(e.value) == (
        "--blocks 30 needs 83589120 bytes (0.08 GiB: 30 pages of 2097152 bytes + a host buffer "
        "of 20643840 bytes + 30720 bytes of bookkeeping) but the acl emulation (host memory) can "
        "commit 62914560 bytes (0.06 GiB) now; use --blocks 22 or less")
    copy_bench.check_copy_fits(Emu(), 22, copy_bench.total_bytes(22, 64 << 10, 2 << 20))


def test_bench_driver_errors_are_one_line_exit_1(monkeypatch):
    from xllm_vmm.bench import map as map_bench
    from xllm_vmm.vmm import VmmOutOfMemory

    def boom(driver, **kw):
        raise VmmOutOfMemory("create_handle", 12, "out of host memory: 2097152 bytes requested")

    monkeypatch.setattr(map_bench, "run", boom)
    r = CliRunner().invoke(app, ["bench", "map"])
    assert r.exit_code == 1
    assert r.output.strip() == ("error: bench map failed: create_handle failed with code 12: "
                                "out of host memory: 2097152 bytes requested")
