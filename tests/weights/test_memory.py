"""Memory really released and re-acquired: the host driver's Shmem (RssShmem of this process;
with hugetlb backing its HugetlbPages, which are not shmem) drops by at least 99% of the weight
bytes in light sleep, on every huge-page backing (4 KiB pages, shmem THP, hugetlb: each enabled
for its test, see ``conftest.backing_enabled``); the ACL emulation's aclrtGetMemInfo free rises
by the weights' pages; 20 sleep/wake cycles grow neither RSS, nor Shmem/hugetlb pages, nor file
descriptors, nor mappings."""

from __future__ import annotations

import gc
import os

import pytest

torch = pytest.importorskip("torch")

from tests.weights.conftest import (HOST_BACKINGS, MiB, backing_enabled,  # noqa: E402
                                    checksums, make_pool, open_test_driver, random_tensors,
                                    save_checkpoint)
from xllm_vmm.weights import load_weights  # noqa: E402


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def _host_pages() -> int:
    """Bytes of this process's shmem and hugetlb pages: where host driver handles live."""
    return _status("RssShmem") + _status("HugetlbPages")


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def model16(tmp_path_factory):
    """About 16 MiB of bf16 weights over two shards."""
    return save_checkpoint(tmp_path_factory.mktemp("w16") / "m",
                           random_tensors("bfloat16", hidden=512, layers=2, vocab=4096),
                           shards=2)


@pytest.mark.parametrize("kind", HOST_BACKINGS)
def test_host_light_sleep_drops_shmem_by_the_weight_bytes(model16, kind):
    with backing_enabled(kind):
        d = open_test_driver(kind, 256 * MiB)
        assert d.hugepages == {"host": "off", "host-thp": "thp", "host-hugetlb": "hugetlb"}[kind]
        _drops_and_comes_back(d, model16)


def _drops_and_comes_back(d, model16) -> None:
    pool = make_pool(d, 64 * MiB)
    w = load_weights(model16, pool=pool)
    assert w.nbytes > 12 * MiB
    awake = _host_pages()
    w.sleep(1)
    dropped = awake - _host_pages()
    assert dropped >= 0.99 * w.nbytes, f"RssShmem+HugetlbPages dropped {dropped} of {w.nbytes} bytes"
    w.wake_up()
    assert _host_pages() - (awake - dropped) >= 0.99 * w.nbytes  # and comes back
    w.close()
    w = None
    gc.collect()
    pool.close()
    d.close()


def test_acl_emulation_free_rises_by_the_weight_pages(model16):
    d = open_test_driver("acl-emulation", 256 * MiB)
    pool = make_pool(d, 64 * MiB)
    w = load_weights(model16, pool=pool)
    free_awake = d.mem_info().free
    w.sleep(1)
    assert d.mem_info().free - free_awake == w.device_bytes >= w.nbytes
    w.wake_up()
    assert d.mem_info().free == free_awake
    w.sleep(2)
    assert d.mem_info().free - free_awake == w.device_bytes
    w.wake_up()
    w.close()
    w = None
    gc.collect()
    pool.close()
    d.close()


def test_twenty_cycles_grow_nothing(model16, backing_kind):
    d = open_test_driver(backing_kind, 256 * MiB)
    pool = make_pool(d, 64 * MiB)
    w = load_weights(model16, pool=pool)
    want = checksums(w)

    def cycle(level: int) -> None:
        w.sleep(level)
        w.wake_up()

    for level in (1, 2):  # warm up: first use of every path
        cycle(level)
    gc.collect()
    base = (_status("VmRSS"), _host_pages(), _fds(), _mappings())
    for i in range(20):
        cycle(1 + i % 2)
    gc.collect()
    rss, shmem, fds, maps = (_status("VmRSS"), _host_pages(), _fds(), _mappings())
    assert fds == base[2], "file descriptors grew"
    # a re-allocated host copy may or may not merge with a neighbouring VMA (±1); a leak is
    # one mapping per cycle or more
    assert maps - base[3] <= 1, f"mappings grew by {maps - base[3]} over 20 cycles"
    assert shmem == base[1], f"Shmem + hugetlb pages grew by {shmem - base[1]} bytes"
    # RSS: Python's own heap may move by a few pages; a leaked host copy or page would be
    # megabytes (the weights are 16 MiB)
    assert rss - base[0] < 2 * MiB, f"RSS grew by {rss - base[0]} bytes over 20 cycles"
    assert checksums(w) == want
    w.close()
    w = None
    gc.collect()
    pool.close()
    d.close()
