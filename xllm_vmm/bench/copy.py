"""``xllm-vmm bench copy``: batched gather/scatter copies against one plain ``memcpy``.

``blocks`` blocks with sizes cycling through powers of two from ``min_block`` to ``max_block``
bytes (64 KiB to 2 MiB by default), each at a random offset inside its own 2 MiB page of a
mapped arena, in shuffled page order (scattered addresses). One ``copy_batch`` scatters them
from a contiguous host buffer (H2D) and one gathers them back (D2H); the baseline copies the
same total bytes with one ``memmove`` between the host buffer and the arena (host memory only)
or one driver copy of a contiguous range (devices).

Timing: ``repeats`` interleaved rounds (scatter, gather, baseline H2D, baseline D2H, then the
next round), so a slow stretch of a shared machine hits both sides of a round alike. Each
round gives one ratio; ``copy_vs_memcpy_ratio`` is their median (target ≥ 0.8), with the
rounds' minimum and maximum beside it (``copy_vs_memcpy_ratio_min``/``_max``); the
``*_gbps`` figures are medians too, and ``memcpy_gbps_min``/``_max`` show how much the
baseline itself moved (a single large memmove swings by 2× and more on a loaded host).
``copy_vs_memcpy_ratio_best`` is best batched over best baseline.
"""

from __future__ import annotations

import ctypes as C
import platform
import random
import statistics
from typing import Any

from xllm_vmm.bench.map import interleaved_seconds
from xllm_vmm.vmm.driver import CopyKind


def _size_cycle(min_block: int, max_block: int) -> list[int]:
    """min_block, 2·min_block, ..., up to max_block (powers of two apart; at most 64 entries)."""
    sizes, s = [], min_block
    while s <= max_block:
        sizes.append(s)
        s *= 2
    return sizes


def block_size(i: int, min_block: int, max_block: int) -> int:
    """Size of block ``i``: the sizes cycle min_block, 2·min_block, ..., max_block."""
    cycle = _size_cycle(min_block, max_block)
    return cycle[i % len(cycle)]


def total_bytes(blocks: int, min_block: int, max_block: int) -> int:
    """Bytes of ``blocks`` blocks with cycling sizes, computed without listing them (O(1) in
    ``blocks``: a refusal of a huge ``--blocks`` costs nothing)."""
    cycle = _size_cycle(min_block, max_block)
    full, rest = divmod(blocks, len(cycle))
    return full * sum(cycle) + sum(cycle[:rest])


#: Python-side bytes per block while the benchmark runs (addresses, offsets, sizes and the
#: native batch arrays, ~0.3 KiB measured), counted with a wide margin in the fit check.
PER_BLOCK_OVERHEAD = 1024

#: chunk of the data check: the host buffer is compared against a pattern buffer of this size
#: (``memcmp``), never copied into Python objects.
_CHECK_CHUNK = 1 << 20


def check_copy_fits(driver, blocks: int, total: int) -> None:
    """Refuses (:class:`~xllm_vmm.bench.limits.BenchTooLarge`) a ``--blocks`` that does not
    fit: one page per block on the device, a host buffer of every block's bytes and
    :data:`PER_BLOCK_OVERHEAD` of Python bookkeeping per block. The pages and the buffer come
    from the same host memory on the host driver and on the ACL emulation, and are checked
    together there (against the driver's free bytes and the host's headroom); on a real device
    the pages are checked against the device and the buffer against the host."""
    from xllm_vmm.bench.limits import check_fits, host_headroom

    g = driver.granularity
    free = driver.mem_info().free
    per_block = total / blocks + PER_BLOCK_OVERHEAD
    what = (f"{blocks} pages of {g} bytes + a host buffer of {total} bytes + "
            f"{blocks * PER_BLOCK_OVERHEAD} bytes of bookkeeping")
    need = blocks * g + total + blocks * PER_BLOCK_OVERHEAD
    if driver.name == "host":
        check_fits(need, free, option="--blocks", value=blocks, what=what,
                   most=int(free // (g + per_block)), where="the host driver")
        return
    room = host_headroom()
    if getattr(driver, "emulated", False):  # device pages are host memory too
        can = min(free, room)
        check_fits(need, can, option="--blocks", value=blocks, what=what,
                   most=int(can // (g + per_block)),
                   where=f"the {driver.name} emulation (host memory)")
        return
    check_fits(blocks * g, free, option="--blocks", value=blocks,
               what=f"{blocks} pages of {g} bytes", most=free // g,
               where=f"the {driver.name} driver")
    check_fits(need - blocks * g, room, option="--blocks", value=blocks,
               what=f"a host buffer of {total} bytes + {blocks * PER_BLOCK_OVERHEAD} bytes of "
                    f"bookkeeping", most=int(room // per_block), where="this host")


def _libc_memcmp():
    fn = C.CDLL(None).memcmp
    fn.argtypes = (C.c_void_p, C.c_void_p, C.c_size_t)
    fn.restype = C.c_int
    return fn


def buffer_is(ptr: int, nbytes: int, byte: int) -> bool:
    """True when every one of ``nbytes`` bytes at ``ptr`` equals ``byte``: ``memcmp`` chunk by
    chunk against a 1 MiB pattern buffer (no copy of the data into Python)."""
    chunk = min(nbytes, _CHECK_CHUNK)
    pattern = (C.c_char * max(1, chunk))()
    C.memset(pattern, byte, chunk)
    memcmp = _libc_memcmp()
    for off in range(0, nbytes, chunk):
        n = min(chunk, nbytes - off)
        if memcmp(ptr + off, pattern, n) != 0:
            return False
    return True


def run(driver, blocks: int = 128, min_block: int = 64 * 1024, max_block: int = 2 * 1024 * 1024,
        repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """Measures scatter (H2D) and gather (D2H) against the baseline; frees what it made."""
    g = driver.granularity
    if blocks <= 0 or repeats <= 0:
        raise ValueError(f"--blocks and --repeats must be positive (got {blocks}, {repeats})")
    if not (0 < min_block <= max_block <= g):
        raise ValueError(f"block sizes must satisfy 0 < --min-block <= --max-block <= {g} "
                         f"(got {min_block}, {max_block})")
    total = total_bytes(blocks, min_block, max_block)
    check_copy_fits(driver, blocks, total)  # before any per-block list is built
    rng = random.Random(seed)
    cycle = _size_cycle(min_block, max_block)
    sizes = [cycle[i % len(cycle)] for i in range(blocks)]
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
        t = interleaved_seconds({"s": scatter, "g": gather, "bh": base_h2d, "bd": base_d2h},
                                repeats)
        ok = True
        if driver.device_kind == "cpu" or getattr(driver, "emulated", False):
            C.memset(host, 0x11, total)
            scatter()
            C.memset(host, 0, total)
            gather()
            ok = buffer_is(host, total, 0x11)
    finally:
        driver.free_host(host)
        driver.unmap_batch(vas)
        for h in handles:
            driver.free_handle(h)
        driver.release(va, blocks * g)
    gbps = lambda t: total / t / 1e9  # noqa: E731
    med = {k: statistics.median(v) for k, v in t.items()}
    t_s, t_g, t_bh, t_bd = med["s"], med["g"], med["bh"], med["bd"]
    batched, baseline = gbps(t_s + t_g) * 2, gbps(t_bh + t_bd) * 2
    rounds = [(bh + bd) / (s + g) for s, g, bh, bd in zip(t["s"], t["g"], t["bh"], t["bd"])]
    base_rounds = [gbps(bh + bd) * 2 for bh, bd in zip(t["bh"], t["bd"])]
    best = (min(b + d for b, d in zip(t["bh"], t["bd"]))
            / min(s + g for s, g in zip(t["s"], t["g"])))
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
        "copy_vs_memcpy_ratio": statistics.median(rounds),
        "copy_vs_memcpy_ratio_min": min(rounds),
        "copy_vs_memcpy_ratio_max": max(rounds),
        "copy_vs_memcpy_ratio_best": best,
        "memcpy_gbps_min": min(base_rounds),
        "memcpy_gbps_max": max(base_rounds),
        "repeats": repeats,
        "data_verified": ok,
    }
