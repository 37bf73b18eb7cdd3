"""The driver conformance suite: the same behaviour from every driver (host, ACL over the
emulation, CUDA on a GPU). Device memory is read and written through the driver's own copies,
so the suite runs unchanged on a real device."""

from __future__ import annotations

import ctypes as C

import pytest

from xllm_vmm.vmm import (
    CopyKind,
    VmmAlreadyMapped,
    VmmBusy,
    VmmInvalidArgument,
    VmmNotMapped,
    VmmOutOfMemory,
)

MiB = 1024 * 1024


def write(d, va: int, data: bytes) -> None:
    buf = C.create_string_buffer(data, len(data))
    d.copy(va, C.addressof(buf), len(data), CopyKind.H2D)


def read(d, va: int, n: int) -> bytes:
    buf = C.create_string_buffer(n)
    d.copy(C.addressof(buf), va, n, CopyKind.D2H)
    return buf.raw


def test_granularity_is_2mib_and_reservations_are_aligned(driver):
    assert driver.granularity == 2 * MiB
    va = driver.reserve(4 * driver.granularity)
    assert va % driver.granularity == 0
    driver.release(va, 4 * driver.granularity)


def test_map_write_unmap_remap_keeps_data_in_the_handle(driver):
    g = driver.granularity
    va = driver.reserve(4 * g)
    h = driver.create_handle(g)
    driver.map(va + g, h)
    write(driver, va + g + 100, b"kv-block-42")
    assert read(driver, va + g + 100, 11) == b"kv-block-42"
    driver.unmap(va + g)
    driver.map(va + 3 * g, h)  # another address, same physical memory
    assert read(driver, va + 3 * g + 100, 11) == b"kv-block-42"
    driver.unmap(va + 3 * g)
    driver.free_handle(h)
    driver.release(va, 4 * g)


def test_one_handle_at_two_addresses_aliases(driver):
    g = driver.granularity
    va = driver.reserve(2 * g)
    h = driver.create_handle(g)
    driver.map_batch([va, va + g], [h, h])
    write(driver, va + 5, b"alias")
    assert read(driver, va + g + 5, 5) == b"alias"
    driver.unmap_batch([va, va + g])
    driver.free_handle(h)
    driver.release(va, 2 * g)


def test_multi_granule_handle_is_mapped_whole(driver):
    g = driver.granularity
    va = driver.reserve(4 * g)
    h = driver.create_handle(2 * g)
    driver.map(va, h)
    write(driver, va + g - 3, b"spans")
    assert read(driver, va + g - 3, 5) == b"spans"
    with pytest.raises(VmmAlreadyMapped):
        driver.map(va + g, driver.create_handle(g))  # second page belongs to the 2-page mapping
    with pytest.raises(VmmNotMapped):
        driver.unmap(va + g)  # not the start of a mapping
    driver.unmap(va)
    driver.free_handle(h)


def test_batched_copies_gather_and_scatter(driver):
    g = driver.granularity
    va = driver.reserve(2 * g)
    hs = [driver.create_handle(g), driver.create_handle(g)]
    driver.map_batch([va, va + g], hs)
    blocks = [bytes([i]) * 4096 for i in range(1, 5)]
    host = C.create_string_buffer(b"".join(blocks), 4 * 4096)
    base = C.addressof(host)
    # scatter host blocks 0..3 to device offsets (reverse order, across both pages)
    dsts = [va + g + 8192, va + 4096, va + g, va]
    driver.copy_batch(dsts, [base + i * 4096 for i in range(4)], [4096] * 4, CopyKind.H2D)
    assert read(driver, va, 4096) == blocks[3]
    assert read(driver, va + g + 8192, 4096) == blocks[0]
    # gather back into a fresh host buffer in device order
    out = C.create_string_buffer(4 * 4096)
    driver.copy_batch([C.addressof(out) + i * 4096 for i in range(4)], [va, va + 4096, va + g, va + g + 8192],
                      [4096] * 4, CopyKind.D2H)
    assert out.raw == blocks[3] + blocks[1] + blocks[2] + blocks[0]
    # device to device
    driver.copy_batch([va + g + 65536], [va + 4096], [4096], CopyKind.D2D)
    assert read(driver, va + g + 65536, 4096) == blocks[1]
    t = driver.copy_batch_async([C.addressof(out)], [va + g], [4096], CopyKind.D2H)
    t.wait(timeout=30)
    assert t.done() and out.raw[:4096] == blocks[2]
    driver.synchronize()
    driver.unmap_batch([va, va + g])
    for h in hs:
        driver.free_handle(h)
    driver.release(va, 2 * g)


# ---- misuse is refused the same way by every driver ------------------------------------------


def test_mapping_over_a_mapped_range_is_refused(driver):
    g = driver.granularity
    va = driver.reserve(2 * g)
    h1, h2 = driver.create_handle(g), driver.create_handle(g)
    driver.map(va, h1)
    write(driver, va, b"first")
    with pytest.raises(VmmAlreadyMapped) as err:
        driver.map(va, h2)
    assert "already mapped" in str(err.value)
    assert read(driver, va, 5) == b"first"  # the old mapping is untouched
    driver.unmap(va)


def test_unaligned_sizes_and_addresses_are_refused(driver):
    g = driver.granularity
    with pytest.raises(VmmInvalidArgument):
        driver.create_handle(g + 4096)
    with pytest.raises(VmmInvalidArgument):
        driver.create_handle(0)
    with pytest.raises(VmmInvalidArgument):
        driver.reserve(g // 2)
    va = driver.reserve(2 * g)
    h = driver.create_handle(g)
    with pytest.raises(VmmInvalidArgument):
        driver.map(va + 4096, h)
    driver.map(va, h)  # the handle is still usable after the refusal
    driver.unmap(va)


def test_unmapping_what_is_not_mapped_is_refused(driver):
    g = driver.granularity
    va = driver.reserve(2 * g)
    with pytest.raises(VmmNotMapped):
        driver.unmap(va)
    h = driver.create_handle(g)
    driver.map(va, h)
    driver.unmap(va)
    with pytest.raises(VmmNotMapped):
        driver.unmap(va)  # twice


def test_mapping_outside_a_reservation_or_an_unknown_handle_is_refused(driver):
    g = driver.granularity
    va = driver.reserve(g)
    h = driver.create_handle(g)
    with pytest.raises(VmmInvalidArgument):
        driver.map(va + g, h)  # just past the end
    with pytest.raises(VmmInvalidArgument):
        driver.map(va, h + 1000 * g)
    driver.free_handle(h)
    with pytest.raises(VmmInvalidArgument):
        driver.map(va, h)  # freed
    with pytest.raises(VmmInvalidArgument):
        driver.free_handle(h)  # twice


def test_releasing_a_range_with_mappings_is_refused(driver):
    g = driver.granularity
    va = driver.reserve(2 * g)
    h = driver.create_handle(g)
    driver.map(va + g, h)
    with pytest.raises(VmmBusy):
        driver.release(va, 2 * g)
    with pytest.raises(VmmBusy):
        driver.free_handle(h)
    driver.unmap(va + g)
    driver.free_handle(h)
    driver.release(va, 2 * g)
    with pytest.raises(VmmInvalidArgument):
        driver.release(va, 2 * g)  # twice


def test_copy_to_an_unmapped_device_range_is_refused(driver):
    g = driver.granularity
    va = driver.reserve(2 * g)
    h = driver.create_handle(g)
    driver.map(va, h)
    buf = C.create_string_buffer(8192)
    with pytest.raises(VmmNotMapped):
        driver.copy(va + g - 4096, C.addressof(buf), 8192, CopyKind.H2D)  # runs into page 2
    driver.unmap(va)


# ---- batches are all or nothing -------------------------------------------------------------


def test_map_batch_failing_mid_way_rolls_back(driver):
    g = driver.granularity
    va = driver.reserve(8 * g)
    hs = [driver.create_handle(g) for _ in range(4)]
    driver.map(va + 6 * g, hs[3])
    with pytest.raises(VmmAlreadyMapped):
        driver.map_batch([va, va + g, va + 2 * g, va + 6 * g], hs[:3] + [hs[2]])
    # nothing of the failed call remains: every page can be mapped again
    driver.map_batch([va, va + g, va + 2 * g], hs[:3])
    driver.unmap_batch([va, va + g, va + 2 * g, va + 6 * g])


def test_unmap_batch_failing_mid_way_rolls_back(driver):
    g = driver.granularity
    va = driver.reserve(4 * g)
    hs = [driver.create_handle(g) for _ in range(2)]
    driver.map_batch([va, va + g], hs)
    write(driver, va, b"still here")
    with pytest.raises(VmmNotMapped):
        driver.unmap_batch([va, va + g, va + 2 * g])
    assert read(driver, va, 10) == b"still here"
    driver.unmap_batch([va, va + g])


def test_out_of_memory_is_typed_and_create_handles_rolls_back(driver_factory):
    d = driver_factory(device_memory=64 * MiB)
    g = d.granularity
    assert d.mem_info().total == 64 * MiB
    hs = d.create_handles(30, g)
    assert d.mem_info().free == 4 * MiB
    with pytest.raises(VmmOutOfMemory):
        d.create_handles(3, g)  # 2 fit, the 3rd does not
    assert d.mem_info().free == 4 * MiB  # the two made by the failed call were freed
    extra = d.create_handles(2, g)
    with pytest.raises(VmmOutOfMemory):
        d.create_handle(g)
    for h in hs + extra:
        d.free_handle(h)
    assert d.mem_info().free == 64 * MiB


@pytest.mark.parametrize("op,size", [
    ("reserve", -2 * MiB), ("reserve", 0), ("reserve", 3 * MiB),
    ("create_handle", -2 * MiB), ("create_handle", 0), ("create_handle", MiB),
    ("alloc_host", -5), ("alloc_host", 0),
])
def test_negative_zero_and_unaligned_sizes_are_misuse_naming_the_size(driver, op, size):
    """Not "out of memory" and not "too large": VmmInvalidArgument that names the argument and
    the value, and nothing is committed or reserved."""
    with pytest.raises(VmmInvalidArgument) as err:
        getattr(driver, op)(size)
    assert not isinstance(err.value, VmmOutOfMemory)
    msg = str(err.value)
    assert f"{op} failed" in msg and "size" in msg and str(size) in msg, msg
    assert "too large" not in msg and "out of" not in msg
