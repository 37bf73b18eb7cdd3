"""Run records on the host driver: ``runs_of`` / ``prepare_runs`` find the runs contiguous in
address and memfd offset, ``map_runs`` / ``unmap_runs`` map each with one call, all or nothing,
while every handle stays its own mapping."""

from __future__ import annotations

import array
import ctypes as C

import pytest

from xllm_vmm.vmm import VmmAlreadyMapped, VmmError, VmmInvalidArgument, VmmNotMapped
from xllm_vmm.vmm.host import HostDriver, RunBatch, runs_of

MiB = 1024 * 1024
G = 2 * MiB


@pytest.fixture
def drv():
    d = HostDriver(hugepages="off")
    yield d
    d.close()


def test_runs_of_splits_where_address_or_offset_breaks():
    vas = [0, G, 2 * G, 10 * G, 11 * G, 12 * G]
    hs = [G, 2 * G, 3 * G, 4 * G, 9 * G, 10 * G]  # the run breaks in address, then in offset
    maps, unmaps = runs_of(vas, hs, G)
    assert list(maps) == [0, G, 3 * G, 10 * G, 4 * G, G, 11 * G, 9 * G, 2 * G]
    assert list(unmaps) == [0, 3 * G, 10 * G, G, 11 * G, 2 * G]
    maps, _ = runs_of([0, 2 * G], [G, 3 * G], [2 * G, G])  # sizes per entry
    assert list(maps) == [0, G, 3 * G]
    with pytest.raises(VmmInvalidArgument, match="2 addresses but 1 handles"):
        runs_of([0, G], [G], G)


def test_unmap_runs_on_a_driver_with_no_handle_yet(drv):
    va = drv.reserve(2 * G)
    with pytest.raises(VmmNotMapped, match="is not mapped"):
        drv.unmap_runs([va, 2 * G])
    drv.release(va, 2 * G)


def test_map_runs_keeps_each_handle_its_own_mapping(drv):
    hs = drv.create_handles(6, G)
    va = drv.reserve(12 * G)
    vas = [va + i * G for i in range(6)]
    batch = drv.prepare_runs(vas, hs)
    assert isinstance(batch, RunBatch) and len(batch) == 1 and batch.nbytes == 6 * G
    drv.map_runs(batch)
    assert drv.stats()["mappings"] == 6 and drv.is_mapped(va, 6 * G)
    for i in range(6):
        C.memset(vas[i], 0x30 + i, G)
    drv.unmap(vas[2])  # one handle alone
    with pytest.raises(VmmNotMapped):
        drv.unmap_runs(batch)  # a hole in the run: refused, nothing unmapped
    assert drv.is_mapped(va, 2 * G) and drv.is_mapped(vas[3], 3 * G)
    drv.map(vas[2], hs[2])
    drv.unmap_runs(batch)
    assert drv.stats()["mappings"] == 0 and not drv.is_mapped(va, 1)
    # the same handles reversed elsewhere: one run per handle, the data follows the handle
    rev = drv.prepare_runs([va + (6 + i) * G for i in range(6)], hs[::-1])
    assert len(rev) == 6
    drv.map_runs(rev)
    assert C.string_at(va + 6 * G, 1) == b"\x35" and C.string_at(va + 12 * G - 1, 1) == b"\x30"
    drv.unmap_batch([va + (6 + i) * G for i in range(6)])  # run mappings unmap any way
    # plain arrays and sequences work too
    drv.map_runs(array.array("Q", [va, hs[0], 3 * G]))
    drv.unmap_runs([va, 3 * G])
    for h in hs:
        drv.free_handle(h)
    drv.release(va, 12 * G)


def test_map_runs_is_all_or_nothing_and_names_the_run(drv):
    hs = drv.create_handles(4, G)
    va = drv.reserve(8 * G)
    drv.map(va + 5 * G, hs[3])
    runs = [va, hs[0], 2 * G, va + 4 * G, hs[2], 2 * G]  # the second run hits the mapping
    with pytest.raises(VmmAlreadyMapped, match="run 1 of 2"):
        drv.map_runs(runs)
    assert drv.stats()["mappings"] == 1 and not drv.is_mapped(va, 1)
    with pytest.raises(VmmInvalidArgument, match="not \\(va, handle, nbytes\\) triples"):
        drv.map_runs([va, hs[0]])
    with pytest.raises(VmmInvalidArgument, match="not \\(va, nbytes\\) pairs"):
        drv.unmap_runs([va])
    with pytest.raises(VmmError, match="unknown handle"):
        drv.map_runs([va, hs[3] + G, G])  # past the last handle
    with pytest.raises(VmmInvalidArgument, match="runs past the end of its reservation"):
        drv.map_runs([va + 6 * G, hs[0], 4 * G])
    drv.map_runs([va, hs[0], 3 * G])
    with pytest.raises(VmmNotMapped, match="listed twice"):
        drv.unmap_runs([va, 2 * G, va + G, G])
    assert drv.is_mapped(va, 3 * G)
    drv.unmap_runs([va + 2 * G, G, va, 2 * G, va + 5 * G, G])  # several runs, any order
    assert drv.stats()["mappings"] == 0
    for h in hs:
        drv.free_handle(h)
    drv.release(va, 8 * G)
    drv.close()
    with pytest.raises(VmmInvalidArgument, match="closed"):
        drv.map_runs(RunBatch(array.array("Q", [va, hs[0], G]), array.array("Q", [va, G])))


def test_freed_handles_come_back_in_the_order_freed(drv):
    """The memfd's free extents are reused oldest first: pages freed in ascending order (a
    sleep) are created again ascending (a wakeup), contiguous in the memfd, so mapping them
    back at their addresses is one run."""
    hs = drv.create_handles(8, G)
    assert hs == [hs[0] + i * G for i in range(8)]
    for h in hs:
        drv.free_handle(h)
    again = drv.create_handles(8, G)
    assert again == hs
    va = drv.reserve(8 * G)
    assert len(drv.prepare_runs([va + i * G for i in range(8)], again)) == 1
    drv.release(va, 8 * G)
    for h in again[:4]:
        drv.free_handle(h)
    assert drv.create_handle(2 * G) == again[-1] + G  # no extent of that size: the file grows
    assert drv.create_handle(G) == again[0]


# ---- map_batch / unmap_batch: runs found in C --------------------------------------------


def test_map_batch_finds_contiguous_runs_in_native_code(drv):
    """A contiguous batch of one-granule handles is mapped as one run (one VMA), every handle
    still its own mapping; ``array('Q')`` arguments are taken as they are; the unmap of the
    whole run leaves nothing mapped; a scattered batch gives the same bookkeeping."""
    hs = drv.create_handles(8, G)
    va = drv.reserve(16 * G)
    vas = array.array("Q", [va + i * G for i in range(8)])
    drv.map_batch(vas, array.array("Q", hs))
    st = drv.stats()
    assert st["mappings"] == 8 and st["mapped_bytes"] == 8 * G
    for i in range(8):  # each page through its own handle
        C.memset(va + i * G, i + 1, 16)
    drv.unmap(va + 3 * G)  # one handle alone
    assert not drv.is_mapped(va + 3 * G, G) and drv.is_mapped(va + 4 * G, 4 * G)
    drv.map(va + 3 * G, hs[3])
    assert C.string_at(va + 3 * G, 1) == b"\x04"
    drv.unmap_batch(vas)
    assert drv.stats()["mappings"] == 0 and drv.stats()["mapped_bytes"] == 0
    spread = [va + 2 * i * G for i in range(8)]
    drv.map_batch(spread, hs[::-1])
    assert drv.stats()["mappings"] == 8
    assert C.string_at(spread[0], 1) == b"\x08"
    drv.unmap_batch(spread)
    for h in hs:
        drv.free_handle(h)
    drv.release(va, 16 * G)


def test_map_batch_run_errors_name_the_entry_and_leave_nothing(drv):
    """A contiguous batch that fails its one-pass check goes entry by entry: the error names
    the exact entry and nothing stays mapped (a page mapped already; a freed handle in the
    middle; the interior of a two-granule handle; the mapping cap)."""
    hs = drv.create_handles(6, G)
    va = drv.reserve(8 * G)
    vas = [va + i * G for i in range(6)]
    drv.map(va + 4 * G, hs[5])
    with pytest.raises(VmmAlreadyMapped, match="batch entry 4 of 6"):
        drv.map_batch(vas, hs)
    assert drv.stats()["mappings"] == 1
    drv.unmap(va + 4 * G)
    drv.free_handle(hs[2])
    with pytest.raises(VmmError, match="batch entry 2 of 6: unknown handle"):
        drv.map_batch(vas, hs)
    assert drv.stats()["mappings"] == 0
    big = drv.create_handle(2 * G)
    with pytest.raises(VmmError, match="batch entry 1 of 2: unknown handle"):
        drv.map_batch([va, va + G], [big, big + G])
    assert drv.stats()["mappings"] == 0
    drv.map_batch([va, va + 2 * G], [big, hs[0]])  # a two-granule handle, then the next page
    assert drv.stats()["mappings"] == 2
    with pytest.raises(VmmNotMapped, match="batch entry 1 of 3: address .* inside a mapping"):
        drv.unmap_batch([va, va + G, va + 2 * G])  # one run of addresses, not of mappings
    assert drv.stats()["mappings"] == 2
    drv.unmap_batch([va, va + 2 * G])
    for h in [hs[0], hs[1], hs[3], hs[4], hs[5], big]:
        drv.free_handle(h)
    drv.release(va, 8 * G)


def test_map_batch_run_respects_the_mapping_cap():
    d = HostDriver(hugepages="off", max_mappings=4)
    try:
        hs = d.create_handles(6, G)
        va = d.reserve(6 * G)
        with pytest.raises(VmmError, match="batch entry 4 of 6: mapping limit of 4"):
            d.map_batch([va + i * G for i in range(6)], hs)
        assert d.stats()["mappings"] == 0
        d.map_batch([va + i * G for i in range(4)], hs[:4])
        assert d.stats()["mappings"] == 4
        d.unmap_batch([va + i * G for i in range(4)])
        for h in hs:
            d.free_handle(h)
        d.release(va, 6 * G)
    finally:
        d.close()


def test_unmap_batch_run_with_a_listed_twice_entry_unmaps_nothing(drv):
    hs = drv.create_handles(3, G)
    va = drv.reserve(3 * G)
    vas = [va + i * G for i in range(3)]
    drv.map_batch(vas, hs)
    with pytest.raises(VmmNotMapped, match="listed twice"):
        drv.unmap_batch(vas + [va])
    assert drv.stats()["mappings"] == 3
    drv.unmap_batch(vas)
    for h in hs:
        drv.free_handle(h)
    drv.release(va, 3 * G)


def test_prepared_batch_belongs_to_its_driver(drv):
    """A batch prepared by one driver carries that driver's call block; on another driver it
    takes the general record path (its own pool), and once its driver closes its block answers
    'closed'."""
    other = HostDriver(hugepages="off")
    try:
        hs = other.create_handles(2, G)
        va = other.reserve(2 * G)
        batch = drv.prepare_runs([va, va + G], hs)  # prepared on drv, used on other
        other.map_runs(batch)
        assert other.stats()["mappings"] == 2 and drv.stats()["mappings"] == 0
        other.unmap_runs(batch)
        mine = other.prepare_runs([va, va + G], hs)
        other.close()
        with pytest.raises(VmmInvalidArgument, match="closed"):
            other.map_runs(mine)
        assert mine._call.pool is None
    finally:
        other.close()
