"""``xllm-vmm bench weights``: load, light sleep, wakeup, deep sleep and fork of a checkpoint in
the VMM pool, on a checkpoint built locally (default about 1 GiB of bf16 in 4 shards) or a
model directory given; on the host driver once per huge-page backing asked for
(``--hugepages``, default ``hugetlb,thp,off``), in one run.

Fields (seconds are wall-clock; ``*_seconds`` is the best of ``repeats``, ``*_median`` the
median). The top-level fields are those of the first backing measured (``backing`` names it;
``backings`` lists every one measured); each backing's own figures are repeated under its name
(``hugetlb_light_sleep_ms_per_gib``, ``off_wakeup_vs_memcpy_ratio``, ...), and a backing the
machine could not give is ``<name>_backing = "unavailable: <why>"``.

- ``huge_page_fraction`` (host driver): the share of the loaded weights' pages this process
  maps with 2 MiB pages (``ShmemPmdMapped`` + hugetlb in ``/proc/self/smaps_rollup``): 1 for
  hugetlb, what the kernel found for THP (it falls back to 4 KiB pages when memory is
  fragmented), 0 for 4 KiB pages.
- ``load_seconds``: ``load_weights`` into the pool — read the files into the host copy, map the
  region, copy host-to-device — with the files' page cache dropped first
  (``posix_fadvise(DONTNEED)``; ``page_cache_dropped`` says whether ``mincore`` then found the
  files out of the cache), i.e. a full reload from the safetensors files;
  ``load_warm_seconds`` with the files in page cache.
- ``light_sleep_seconds`` (and ``light_sleep_ms_per_gib``): unmap and release every weight
  page (``ModelWeights.sleep(1)``). Its phases (:mod:`xllm_vmm.weights.phases`) of the best
  run: ``light_sleep_<phase>_seconds`` for ``sync``, ``unmap``, ``release``, ``other``.
- ``sleep_released_fraction``: memory really released by a light sleep over the weight bytes —
  on the host driver the drop of this process's ``RssShmem`` + ``HugetlbPages`` (hugetlb pages
  are not shmem), elsewhere the driver's free memory rise (``sleep_released_measure`` names it).
  Target ≥ 0.99.
- ``wakeup_seconds`` (and ``wakeup_gib_per_s``): map + restore from the host copy; phases of
  the best run: ``wakeup_<phase>_seconds`` for ``commit`` (creating the pages: the kernel
  allocates and zeroes them), ``map``, ``copy``, ``other``.
- ``memcpy_seconds``: the same bytes copied from the host copy into the region's pages while
  they are mapped and already written (the driver's batched host-to-device copy in the same
  chunks: on the host driver one native ``memcpy`` per chunk), best of ``repeats`` — the copy
  bandwidth a wakeup is limited by. ``wakeup_vs_memcpy_ratio`` = ``wakeup_seconds /
  memcpy_seconds`` (1 would be a wakeup at copy bandwidth); ``wakeup_copy_vs_memcpy_ratio`` the
  same for the wakeup's copy phase alone (first-touch page faults show here).
- ``wakeup_vs_reload_ratio`` = ``wakeup_seconds / load_seconds`` (target ≤ 0.5);
  ``wakeup_vs_warm_reload_ratio`` against the warm-cache load.
- ``deep_wakeup_seconds``: wakeup after deep sleep (host copy dropped): reload from the files,
  page cache dropped first.
- ``engine_light_sleep_seconds`` / ``engine_wakeup_seconds`` (with ``--kv-size`` > 0): the
  engine's sleep (``LLMEngine.sleep`` is a :class:`~xllm_vmm.weights.SleepController` over the
  weights and the KV cache manager): the weights plus a prefix-cached KV cache of
  ``kv_bytes`` in the same pool, with ``engine_kv_sleep_seconds`` (the KV manager's part:
  dropping its cached blocks and releasing their pages), ``engine_bytes_freed`` and
  ``engine_light_sleep_ms_per_gib`` over the weights + KV bytes.
- ``fork_extra_weight_bytes``: pool-held bytes + host copy bytes (+ RssShmem + HugetlbPages on
  the host driver) a fork of the same checkpoint adds (0).
- ``cycle_growth_bytes``: growth of pool-held + host copy + RssShmem + HugetlbPages bytes over
  ``cycles`` sleep-wake cycles, every fourth deep (0; the backings after the first run a
  quarter of them, at least 2: ``<name>_cycles``); ``cycle_fd_growth`` and
  ``cycle_mapping_growth`` count file descriptors and memory mappings;
  ``cycle_rss_growth_bytes`` is informational (the Python heap moves by pages).
- ``bytes_identical``: every tensor byte equal to the first load's after all of the above.

Machine settings: ``hugetlb`` needs free 2 MiB huge pages and ``thp`` shmem THP
(:mod:`xllm_vmm.vmm.hugepages`); where they are off and the bench runs as root, it raises
``vm.nr_hugepages`` by what the pool needs / sets ``shmem_enabled=advise`` for that backing's
measurement only and restores the previous value after it (``<name>_setting`` says what it
changed); otherwise that backing is reported unavailable with the setting to change.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

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


#: phases of a light sleep and of a wakeup reported as fields (:mod:`xllm_vmm.weights.phases`)
_SLEEP_FIELDS = ("sync", "unmap", "release", "other")
_WAKE_FIELDS = ("commit", "map", "copy", "other")
#: the fields repeated under each backing's name
_PER_BACKING = (
    "backing", "setting", "huge_page_fraction", "light_sleep_ms_per_gib", "light_sleep_seconds",
    "light_sleep_unmap_seconds", "light_sleep_release_seconds", "sleep_released_fraction",
    "wakeup_seconds", "wakeup_commit_seconds", "wakeup_map_seconds", "wakeup_copy_seconds",
    "memcpy_seconds", "wakeup_vs_memcpy_ratio", "wakeup_vs_reload_ratio", "load_seconds",
    "deep_wakeup_seconds", "engine_light_sleep_ms_per_gib", "engine_kv_sleep_seconds",
    "engine_wakeup_seconds", "fork_extra_weight_bytes", "cycles", "cycle_growth_bytes",
    "bytes_identical")
#: the backings ``--hugepages`` accepts (``auto``: whatever the driver picks as the machine is)
BACKINGS = ("hugetlb", "thp", "off", "auto")
DEFAULT_BACKINGS = "hugetlb,thp,off"
_KV_BLOCK_TOKENS = 16
_KV_TENSORS = 4  # two layers, K and V


def parse_backings(text: str) -> tuple[str, ...]:
    """``--hugepages`` as a tuple of distinct backings, in the order given; ValueError naming
    the option otherwise."""
    out: list[str] = []
    for part in str(text).split(","):
        mode = part.strip().lower()
        if mode not in BACKINGS:
            raise ValueError(f"--hugepages {text!r}: {part.strip()!r} is not one of "
                             f"{', '.join(BACKINGS)} (a comma-separated list measures each)")
        if mode not in out:
            out.append(mode)
    return tuple(out)


def _summary(values: list[float]) -> tuple[float, float]:
    return min(values), statistics.median(values)


def _held_host_memory() -> int:
    """This process's shmem and hugetlb pages (bytes): where host driver handles live."""
    return _status("RssShmem") + _status("HugetlbPages")


def _huge_mapped_bytes() -> int:
    """Bytes this process maps with 2 MiB pages of shmem (THP) or hugetlb (``smaps_rollup``)."""
    total = 0
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith(("ShmemPmdMapped:", "Shared_Hugetlb:", "Private_Hugetlb:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


def _best(reports: list) -> Any:
    return min(reports, key=lambda r: r.seconds)


def _memcpy_seconds(w, driver) -> float:
    """One copy of the image from the host copy into the region while it is mapped and
    written: the chunks and the call a wakeup's copy uses (see the module docstring)."""
    from xllm_vmm.vmm.driver import CopyKind

    store = w._store  # the bench measures the store's own copy path on its own buffers
    vas, offs, sizes = store._chunks(0, store.image.nbytes)
    t = time.perf_counter()
    driver.copy_batch(vas, [store.host_addr + o for o in offs], sizes, CopyKind.H2D)
    driver.synchronize()
    return time.perf_counter() - t


def _kv_layout(kv_bytes: int, page: int):
    """A two-layer K/V layout whose ``kv_bytes`` fill whole pages of every tensor."""
    from xllm_vmm.models.spec import CacheGroup, CacheLayout, CacheTensor

    per_token = page // 4 // _KV_BLOCK_TOKENS  # four blocks per page
    tensors = tuple(CacheTensor(f"layer{i}.{kv}", per_token) for i in range(2) for kv in "kv")
    layout = CacheLayout("bench-weights", 1, (CacheGroup("attn", tensors, _KV_BLOCK_TOKENS),))
    block = per_token * _KV_BLOCK_TOKENS * _KV_TENSORS  # bytes of one block, all tensors
    blocks = max(1, kv_bytes // block)
    return layout, blocks


def _fill_kv(kv, blocks: int, n: int) -> None:
    """One request of ``blocks`` full blocks and one token more (capacity: ``blocks + 1``),
    committed and freed: its full blocks stay mapped as cached prefixes (what a sleep has to
    drop)."""
    tokens = [(n * 7919 + i) % 50_000 for i in range(blocks * _KV_BLOCK_TOKENS + 1)]
    rid = f"bench-{n}"
    hit = kv.lookup(rid, tokens)
    if kv.allocate(rid, len(tokens) - hit.num_tokens, hit=hit) is None:
        raise RuntimeError(f"the KV cache could not take {blocks} blocks for the engine sleep "
                           "measurement; lower --kv-size")
    kv.commit(rid, len(tokens), tokens)
    kv.free(rid)


def _time_loads(model: Path, pool, repeats: int) -> tuple[list[float], list[float], bool, Any]:
    """Cold loads (page cache dropped before each) and warm loads of ``model`` into ``pool``,
    ``repeats`` of each after one untimed first load: ``(cold, warm, dropped, weights)`` —
    ``dropped`` whether every drop worked, ``weights`` the last warm load, left open."""
    from xllm_vmm.weights import load_weights

    w = None
    try:
        # an untimed first load: first use of the memory (a fresh hugetlb pool is slow once)
        load_weights(model, pool=pool).close()
        gc.collect()
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
    except BaseException:
        if w is not None:
            w.close()
        raise
    return cold, warm, dropped, w


def _time_sleeps(w, driver, model: Path, nbytes: int, repeats: int, host: bool
                 ) -> tuple[list, list, list[float], list[float], list[float]]:
    """``(light sleeps, their wakeups, released fractions, memcpy seconds, deep wakeup
    seconds)``, ``repeats`` of each: a memcpy of the weights' bytes before every light sleep;
    the released fraction from the host's held memory (host driver) or the device's free
    memory; deep wakeups with the page cache dropped."""
    sleeps, wakes, fractions, copies = [], [], [], []
    for _ in range(repeats):
        copies.append(_memcpy_seconds(w, driver))
        held, dev_free = _held_host_memory(), driver.mem_info().free
        r = w.sleep(1)
        sleeps.append(r)
        if host:
            fractions.append((held - _held_host_memory()) / nbytes)
        else:
            fractions.append((driver.mem_info().free - dev_free) / nbytes)
        wakes.append(w.wake_up())
    deep = []
    for _ in range(repeats):
        w.sleep(2)
        drop_page_cache(model)
        deep.append(w.wake_up().seconds)
    return sleeps, wakes, fractions, copies, deep


def _engine_sleep_figures(pool, w, kv_layout, kv_blocks: int, nbytes: int,
                          repeats: int) -> dict[str, Any]:
    """The ``engine_*`` figures: the weights slept and woken together with a KV cache of
    ``kv_blocks`` prefix-cached blocks (one :class:`~xllm_vmm.weights.SleepController`)."""
    from xllm_vmm.kvcache import build_kv_cache_manager
    from xllm_vmm.weights import SleepController

    kv = build_kv_cache_manager(pool, kv_layout, enable_prefix_cache=True,
                                max_tokens=(kv_blocks + 1) * _KV_BLOCK_TOKENS, compact=False)
    try:
        ctl = SleepController(w, [kv])
        esleeps, ewakes = [], []
        for i in range(repeats):
            _fill_kv(kv, kv_blocks, i)
            esleeps.append(ctl.sleep(1))
            ewakes.append(ctl.wake_up())
    finally:
        kv.close()
    best = _best(esleeps)
    gib_all = (nbytes + best.tenants_bytes_freed) / _GiB
    return {
        "kv_bytes": best.tenants_bytes_freed,
        "engine_light_sleep_seconds": best.seconds,
        "engine_light_sleep_seconds_median": statistics.median(r.seconds for r in esleeps),
        "engine_light_sleep_ms_per_gib": best.seconds * 1000 / gib_all,
        "engine_kv_sleep_seconds": best.phases.get("tenants", 0.0),
        "engine_bytes_freed": best.bytes_freed,
        "engine_wakeup_seconds": min(r.seconds for r in ewakes),
    }


def _fork_extra_bytes(pool, w, host: bool) -> int:
    """What a fork of the weights adds: pool bytes, host copies and (host driver) host memory."""
    held, host_copy, shmem = pool.held_bytes, w.host_copy_bytes, _held_host_memory()
    child = w.fork()
    try:
        fork_extra = (pool.held_bytes - held) + (child.host_copy_bytes - host_copy)
        if host:
            fork_extra += _held_host_memory() - shmem
    finally:
        child.close()
    return fork_extra


def _cycle_snapshots(pool, w, cycles: int) -> tuple[tuple, tuple]:
    """``(before, after)`` ``cycles`` sleep/wake cycles (every fourth deep), after one cycle
    of each level first: held bytes, open files, mappings and resident bytes."""
    for level in (1, 2):
        w.sleep(level)
        w.wake_up()
    gc.collect()

    def snap():
        return (pool.held_bytes + w.host_copy_bytes + _held_host_memory(),
                _count("/proc/self/fd"), _count("/proc/self/maps"), _status("VmRSS"))

    before = snap()
    for i in range(cycles):
        w.sleep(2 if i % 4 == 3 else 1)  # every fourth cycle deep (a reload from the files)
        w.wake_up()
    gc.collect()
    return before, snap()


def measure(driver, model: Path, *, repeats: int, cycles: int, kv_bytes: int = 0) -> dict[str, Any]:
    """Every figure of the module docstring for ``model`` on ``driver`` (flat results)."""
    from xllm_vmm.pool import BudgetConfig, VmmPool
    from xllm_vmm.weights.checkpoint import read_checkpoint

    ckpt = read_checkpoint(model)
    nbytes = ckpt.nbytes
    page = driver.granularity
    kv_layout, kv_blocks = _kv_layout(kv_bytes, page) if kv_bytes > 0 else (None, 0)
    kv_pages = -(-(kv_blocks + 1) // 4) * _KV_TENSORS if kv_bytes > 0 else 0
    arena = (-(-nbytes // page) + 4 + len(ckpt.entries) + kv_pages + 2 * _KV_TENSORS) * page
    free = driver.mem_info().free
    check_fits(arena, free, option="--size", value=nbytes, what="the weights' (and KV) pages")
    pool = VmmPool(driver, BudgetConfig(execution_peak_bytes=0), arena)
    host = driver.name == "host"
    w = None
    try:
        cold, warm, dropped, w = _time_loads(model, pool, repeats)
        want = _digest(w)
        device_bytes = w.device_bytes
        huge = min(1.0, _huge_mapped_bytes() / device_bytes) if host else None
        sleeps, wakes, fractions, copies, deep = _time_sleeps(w, driver, model, nbytes,
                                                              repeats, host)
        engine = ({} if kv_layout is None else
                  _engine_sleep_figures(pool, w, kv_layout, kv_blocks, nbytes, repeats))
        fork_extra = _fork_extra_bytes(pool, w, host)
        before, after = _cycle_snapshots(pool, w, cycles)
        identical = _digest(w) == want
    finally:
        if w is not None:
            w.close()
        w = None
        gc.collect()
        pool.close()
    load, load_med = _summary(cold)
    load_warm, load_warm_med = _summary(warm)
    sleep, wake = _best(sleeps), _best(wakes)
    deep_s, deep_med = _summary(deep)
    memcpy = min(copies)
    gib = nbytes / _GiB
    out: dict[str, Any] = {
        "driver": driver.name,
        "backing": getattr(driver, "hugepages", "device"),
        **({"huge_page_fraction": huge} if huge is not None else {}),
        "weight_bytes": nbytes,
        "device_bytes": device_bytes,
        "tensors": len(ckpt.entries),
        "files": len(ckpt.files),
        "repeats": repeats,
        "page_cache_dropped": dropped,
        "load_seconds": load,
        "load_seconds_median": load_med,
        "load_warm_seconds": load_warm,
        "load_warm_seconds_median": load_warm_med,
        "light_sleep_seconds": sleep.seconds,
        "light_sleep_seconds_median": statistics.median(r.seconds for r in sleeps),
        "light_sleep_ms_per_gib": sleep.seconds * 1000 / gib,
        **{f"light_sleep_{p}_seconds": sleep.phases.get(p, 0.0) for p in _SLEEP_FIELDS},
        "sleep_released_fraction": min(fractions),
        "sleep_released_measure": "RssShmem+HugetlbPages" if host else "mem_info.free",
        "wakeup_seconds": wake.seconds,
        "wakeup_seconds_median": statistics.median(r.seconds for r in wakes),
        **{f"wakeup_{p}_seconds": wake.phases.get(p, 0.0) for p in _WAKE_FIELDS},
        "wakeup_gib_per_s": gib / wake.seconds if wake.seconds > 0 else float("inf"),
        "memcpy_seconds": memcpy,
        "memcpy_gib_per_s": gib / memcpy if memcpy > 0 else float("inf"),
        "wakeup_vs_memcpy_ratio": wake.seconds / memcpy,
        "wakeup_copy_vs_memcpy_ratio": wake.phases.get("copy", 0.0) / memcpy,
        "wakeup_vs_reload_ratio": wake.seconds / load,
        "wakeup_vs_warm_reload_ratio": wake.seconds / load_warm,
        "deep_wakeup_seconds": deep_s,
        "deep_wakeup_seconds_median": deep_med,
        **engine,
        "fork_extra_weight_bytes": fork_extra,
        "cycles": cycles,
        "cycle_growth_bytes": after[0] - before[0],
        "cycle_fd_growth": after[1] - before[1],
        "cycle_mapping_growth": after[2] - before[2],
        "cycle_rss_growth_bytes": after[3] - before[3],
        "bytes_identical": identical,
    }
    return out


def _check_options(repeats: int, cycles: int, shards: int, dtype: str) -> None:
    check_range("--repeats", repeats, 1, 100)
    check_range("--cycles", cycles, 1, 10_000)
    check_range("--shards", shards, 1, 1024)
    if dtype.lower() not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(sorted(_DTYPES))}")


@contextlib.contextmanager
def _model(size_bytes: int, shards: int, dtype: str, model_dir: str | None,
           workdir: str | None) -> Iterator[tuple[Path, float]]:
    """(the model directory, seconds to build it): ``model_dir``, or a checkpoint built in a
    temporary directory removed afterwards."""
    if model_dir is not None:
        yield Path(model_dir), 0.0
        return
    check_range("--size", size_bytes, _MiB, 1 << 40)
    # files + host copy + pool pages + the build's own tensors
    check_fits(3 * size_bytes + 64 * _MiB, host_headroom(), option="--size",
               value=size_bytes, what="the checkpoint's page cache, the host copy and the "
               "pool pages", where="the host")
    tmp = Path(tempfile.mkdtemp(prefix="xllm-vmm-bench-weights-", dir=workdir))
    try:
        t0 = time.perf_counter()
        model = build_checkpoint(tmp / "model", size_bytes, shards, _DTYPES[dtype.lower()])
        yield model, time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(driver, *, size_bytes: int = _GiB, shards: int = 4, dtype: str = "bf16",
        repeats: int = 3, cycles: int = 20, model_dir: str | None = None,
        workdir: str | None = None, kv_size: int = 0) -> dict[str, Any]:
    """Runs the benchmark on ``driver`` (one backing: the driver's own); flat results."""
    _check_options(repeats, cycles, shards, dtype)
    with _model(size_bytes, shards, dtype, model_dir, workdir) as (model, build):
        out = measure(driver, model, repeats=repeats, cycles=cycles, kv_bytes=kv_size)
    return {"build_seconds": build, **out}


@contextlib.contextmanager
def _backing_allowed(mode: str, need_bytes: int) -> Iterator[str]:
    """Makes the machine allow ``mode`` for the ``with`` block and keeps it so: as root, under
    :mod:`xllm_vmm.vmm.hugepages`' machine-wide settings lock held for the whole block (a test
    or bench that enabled the setting for itself cannot restore it under this measurement),
    raising ``vm.nr_hugepages`` by what is missing / setting ``shmem_enabled=advise`` when
    off, and restoring after. Yields what was changed (``""`` for nothing). Raises
    ``hugepages.SettingUnavailable`` with the reason when the machine cannot give the
    backing; without root a backing already allowed is used as it is."""
    from xllm_vmm.vmm import hugepages as hp

    if mode not in ("hugetlb", "thp"):
        yield ""
        return
    changed: list = []
    if mode == "hugetlb":
        need = -(-need_bytes // hp.HUGE_PAGE)

        def raised(old: str) -> str:  # read under the lock
            changed.append(max(0, need - hp.hugetlb_memory().free // hp.HUGE_PAGE))
            return str(int(old or 0) + changed[0])

        setting = hp.machine_setting(  # restored relatively, like extra_hugetlb_pages
            hp.NR_HUGEPAGES, raised, lambda old, cur: str(max(int(old or 0),
                                                              int(cur or 0) - changed[0])))
        allowed = lambda: hp.hugetlb_memory().free >= need_bytes  # noqa: E731
    else:
        setting = hp.machine_setting(
            hp.SHMEM_ENABLED,
            lambda old: old if old in hp.THP_SHMEM_ALLOWING else changed.append(old) or "advise")
        allowed = hp.thp_shmem_allowed
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(setting)
        except hp.SettingUnavailable:
            if not allowed():  # not root: usable only as the machine already is
                raise
        if mode == "hugetlb":
            pages = hp.hugetlb_memory().free // hp.HUGE_PAGE
            if pages < need:
                raise hp.SettingUnavailable(
                    f"the kernel found {pages} free 2 MiB huge pages of the {need} the pool "
                    "needs (memory fragmented?)")
            yield f"vm.nr_hugepages +{changed[0]} for this measurement" if changed and changed[0] else ""
        else:
            yield f"shmem_enabled {changed[0]} -> advise for this measurement" if changed else ""


def run_host(backings: tuple[str, ...] = ("hugetlb", "thp", "off"), *, size_bytes: int = _GiB,
             shards: int = 4, dtype: str = "bf16", repeats: int = 3, cycles: int = 20,
             model_dir: str | None = None, workdir: str | None = None, kv_size: int = 0,
             device_index: int = 0) -> dict[str, Any]:
    """The host driver once per backing of ``backings`` on one checkpoint (see the module
    docstring); the first backing measured gives the top-level fields."""
    from xllm_vmm.vmm import hugepages as hp
    from xllm_vmm.vmm import open_driver

    _check_options(repeats, cycles, shards, dtype)
    if not backings:
        raise ValueError("--hugepages names no backing")
    out: dict[str, Any] = {}
    measured: list[str] = []
    with _model(size_bytes, shards, dtype, model_dir, workdir) as (model, build):
        from xllm_vmm.weights.checkpoint import read_checkpoint

        nbytes = read_checkpoint(model).nbytes
        page = hp.HUGE_PAGE
        need = (-(-nbytes // page) + 8 + len(read_checkpoint(model).entries)) * page \
            + (-(-kv_size // page) + 8) * page
        for mode in backings:
            try:
                with _backing_allowed(mode, need) as setting:
                    d = open_driver("host", device_index=device_index, hugepages=mode)
                    try:
                        n = cycles if not measured else max(2, cycles // 4)
                        r = measure(d, model, repeats=repeats, cycles=n, kv_bytes=kv_size)
                    finally:
                        d.close()
            except hp.SettingUnavailable as exc:
                out[f"{mode}_backing"] = f"unavailable: {exc}"
                continue
            r["setting"] = setting
            if not measured:
                out.update(r)
            measured.append(mode)
            for key in _PER_BACKING:
                if key in r:
                    out[f"{mode}_{key}"] = r[key]
    if not measured:
        raise RuntimeError("no backing could be measured: " + "; ".join(
            f"{k[:-8]}: {v}" for k, v in out.items() if k.endswith("_backing")))
    out["build_seconds"] = build
    out["backings"] = ",".join(measured)
    return out
