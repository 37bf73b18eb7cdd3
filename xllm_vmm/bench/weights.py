"""``xllm-vmm bench weights``: load, light sleep, wakeup, deep sleep and fork of a checkpoint in
the VMM pool, on a checkpoint built locally (default about 1 GiB of bf16 in 4 shards) or a
model directory given.

Fields (seconds are wall-clock; ``*_seconds`` is the best of ``repeats``, ``*_median`` the
median):

- ``load_seconds``: ``load_weights`` into the pool — read the files into the host copy, map the
  region, copy host-to-device — with the files' page cache dropped first
  (``posix_fadvise(DONTNEED)``; ``page_cache_dropped`` says whether ``mincore`` then found the
  files out of the cache), i.e. a full reload from the safetensors files;
  ``load_warm_seconds`` with the files in page cache.
- ``light_sleep_seconds`` (and ``light_sleep_ms_per_gib``): unmap and release every weight page.
- ``sleep_released_fraction``: memory really released by a light sleep over the weight bytes —
  on the host driver the drop of this process's ``RssShmem``, elsewhere the driver's free
  memory rise (``sleep_released_measure`` names it). Target ≥ 0.99.
- ``wakeup_seconds`` (and ``wakeup_gib_per_s``): map + restore from the host copy.
- ``wakeup_vs_reload_ratio`` = ``wakeup_seconds / load_seconds`` (target ≤ 0.5);
  ``wakeup_vs_warm_reload_ratio`` against the warm-cache load.
- ``deep_wakeup_seconds``: wakeup after deep sleep (host copy dropped): reload from the files,
  page cache dropped first.
- ``fork_extra_weight_bytes``: pool-held bytes + host copy bytes (+ RssShmem on the host
  driver) a fork of the same checkpoint adds (0).
- ``cycle_growth_bytes``: growth of pool-held + host copy + RssShmem bytes over ``cycles``
  light/deep sleep-wake cycles (0); ``cycle_fd_growth`` and ``cycle_mapping_growth`` count
  file descriptors and memory mappings; ``cycle_rss_growth_bytes`` is informational (the
  Python heap moves by pages).
- ``bytes_identical``: every tensor byte equal to the first load's after all of the above.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from xllm_vmm.bench.limits import check_fits, check_range, host_headroom

_GiB = 1024 ** 3
_MiB = 1024 ** 2
_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32"}


def _status(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _count(path: str) -> int:
    try:
        if os.path.isdir(path):
            return len(os.listdir(path))
        with open(path) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def build_checkpoint(path: Path, size_bytes: int, shards: int, dtype: str) -> Path:
    """Writes about ``size_bytes`` of random ``dtype`` tensors (rows of 4096) as ``shards``
    safetensors files with an index (one file when ``shards`` is 1)."""
    import json

    import torch
    from safetensors.torch import save_file

    dt = getattr(torch, dtype)
    item = torch.empty((), dtype=dt).element_size()
    cols = 4096
    tensor_bytes = min(32 * _MiB, max(cols * item, size_bytes // max(8, shards)))
    rows = max(1, tensor_bytes // (cols * item))
    count = max(shards, -(-size_bytes // (rows * cols * item)))
    g = torch.Generator().manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "bench",
                                                  "tie_word_embeddings": False}))
    per = -(-count // shards)
    weight_map = {}
    for s in range(shards):
        names = [f"model.layers.{i}.weight" for i in range(s * per, min(count, (s + 1) * per))]
        if not names:
            continue
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {n: torch.randint(0, 256, (rows, cols * item), dtype=torch.uint8,
                                    generator=g).view(dt) for n in names}
        save_file(tensors, str(path / fname))
        weight_map.update({n: fname for n in names})
        del tensors
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _resident_fraction(path: Path) -> float | None:
    """Share of ``path``'s pages in the page cache (``mincore`` on a private mapping), or None
    when it cannot be read."""
    import ctypes
    import mmap

    try:
        size = path.stat().st_size
        if size == 0:
            return 0.0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        with open(path, "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            buf = (ctypes.c_char * size).from_buffer(m)
            try:
                rc = libc.mincore(ctypes.addressof(buf), size, vec)
            finally:
                del buf
        finally:
            m.close()
        if rc != 0:
            return None
        return sum(v & 1 for v in vec) / pages
    except (OSError, AttributeError, ValueError):
        return None


def drop_page_cache(model_dir: Path) -> bool:
    """Asks the kernel to drop the safetensors files' pages from its cache
    (``fsync`` + ``posix_fadvise(DONTNEED)``); True when ``mincore`` then finds less than 1 %
    of every file cached (not possible on tmpfs, or for pages mapped elsewhere)."""
    ok = True
    for f in model_dir.glob("*.safetensors"):
        try:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            ok = False
            continue
        left = _resident_fraction(f)
        ok = ok and left is not None and left < 0.01
    return ok


def _digest(weights) -> int:
    import torch

    crc = 0
    for name in sorted(weights):
        t = weights[name]
        crc = zlib.crc32(t.contiguous().view(-1).view(torch.uint8).cpu().numpy(), crc)
    return crc


def _summary(values: list[float]) -> tuple[float, float]:
    return min(values), statistics.median(values)


def run(driver, *, size_bytes: int = _GiB, shards: int = 4, dtype: str = "bf16",
        repeats: int = 3, cycles: int = 20, model_dir: str | None = None,
        workdir: str | None = None) -> dict[str, Any]:
    """Runs the benchmark on ``driver`` (see the module docstring); returns flat results."""
    from xllm_vmm.pool import BudgetConfig, VmmPool
    from xllm_vmm.weights import load_weights
    from xllm_vmm.weights.checkpoint import read_checkpoint

    check_range("--repeats", repeats, 1, 100)
    check_range("--cycles", cycles, 1, 10_000)
    check_range("--shards", shards, 1, 1024)
    if dtype.lower() not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(sorted(_DTYPES))}")
    tmp = None
    t0 = time.perf_counter()
    if model_dir is None:
        check_range("--size", size_bytes, _MiB, 1 << 40)
        # files + host copy + pool pages + the build's own tensors
        check_fits(3 * size_bytes + 64 * _MiB, host_headroom(), option="--size",
                   value=size_bytes, what="the checkpoint's page cache, the host copy and the "
                   "pool pages", where="the host")
        tmp = Path(tempfile.mkdtemp(prefix="xllm-vmm-bench-weights-", dir=workdir))
        model = build_checkpoint(tmp / "model", size_bytes, shards, _DTYPES[dtype.lower()])
    else:
        model = Path(model_dir)
    build_seconds = time.perf_counter() - t0
    ckpt = read_checkpoint(model)
    nbytes = ckpt.nbytes
    page = driver.granularity
    arena = (-(-nbytes // page) + 4 + len(ckpt.entries)) * page
    free = driver.mem_info().free
    check_fits(arena, free, option="--size", value=size_bytes, what="the weights' pages")
    pool = VmmPool(driver, BudgetConfig(execution_peak_bytes=0), arena)
    host = driver.name == "host"
    w = child = None
    try:
        cold = []
        dropped = True
        for _ in range(repeats):
            dropped = drop_page_cache(model) and dropped
            t = time.perf_counter()
            w = load_weights(model, pool=pool)
            cold.append(time.perf_counter() - t)
            w.close()
            w = None
            gc.collect()
        warm = []
        for _ in range(repeats):
            t = time.perf_counter()
            w = load_weights(model, pool=pool)
            warm.append(time.perf_counter() - t)
            if len(warm) < repeats:
                w.close()
                w = None
                gc.collect()
        want = _digest(w)
        device_bytes = w.device_bytes
        sleeps, wakes, fractions = [], [], []
        for _ in range(repeats):
            shmem, dev_free = _status("RssShmem"), driver.mem_info().free
            r = w.sleep(1)
            sleeps.append(r.seconds)
            if host:
                fractions.append((shmem - _status("RssShmem")) / nbytes)
            else:
                fractions.append((driver.mem_info().free - dev_free) / nbytes)
            wakes.append(w.wake_up().seconds)
        deep = []
        for _ in range(repeats):
            w.sleep(2)
            drop_page_cache(model)
            deep.append(w.wake_up().seconds)
        # fork
        held, host_copy, shmem = pool.held_bytes, w.host_copy_bytes, _status("RssShmem")
        child = w.fork()
        fork_extra = (pool.held_bytes - held) + (child.host_copy_bytes - host_copy)
        if host:
            fork_extra += _status("RssShmem") - shmem
        child.close()
        child = None
        # cycles
        for level in (1, 2):
            w.sleep(level)
            w.wake_up()
        gc.collect()

        def snap():
            return (pool.held_bytes + w.host_copy_bytes + _status("RssShmem"),
                    _count("/proc/self/fd"), _count("/proc/self/maps"), _status("VmRSS"))

        before = snap()
        for i in range(cycles):
            w.sleep(1 + i % 2)
            w.wake_up()
        gc.collect()
        after = snap()
        identical = _digest(w) == want
    finally:
        for x in (child, w):
            if x is not None:
                x.close()
        w = child = None
        gc.collect()
        pool.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    load, load_med = _summary(cold)
    load_warm, load_warm_med = _summary(warm)
    sleep_s, sleep_med = _summary(sleeps)
    wake_s, wake_med = _summary(wakes)
    deep_s, deep_med = _summary(deep)
    gib = nbytes / _GiB
    return {
        "driver": driver.name,
        "weight_bytes": nbytes,
        "device_bytes": device_bytes,
        "tensors": len(ckpt.entries),
        "files": len(ckpt.files),
        "repeats": repeats,
        "build_seconds": build_seconds,
        "page_cache_dropped": dropped,
        "load_seconds": load,
        "load_seconds_median": load_med,
        "load_warm_seconds": load_warm,
        "load_warm_seconds_median": load_warm_med,
        "light_sleep_seconds": sleep_s,
        "light_sleep_seconds_median": sleep_med,
        "light_sleep_ms_per_gib": sleep_s * 1000 / gib,
        "sleep_released_fraction": min(fractions),
        "sleep_released_measure": "RssShmem" if host else "mem_info.free",
        "wakeup_seconds": wake_s,
        "wakeup_seconds_median": wake_med,
        "wakeup_gib_per_s": gib / wake_s if wake_s > 0 else float("inf"),
        "wakeup_vs_reload_ratio": wake_s / load,
        "wakeup_vs_warm_reload_ratio": wake_s / load_warm,
        "deep_wakeup_seconds": deep_s,
        "deep_wakeup_seconds_median": deep_med,
        "fork_extra_weight_bytes": fork_extra,
        "cycles": cycles,
        "cycle_growth_bytes": after[0] - before[0],
        "cycle_fd_growth": after[1] - before[1],
        "cycle_mapping_growth": after[2] - before[2],
        "cycle_rss_growth_bytes": after[3] - before[3],
        "bytes_identical": identical,
    }
