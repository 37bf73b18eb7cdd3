"""``xllm-vmm bench map``: the cost of mapping and unmapping 2 MiB pages through a driver.

Ways of doing the same map+unmap of ``pages`` pages, ``rounds`` times, in one process, timed
in interleaved repeats (best and median reported):

* ``batched``: one ``map_batch`` + one ``unmap_batch`` call per round (the pool's hot path),
  on *scattered* pages (every other page of the range, the handles permuted: no two
  neighbours contiguous in address or in the memfd);
* ``per_call``: one ``map`` / ``unmap`` Python call per page (scattered);
* ``raw``: the device calls with no bookkeeping — on the host a C loop doing exactly the
  per-page ``mmap`` system calls (scattered pages: the limit on this host); on ACL/CUDA the
  library's map/unmap functions called straight through ctypes;
* ``contiguous_batched``: on *contiguous* pages (address and memfd offset both increasing),
  the host driver's run records: one ``map_runs`` + one ``unmap_runs`` call per round on a
  batch prepared once (one record and one ``mmap`` per contiguous run, the bookkeeping still
  per handle; each call is one native call with one prebuilt pointer argument); other
  drivers: ``batched`` on those pages. ``contiguous_map_batch`` (host): the same pages
  through ``map_batch``/``unmap_batch`` with Python lists (arrays converted per call, the
  runs found in C);
* ``native_call_us`` (host): one ctypes call of a trivial native function, the fixed cost of
  every batched call;
* ``coalesced_raw`` (host): a C loop with one ``mmap`` per contiguous run and one for the
  unmap — the limit for contiguous pages.

Per-page costs are microseconds for one map plus one unmap. ``batched_vs_raw_ratio`` =
batched / raw (scattered); ``python_overhead_us_per_page`` = batched − raw per page (what the
driver adds above the system calls); ``batched_vs_coalesced_ratio`` = contiguous_batched /
coalesced_raw; ``coalescing_speedup`` = batched / contiguous_batched. Targets: ratio ≤ 1.2
and overhead ≤ 1 µs/page for batches of 64 or more; ``batched_vs_coalesced_ratio`` ≤ 1.5.
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

Release (host driver, ``--release-pages N``): unmap + free of N written 2 MiB pages, ms per
GiB, on each huge-page backing (``release_ms_per_gib_off`` / ``_thp`` / ``_hugetlb``, best and
median of interleaved repeats): what a light sleep costs per GiB. With ``--hugepages-setup``
(default; root only) the bench raises ``vm.nr_hugepages`` by N and sets
``shmem_enabled=advise`` for this measurement and restores both after it; a backing the
machine does not allow is ``None`` with ``release_skipped_<backing>`` saying why.
"""

from __future__ import annotations

import array
import contextlib
import ctypes as C
import platform
import statistics
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


def _raw_fn(driver, vas: list[int], handles: list[int], rounds: int, coalesced: bool = False):
    """The device calls with no bookkeeping (see the module docstring); ``coalesced`` (host
    driver only, ``vas`` contiguous): one ``mmap`` per run of handles contiguous in the memfd,
    and one for the unmap of the whole range. ``None`` where there is no such baseline."""
    if driver.name == "host":
        lib = driver._lib
        offs = array.array("Q", handles)
        addrs = array.array("Q", vas)
        fd, g, va0, n = driver.memfd, driver.granularity, vas[0], len(vas)
        populate = int(driver.populate)  # the same mmap flags as the driver's maps

        def raw() -> None:
            if coalesced:
                rc = lib.hv_bench_raw_map_unmap_coalesced(fd, va0, offs.buffer_info()[0], n, g,
                                                          rounds, populate)
            else:
                rc = lib.hv_bench_raw_map_unmap_at(fd, addrs.buffer_info()[0],
                                                   offs.buffer_info()[0], n, g, rounds,
                                                   populate)
            if rc:
                raise RuntimeError((lib.hv_last_error() or b"").decode())

        return raw
    if coalesced:
        return None
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


def runs_fn(driver, vas: list[int], handles: list[int], rounds: int):
    """``rounds`` of map_runs + unmap_runs on run records built once (the host driver's path
    for contiguous pages: no per-page work in Python)."""
    batch = driver.prepare_runs(vas, handles)
    map_runs, unmap_runs = driver.map_runs, driver.unmap_runs  # as a caller's hot loop would

    def runs() -> None:
        for _ in range(rounds):
            map_runs(batch)
            unmap_runs(batch)
    return runs


def native_call_us(driver, calls: int = 20000) -> float | None:
    """µs per ctypes call of a trivial native function (``hv_granule``) on the host driver:
    the fixed cost each batched call pays before the kernel does anything; best of 3."""
    if driver.name != "host":
        return None
    fn, pool = driver._lib.hv_granule, driver._pool

    def loop() -> None:
        for _ in range(calls):
            fn(pool)
    return best_seconds(loop, 3) / calls * 1e6


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


def interleaved_seconds(fns: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Each of ``fns`` timed once per repeat, the repeats interleaved (``a b c a b c ...``),
    so that a slow stretch of a shared machine hits every way alike; seconds per call."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
    return out


def scattered_order(n: int) -> list[int]:
    """A permutation of ``range(n)`` in which no entry is followed by its successor (evens,
    then odds; ``n == 2`` excepted): handles in this order never continue each other in the
    memfd, so no run coalesces."""
    return list(range(0, n, 2)) + list(range(1, n, 2))


def _time_ways(driver, va: int, vas: list[int], svas: list[int], handles: list[int],
               scattered: list[int], rounds: int, repeats: int) -> tuple:
    """Every way of :func:`run` timed on the reserved range (``vas`` contiguous, ``svas``
    scattered, µs per page): ``(best, median, populated batched, populated raw, map+write
    figures)`` — the populated figures and map + write on the host driver only (None and
    ``{}`` elsewhere). Sets the driver's ``populate``; the caller restores it."""
    can_populate = driver.name == "host"

    def batched_of(where, hs):
        map_batch, unmap_batch = driver.map_batch, driver.unmap_batch

        def batched() -> None:
            for _ in range(rounds):
                map_batch(where, hs)
                unmap_batch(where)
        return batched

    def per_call() -> None:
        for _ in range(rounds):
            for v, h in zip(svas, scattered):
                driver.map(v, h)
            for v in svas:
                driver.unmap(v)

    per = len(vas) * rounds
    if can_populate:
        driver.populate = False
    fns = {"batched": batched_of(svas, scattered), "per_call": per_call,
           "contiguous_batched": batched_of(vas, handles)}
    if hasattr(driver, "map_runs"):  # run records built once, passed as they are
        fns["contiguous_map_batch"] = fns["contiguous_batched"]
        fns["contiguous_batched"] = runs_fn(driver, vas, handles, rounds)
    raw = _raw_fn(driver, svas, scattered, rounds)
    if raw:
        fns["raw"] = raw
    coalesced = _raw_fn(driver, vas, handles, rounds, coalesced=True)
    if coalesced:
        fns["coalesced_raw"] = coalesced
    for fn in fns.values():  # warm-up
        fn()
    t = {k: [x / per * 1e6 for x in v] for k, v in interleaved_seconds(fns, repeats).items()}
    best = {k: min(v) for k, v in t.items()}
    med = {k: statistics.median(v) for k, v in t.items()}
    p_batched = p_raw = None
    writes: dict[str, float] = {}
    if can_populate:
        driver.populate = True
        pfns = {"batched": batched_of(svas, scattered),
                "raw": _raw_fn(driver, svas, scattered, rounds)}
        for fn in pfns.values():  # warm-up (the first population also zeroes the pages)
            fn()
        pt = interleaved_seconds(pfns, repeats)
        p_batched = min(pt["batched"]) / per * 1e6
        p_raw = min(pt["raw"]) / per * 1e6
        writes = _map_write(driver, va, vas, handles, repeats)
    return best, med, p_batched, p_raw, writes


def run(driver, pages: int = 64, rounds: int = 20, repeats: int = 3, release_pages: int = 0,
        hugepages_setup: bool = True) -> dict[str, Any]:
    """Measures the ways on ``driver``; leaves nothing mapped or allocated.

    On the host driver, ``release_pages`` > 0 adds :func:`release_speed` (unmap + release ms
    per GiB on each huge-page backing; ``hugepages_setup`` turns the huge pages on for it where
    this process may, and restores the settings) and ``backing`` names the driver's own.

    Two layouts of the same pages: *contiguous* (address and memfd offset both increasing,
    what a pool mapping a run of fresh pages does; the host driver maps each run with one
    ``mmap``) and *scattered* (every other page, the handles permuted: one system call per
    page each way on every path). The headline ratios are
    ``batched_vs_raw_ratio`` (scattered: batched against the per-page system-call loop) and
    ``batched_vs_coalesced_ratio`` (contiguous: batched against one ``mmap`` per contiguous
    run, ``coalesced_raw_us_per_page``), each the ratio of the best interleaved repeats, with
    their medians beside them."""
    if pages <= 0 or rounds <= 0 or repeats <= 0:
        raise ValueError(f"--pages, --rounds and --repeats must be positive (got {pages}, {rounds}, {repeats})")
    if release_pages < 0:
        raise ValueError(f"--release-pages must be >= 0 (got {release_pages})")
    g = driver.granularity
    check_map_fits(driver, pages)
    va = driver.reserve(2 * pages * g)
    handles = driver.create_handles(pages, g)
    vas = [va + i * g for i in range(pages)]  # contiguous
    svas = [va + 2 * i * g for i in range(pages)]  # scattered: every other page
    scattered = [handles[i] for i in scattered_order(pages)]
    can_populate = driver.name == "host"
    was = driver.populate if can_populate else False
    try:
        best, med, p_batched, p_raw, writes = _time_ways(
            driver, va, vas, svas, handles, scattered, rounds, repeats)
    finally:
        if can_populate:
            driver.populate = was
        for v in (va + i * g for i in range(2 * pages)):
            if getattr(driver, "is_mapped", None) and driver.is_mapped(v, g):
                driver.unmap(v)
        for h in handles:
            driver.free_handle(h)
        driver.release(va, 2 * pages * g)
    t_batched, t_call, t_raw = best["batched"], best["per_call"], best.get("raw")
    t_cb, t_co = best["contiguous_batched"], best.get("coalesced_raw")
    return {
        "device": driver.device_kind,
        "driver": driver.name,
        "machine": platform.machine(),
        "page_bytes": g,
        "pages": pages,
        "rounds": rounds,
        "repeats": repeats,
        "batched_us_per_page": t_batched,
        "per_call_us_per_page": t_call,
        "raw_us_per_page": t_raw,
        "batched_vs_raw_ratio": t_batched / t_raw if t_raw else None,
        "batched_vs_raw_ratio_median": med["batched"] / med["raw"] if t_raw else None,
        "per_call_vs_raw_ratio": t_call / t_raw if t_raw else None,
        "python_overhead_us_per_page": t_batched - t_raw if t_raw is not None else None,
        "batched_speedup_over_per_call": t_call / t_batched,
        "contiguous_batched_us_per_page": t_cb,
        "coalesced_raw_us_per_page": t_co,
        "batched_vs_coalesced_ratio": t_cb / t_co if t_co else None,
        "batched_vs_coalesced_ratio_median": (med["contiguous_batched"] / med["coalesced_raw"]
                                              if t_co else None),
        "coalescing_speedup": t_batched / t_cb,
        "contiguous_map_batch_us_per_page": best.get("contiguous_map_batch"),
        "native_call_us": native_call_us(driver),
        "populated_batched_us_per_page": p_batched,
        "populated_raw_us_per_page": p_raw,
        "populated_batched_vs_raw_ratio": p_batched / p_raw if p_raw else None,
        **writes,
        **({"backing": driver.hugepages} if driver.name == "host" else {}),
        **(release_speed(release_pages, repeats, hugepages_setup)
           if driver.name == "host" and release_pages else {}),
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


#: the huge-page backings ``release_speed`` measures, in report order
RELEASE_BACKINGS = ("off", "thp", "hugetlb")


def _release_once(driver, pages: int) -> float:
    """Creates ``pages`` handles, maps them contiguously, writes every byte (the memory really
    committed and touched, as weights or KV are), then times unmap_batch + free of every
    handle: seconds. Leaves nothing behind."""
    g = driver.granularity
    hs = driver.create_handles(pages, g)
    va = None
    try:
        va = driver.reserve(pages * g)
        vas = [va + i * g for i in range(pages)]
        driver.map_batch(vas, hs)
        C.memset(va, 0x5A, pages * g)
        t0 = time.perf_counter()
        driver.unmap_batch(vas)
        for h in hs:
            driver.free_handle(h)
        took = time.perf_counter() - t0
        hs = []
        return took
    finally:
        if va is not None:
            for i in range(pages):
                if driver.is_mapped(va + i * g, g):
                    driver.unmap(va + i * g)
        for h in hs:
            driver.free_handle(h)
        if va is not None:
            driver.release(va, pages * g)


def release_speed(pages: int = 128, repeats: int = 5, setup: bool = True) -> dict[str, Any]:
    """Unmap + release of ``pages`` written 2 MiB pages, ms per GiB, on each backing of the host
    driver (what a light sleep costs per GiB): ``release_ms_per_gib_{off,thp,hugetlb}`` (best
    of ``repeats``, the backings interleaved) and ``..._median``; a backing the machine does not
    allow is ``None`` with ``release_skipped_<backing>`` saying why. ``setup`` (root only): turn
    the huge pages on for the measurement (``vm.nr_hugepages`` raised by ``pages``,
    ``shmem_enabled=advise``) and restore the settings after it."""
    from xllm_vmm.vmm import hugepages as hp
    from xllm_vmm.vmm.host import HostDriver

    if pages <= 0 or repeats <= 0:
        raise ValueError(f"--release-pages and --repeats must be positive (got {pages}, {repeats})")
    gib = pages * 2 * 1024 * 1024 / 1024 ** 3
    out: dict[str, Any] = {"release_pages": pages}
    with contextlib.ExitStack() as stack:
        if setup:
            for name, enter in (("hugetlb", lambda: hp.extra_hugetlb_pages(pages)),
                                ("thp", hp.shmem_thp_advise)):
                try:
                    stack.enter_context(enter())
                except hp.SettingUnavailable as exc:
                    out[f"release_setup_{name}"] = str(exc)
        drivers = {}
        try:
            for backing in RELEASE_BACKINGS:
                try:
                    d = HostDriver(hugepages=backing)
                except Exception as exc:  # the machine forbids it: say why, measure the rest
                    out[f"release_skipped_{backing}"] = str(exc)
                    continue
                if d.mem_info().free < pages * d.granularity:
                    out[f"release_skipped_{backing}"] = (
                        f"{d.mem_info().free} bytes free for {pages} pages")
                    d.close()
                    continue
                drivers[backing] = d
            times: dict[str, list[float]] = {b: [] for b in drivers}
            for _ in range(repeats):
                for b, d in drivers.items():
                    times[b].append(_release_once(d, pages))
        finally:
            for d in drivers.values():
                d.close()
    for b in RELEASE_BACKINGS:
        t = times.get(b)
        out[f"release_ms_per_gib_{b}"] = min(t) * 1e3 / gib if t else None
        out[f"release_ms_per_gib_{b}_median"] = statistics.median(t) * 1e3 / gib if t else None
    return out
