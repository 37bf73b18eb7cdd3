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
These fields are measured with plain maps (populate off) on both sides.

On the host driver the batched and raw ways run a second time with mappings *populated*
(``MAP_POPULATE`` on both sides, like with like): ``populated_batched_us_per_page``,
``populated_raw_us_per_page`` and ``populated_batched_vs_raw_ratio``. Populating costs page-table
work at map time that a plain map leaves to the first writes (page faults), so these are not
comparable with the plain figures. What populating is for — the first writes into a freshly
mapped page — is measured as map + write of every byte + unmap, per page, with and without
populating: ``map_write_us_per_page`` / ``populated_map_write_us_per_page`` on handles mapped
before (their pages initialised, as with a pool that keeps ready handles), and
``fresh_map_write_us_per_page`` / ``populated_fresh_map_write_us_per_page`` on handles created
for the round (create + map + write + unmap + free: the elastic pool's path, where creating
the handle and zeroing its pages cost the same either way).
"""

from __future__ import annotations

import array
import ctypes as C
import platform
import time
from typing import Any


def best_seconds(fn, repeats: int) -> float:
    """The shortest of ``repeats`` timed calls of ``fn()``, in seconds (the benchmarks' rule)."""
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
        populate = int(driver.populate)  # the same mmap flags as the driver's maps

        def raw() -> None:
            rc = lib.hv_bench_raw_map_unmap(fd, va0, offs.buffer_info()[0], n, g, rounds, populate)
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


def check_map_fits(driver, pages: int) -> None:
    """Refuses (:class:`~xllm_vmm.bench.limits.BenchTooLarge`) a ``--pages`` whose handles do
    not fit in the driver's free memory: ``pages`` pages, twice on the host driver (the
    map+write measurement creates ``pages`` fresh handles while the first ones live)."""
    from xllm_vmm.bench.limits import check_fits

    g = driver.granularity
    copies = 2 if driver.name == "host" else 1
    free = driver.mem_info().free
    check_fits(copies * pages * g, free, option="--pages", value=pages,
               what=f"{copies} x {pages} pages of {g} bytes", most=free // (copies * g),
               where=f"the {driver.name} driver")


def run(driver, pages: int = 64, rounds: int = 20, repeats: int = 3) -> dict[str, Any]:
    """Measures the three ways on ``driver``; leaves nothing mapped or allocated."""
    if pages <= 0 or rounds <= 0 or repeats <= 0:
        raise ValueError(f"--pages, --rounds and --repeats must be positive (got {pages}, {rounds}, {repeats})")
    g = driver.granularity
    check_map_fits(driver, pages)
    va = driver.reserve(pages * g)
    handles = driver.create_handles(pages, g)
    vas = [va + i * g for i in range(pages)]
    can_populate = driver.name == "host"
    was = driver.populate if can_populate else False
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

        per = pages * rounds
        if can_populate:
            driver.populate = False
        raw = _raw_fn(driver, vas, handles, rounds)
        batched()  # warm-up
        t_batched = best_seconds(batched, repeats) / per * 1e6
        t_call = best_seconds(per_call, repeats) / per * 1e6
        t_raw = best_seconds(raw, repeats) / per * 1e6 if raw else None
        p_batched = p_raw = None
        writes: dict[str, float] = {}
        if can_populate:
            driver.populate = True
            p_raw_fn = _raw_fn(driver, vas, handles, rounds)
            batched()  # warm-up (the first population of a fallocated page also zeroes it)
            p_batched = best_seconds(batched, repeats) / per * 1e6
            p_raw = best_seconds(p_raw_fn, repeats) / per * 1e6
            writes = _map_write(driver, va, vas, handles, repeats)
    finally:
        if can_populate:
            driver.populate = was
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
        "populated_batched_us_per_page": p_batched,
        "populated_raw_us_per_page": p_raw,
        "populated_batched_vs_raw_ratio": p_batched / p_raw if p_raw else None,
        **writes,
    }


def _map_write(driver, va: int, vas: list[int], handles: list[int], repeats: int
               ) -> dict[str, float]:
    """Map + write every byte + unmap, µs per page, plain and populated, on these handles and
    on handles created for each round (host driver)."""
    g, n = driver.granularity, len(vas)

    def reused() -> None:
        driver.map_batch(vas, handles)
        C.memset(va, 0x5A, n * g)
        driver.unmap_batch(vas)

    def fresh() -> None:
        hs = driver.create_handles(n, g)
        try:
            driver.map_batch(vas, hs)
            C.memset(va, 0x5A, n * g)
            driver.unmap_batch(vas)
        finally:
            for h in hs:
                driver.free_handle(h)

    out: dict[str, float] = {}
    for populate, prefix in ((False, ""), (True, "populated_")):
        driver.populate = populate
        reused()  # warm-up
        out[f"{prefix}map_write_us_per_page"] = best_seconds(reused, repeats) / n * 1e6
        out[f"{prefix}fresh_map_write_us_per_page"] = best_seconds(fresh, repeats) / n * 1e6
    out["populate_map_write_speedup"] = (out["map_write_us_per_page"]
                                         / out["populated_map_write_us_per_page"])
    out["populate_fresh_map_write_speedup"] = (out["fresh_map_write_us_per_page"]
                                               / out["populated_fresh_map_write_us_per_page"])
    return out
