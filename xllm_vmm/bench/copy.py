"""``xllm-vmm bench copy``: batched gather/scatter copies against one plain ``memcpy``.

``blocks`` blocks with sizes cycling through powers of two from ``min_block`` to ``max_block``
bytes (64 KiB to 2 MiB by default), each at a random offset inside its own 2 MiB page of a
mapped arena, in shuffled page order (scattered addresses). One ``copy_batch`` scatters them
from a contiguous host buffer (H2D) and one gathers them back (D2H); the baseline copies the
same total bytes with one ``memmove`` between the host buffer and the arena (host memory only)
or one driver copy of a contiguous range (devices). Best of ``repeats``.
``copy_vs_memcpy_ratio`` = batched bandwidth / baseline bandwidth (target ≥ 0.8).
"""

from __future__ import annotations

import ctypes as C
import platform
import random
from typing import Any

from xllm_vmm.bench.map import best_seconds
from xllm_vmm.vmm.driver import CopyKind


def block_sizes(blocks: int, min_block: int, max_block: int) -> list[int]:
    """Sizes cycling min_block, 2·min_block, ..., max_block (powers of two apart)."""
    sizes, s = [], min_block
    while s <= max_block:
        sizes.append(s)
        s *= 2
    return [sizes[i % len(sizes)] for i in range(blocks)]


def check_copy_fits(driver, blocks: int, total: int) -> None:
    """Refuses (:class:`~xllm_vmm.bench.limits.BenchTooLarge`) a ``--blocks`` that does not
    fit: one page per block on the device, plus a host buffer of every block's bytes (from
    the same memory on the host driver)."""
    from xllm_vmm.bench.limits import check_fits, host_headroom

    g = driver.granularity
    free = driver.mem_info().free
    per_block = total / blocks
    if driver.name == "host":
        check_fits(blocks * g + total, free, option="--blocks", value=blocks,
                   what=f"{blocks} pages of {g} bytes + a host buffer of {total} bytes",
                   most=int(free // (g + per_block)), where="the host driver")
        return
    check_fits(blocks * g, free, option="--blocks", value=blocks,
               what=f"{blocks} pages of {g} bytes", most=free // g,
               where=f"the {driver.name} driver")
    room = host_headroom()
    check_fits(total, room, option="--blocks", value=blocks,
               what=f"a host buffer of {total} bytes", most=int(room // per_block),
               where="this host")


def run(driver, blocks: int = 128, min_block: int = 64 * 1024, max_block: int = 2 * 1024 * 1024,
        repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """Measures scatter (H2D) and gather (D2H) against the baseline; frees what it made."""
    g = driver.granularity
    if blocks <= 0 or repeats <= 0:
        raise ValueError(f"--blocks and --repeats must be positive (got {blocks}, {repeats})")
    if not (0 < min_block <= max_block <= g):
        raise ValueError(f"block sizes must satisfy 0 < --min-block <= --max-block <= {g} "
                         f"(got {min_block}, {max_block})")
    rng = random.Random(seed)
    sizes = block_sizes(blocks, min_block, max_block)
    total = sum(sizes)
    check_copy_fits(driver, blocks, total)
    va = driver.reserve(blocks * g)
    handles = driver.create_handles(blocks, g)
    vas = [va + i * g for i in range(blocks)]
    driver.map_batch(vas, handles)
    order = list(range(blocks))
    rng.shuffle(order)
    dev = [vas[order[i]] + rng.randrange(0, g - sizes[i] + 1, min_block) for i in range(blocks)]
    host = driver.alloc_host(total)
    try:
        offs, o = [], 0
        for s in sizes:
            offs.append(host + o)
            o += s
        C.memset(host, 0x5A, total)

        def scatter() -> None:
            driver.copy_batch(dev, offs, sizes, CopyKind.H2D)

        def gather() -> None:
            driver.copy_batch(offs, dev, sizes, CopyKind.D2H)

        if driver.device_kind == "cpu" or getattr(driver, "emulated", False):
            def base_h2d() -> None:
                C.memmove(va, host, total)

            def base_d2h() -> None:
                C.memmove(host, va, total)
        else:
            def base_h2d() -> None:
                driver.copy(va, host, total, CopyKind.H2D)

            def base_d2h() -> None:
                driver.copy(host, va, total, CopyKind.D2H)

        scatter(), gather(), base_h2d(), base_d2h()  # warm-up: every page faulted in
        t_s, t_g = best_seconds(scatter, repeats), best_seconds(gather, repeats)
        t_bh, t_bd = best_seconds(base_h2d, repeats), best_seconds(base_d2h, repeats)
        ok = True
        if driver.device_kind == "cpu" or getattr(driver, "emulated", False):
            C.memset(host, 0x11, total)
            scatter()
            C.memset(host, 0, total)
            gather()
            ok = C.string_at(host, total) == b"\x11" * total
    finally:
        driver.free_host(host)
        driver.unmap_batch(vas)
        for h in handles:
            driver.free_handle(h)
        driver.release(va, blocks * g)
    gbps = lambda t: total / t / 1e9  # noqa: E731
    batched, baseline = gbps(t_s + t_g) * 2, gbps(t_bh + t_bd) * 2
    return {
        "device": driver.device_kind,
        "driver": driver.name,
        "machine": platform.machine(),
        "blocks": blocks,
        "total_bytes": total,
        "min_block_bytes": min_block,
        "max_block_bytes": max_block,
        "scatter_h2d_gbps": gbps(t_s),
        "gather_d2h_gbps": gbps(t_g),
        "memcpy_h2d_gbps": gbps(t_bh),
        "memcpy_d2h_gbps": gbps(t_bd),
        "batched_gbps": batched,
        "memcpy_gbps": baseline,
        "copy_vs_memcpy_ratio": batched / baseline,
        "data_verified": ok,
    }
