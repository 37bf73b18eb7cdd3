"""The host tier's copies through the fan-out object (no processes): addresses travel as
``(region, offset)``; a copy failing on any worker fails the whole transfer for the tier, one
succeeding everywhere is a finished transfer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from xllm_vmm.engine.distributed.fanout import CopyRegions, FanoutBacking


class Geo:
    def __init__(self, base: int) -> None:
        self.base, self.num_tensors, self.num_slots, self.page_bytes = base, 2, 4, 100

    def tensor_va(self, t: int) -> int:
        return self.base + t * 1000


def regions(base: int, host: int) -> CopyRegions:
    cache = SimpleNamespace(geometry={"attn": Geo(base)})
    pool = SimpleNamespace(buffer=SimpleNamespace(address=host), capacity=3, block_bytes=50)
    return CopyRegions(cache, pool)


def test_addresses_map_between_workers_by_region_and_offset():
    r0, r1 = regions(10_000, 90_000), regions(50_000, 7_000)
    rel = r0.relative([10_005, 11_399, 90_149])
    assert rel == [(0, 5), (1, 399), (2, 149)]
    assert r1.absolute(rel) == [50_005, 51_399, 7_149]
    with pytest.raises(ValueError, match="no KV tensor"):
        r0.relative([10_400])  # past the first tensor's 4 pages


class Runtime:
    def __init__(self, worker_ok: bool) -> None:
        self.active, self.worker_ok, self.calls = True, worker_ok, []
        self.group = SimpleNamespace(address="127.0.0.1:1")

    def call(self, op, payload, local):
        self.calls.append((op, payload))
        here = local()
        return [dict(here, rank=0), {"rank": 1, "ok": self.worker_ok, "error": "boom"}]


class Driver:
    def __init__(self) -> None:
        self.copies = []

    def copy_batch(self, dsts, srcs, sizes, kind):
        self.copies.append((list(dsts), list(srcs), list(sizes), kind))


@pytest.mark.parametrize("worker_ok", [True, False])
def test_a_copy_is_all_or_nothing(worker_ok):
    rt, drv = Runtime(worker_ok), Driver()
    fan = FanoutBacking(None, rt, copy_driver=drv, regions=regions(10_000, 90_000))
    t = fan.copy_batch_async([90_000], [10_000], [50], "D2H")
    assert t.done() and drv.copies == [([90_000], [10_000], [50], "D2H")]
    assert rt.calls == [("copy", ("D2H", [(2, 0)], [(0, 0)], [50]))]
    if worker_ok:
        t.wait()
    else:
        with pytest.raises(Exception, match="host-tier copy failed on worker rank 1: boom"):
            t.wait()
