"""``xllm-vmm bench map``: the cost of mapping and unmapping 2 MiB pages through a driver.

Three ways of doing the same map+unmap of ``pages`` pages, ``rounds`` times, in one process:

* ``batched``: one ``map_batch`` + one ``unmap_batch`` call per round (the pool's hot path);
* ``per_call``: one ``map`` / ``unmap`` Python call per page;
* ``raw``: the device calls with no bookkeeping — on the host a C loop doing exactly the
  ``mmap`` system calls of the driver (the limit on this host); on ACL/CUDA the library's
  map/unmap functions called straight through ctypes.

Per-page costs are microseconds for one map plus one unmap. ``batched_vs_raw_ratio`` =
batched / raw; ``python_overhead_us_per_page`` = batched − raw per page (what the driver adds
above the system calls). Targets: ratio ≤ 1.2 and overhead ≤ 1 µs/page for batches of 64 or more.
"""

from __future__ import annotations

import array
import ctypes as C
import platform
import time
from typing import Any


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _raw_fn(driver, vas: list[int], handles: list[int], rounds: int):
    if driver.name == "host":
        lib = driver._lib
        offs = array.array("Q", handles)
        fd, g, va0, n = driver.memfd, driver.granularity, vas[0], len(vas)

        def raw() -> None:
            rc = lib.hv_bench_raw_map_unmap(fd, va0, offs.buffer_info()[0], n, g, rounds)
            if rc:
                raise RuntimeError((lib.hv_last_error() or b"").decode())

        return raw
    if driver.name == "acl":
        acl, g = driver._acl, driver.granularity

        def raw() -> None:
            for _ in range(rounds):
                for va, h in zip(vas, handles):
                    acl.aclrtMapMem(va, g, 0, h, 0)
                for va in vas:
                    acl.aclrtUnmapMem(va)

        return raw
    if driver.name == "cuda":
        cu, g, acc = driver._cu, driver.granularity, C.byref(driver._access)

        def raw() -> None:
            for _ in range(rounds):
                for va, h in zip(vas, handles):
                    cu.cuMemMap(va, g, 0, h, 0)
                    cu.cuMemSetAccess(va, g, acc, 1)
                for va in vas:
                    cu.cuMemUnmap(va, g)

        return raw
    return None


def run(driver, pages: int = 64, rounds: int = 20, repeats: int = 3) -> dict[str, Any]:
    """Measures the three ways on ``driver``; leaves nothing mapped or allocated."""
    if pages <= 0 or rounds <= 0 or repeats <= 0:
        raise ValueError(f"--pages, --rounds and --repeats must be positive (got {pages}, {rounds}, {repeats})")
    g = driver.granularity
    va = driver.reserve(pages * g)
    handles = driver.create_handles(pages, g)
    vas = [va + i * g for i in range(pages)]
    try:
        def batched() -> None:
            for _ in range(rounds):
                driver.map_batch(vas, handles)
                driver.unmap_batch(vas)

        def per_call() -> None:
            for _ in range(rounds):
                for v, h in zip(vas, handles):
                    driver.map(v, h)
                for v in vas:
                    driver.unmap(v)

        raw = _raw_fn(driver, vas, handles, rounds)
        batched()  # warm-up
        per = pages * rounds
        t_batched = _best(batched, repeats) / per * 1e6
        t_call = _best(per_call, repeats) / per * 1e6
        t_raw = _best(raw, repeats) / per * 1e6 if raw else None
    finally:
        for v in vas:
            if getattr(driver, "is_mapped", None) and driver.is_mapped(v, g):
                driver.unmap(v)
        for h in handles:
            driver.free_handle(h)
        driver.release(va, pages * g)
    return {
        "device": driver.device_kind,
        "driver": driver.name,
        "machine": platform.machine(),
        "page_bytes": g,
        "pages": pages,
        "rounds": rounds,
        "batched_us_per_page": t_batched,
        "per_call_us_per_page": t_call,
        "raw_us_per_page": t_raw,
        "batched_vs_raw_ratio": t_batched / t_raw if t_raw else None,
        "per_call_vs_raw_ratio": t_call / t_raw if t_raw else None,
        "python_overhead_us_per_page": t_batched - t_raw if t_raw is not None else None,
        "batched_speedup_over_per_call": t_call / t_batched,
    }
