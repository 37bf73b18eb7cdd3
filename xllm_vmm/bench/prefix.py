"""``xllm-vmm bench prefix``: the prefix cache and the host KV tier, each against a baseline
measured in the same run.

- ``hash_vs_sha256_ratio``: tokens per second of the XXH3-128 block chain over those of a
  SHA-256 chain over the same block bytes (the common default elsewhere). Both time the chain
  over already packed uint32 token bytes; ``hash_e2e_vs_sha256_ratio`` also includes packing a
  Python token list (identical work for both, so it pulls the ratio towards 1). Target ≥ 2.
- ``lookup_us_1k`` / ``lookup_us_1m``: the cost of one request's lookup (a 64-block prompt,
  half of it a hit) with 1,024 and 1,048,576 blocks cached. The index is filled directly with
  the state that publishing those blocks leaves (:func:`populate_index`: about a second and
  ~200 MiB for 1M blocks, where one ``publish`` call per block would take several seconds).
  ``--lookup-blocks`` sets the large size (default 1,048,576; the CI smoke test uses a small
  one); ``lookup_1m_measured_at_blocks`` says what it was.
- A shared-prefix workload under device memory pressure on the real stack (driver → elastic
  pool with a ``max_cache_size`` quota below the working set → the
  :class:`~xllm_vmm.kvcache.KVCacheManager` that ``build_kv_cache_manager`` makes, every
  request through its verbs): ``hit_rate_device_only`` (prefix-cache hit tokens / prompt tokens
  without the host tier), ``hit_rate_with_host`` (device hits + restored tokens, with
  ``host_blocks_factor``), ``host_hit_rate_gain`` (their difference), ``host_restores``.
  Each request's write-through finishes before the next request allocates, so these counts
  are the same on every run of a seed (timing moves only the bandwidth figures).
- ``restore_vs_memcpy_ratio``: bytes per second of the tier's batched host→device restores in
  that workload (from the start of the restore's copy — ``allocate`` prepares it,
  ``wait_ready`` right after runs it on the waiting thread — to the end of ``wait_ready``) over
  ``memmove`` of the same bytes — one ``memmove`` per restore, of that restore's size, timed
  right after it (interleaved) — from a driver host buffer into mapped pages of the same
  driver whose page tables are present (the kind of destination a restore writes, at its
  best). ``restore_with_map_vs_memcpy_ratio`` also counts the time from the start of
  ``allocate`` to the copy's start (mapping the request's new pages, with any eviction, and
  preparing the restore), i.e. the
  total cost of a restore into newly mapped blocks. The workload's driver populates mappings
  (``populate=True``, host driver); on the host driver the workload runs a second time without
  it, for ``restore_unpopulated_vs_memcpy_ratio`` and
  ``restore_unpopulated_with_map_vs_memcpy_ratio`` (the first writes into a freshly mapped page
  then take page faults).
- ``offload_vs_memcpy_ratio``: one batched device→host copy of every cached block over one
  ``memmove`` of the same number of bytes between two host buffers.
- ``bytes_freed_per_eviction_ratio``: physical bytes released per evicted block by
  slot-emptying eviction over plain LRU, on a fragmented cache (decode-style interleaving:
  every slot holds blocks of 8 requests; an eighth of the requests still run, the rest finished
  in random order). Each policy evicts one slot's worth of blocks at a time until half of the
  slots that hold no live block have been released.
"""

from __future__ import annotations

import ctypes
import random
import time
from array import array
from dataclasses import dataclass
from typing import Any

from xllm_vmm.kvcache.hashing import (
    block_hashes,
    chain_digests,
    sha256_block_hashes,
    sha256_chain_digests,
)
from xllm_vmm.bench.map import best_seconds
from xllm_vmm.kvcache.prefix import PrefixCache

__all__ = ["PrefixBenchConfig", "run_prefix_bench"]

_MiB = 1 << 20


@dataclass(frozen=True)
class PrefixBenchConfig:
    """Sizes of every part (tokens, blocks, bytes). The defaults run in a few seconds."""

    driver: str = "host"
    block_size: int = 128  # tokens per block (the block_size flag's default)
    hash_tokens: int = 1 << 19
    lookup_small_blocks: int = 1024
    lookup_blocks: int = 1 << 20  # the "1M" point
    lookup_prompt_blocks: int = 64
    lookup_iterations: int = 2000
    # shared-prefix workload
    system_prompts: int = 6
    system_prompt_blocks: int = 12
    suffix_blocks: int = 2
    requests: int = 120
    device_budget_slots: int = 4  # max_cache_size in slots; the working set is larger
    host_blocks_factor: float = 4.0
    populate: bool = True  # host driver: populate KV slot mappings at map time
    tensor_block_bytes: int = 256 * 1024  # per tensor (K and V): 8 blocks per 2 MiB page
    # eviction comparison
    evict_requests: int = 64
    evict_blocks_per_request: int = 8
    seed: int = 0


def _rate(f, *args) -> float:
    """Best-of-3 seconds for one call."""
    return best_seconds(lambda: f(*args), 3)


def _hash_bench(cfg: PrefixBenchConfig, rng: random.Random) -> dict[str, Any]:
    toks = [rng.randrange(152_000) for _ in range(cfg.hash_tokens)]
    buf = array("I", toks).tobytes()
    t_x = _rate(chain_digests, buf, cfg.block_size)
    t_s = _rate(sha256_chain_digests, buf, cfg.block_size)
    e_x = _rate(block_hashes, toks, cfg.block_size)
    e_s = _rate(sha256_block_hashes, toks, cfg.block_size)
    return {
        "hash_tokens_per_s": cfg.hash_tokens / t_x,
        "sha256_tokens_per_s": cfg.hash_tokens / t_s,
        "hash_vs_sha256_ratio": t_s / t_x,
        "hash_e2e_vs_sha256_ratio": e_s / e_x,
    }


def populate_index(prefix: PrefixCache, hashes: list[int]) -> None:
    """Index block ``i`` under ``hashes[i]`` in every group of an empty ``prefix``: the state
    ``prefix.publish({g: range(n) for g}, hashes)`` leaves for distinct hashes (blocks still
    referenced, none in the LRU), built with one dict construction per map instead of one
    publish step per block. For the lookup benchmark only."""
    n = len(hashes)
    for g in prefix._groups.values():  # noqa: SLF001 - the bench fills the index directly
        if g.hash_to_block or g.block_hash:
            raise ValueError("populate_index needs an empty prefix cache")
        g.hash_to_block = dict(zip(hashes, range(n)))
        g.block_hash = dict(zip(range(n), hashes))
        if len(g.hash_to_block) != n:
            raise ValueError("populate_index needs distinct hashes")
    prefix.stats.published_blocks += n
    prefix.stats.indexed_hashes += n  # stats is the live counter object


class _NoBacking:
    def activate(self, slots: Any) -> bool:
        return False

    def deactivate(self, slots: Any) -> None:
        return None


def _lookup_us(n_cached: int, cfg: PrefixBenchConfig, rng: random.Random) -> float:
    from xllm_vmm.kvcache.allocator import BlockAllocator, GroupShape

    # the index alone is measured: an allocator of one slot stands behind it (nothing allocated)
    prefix = PrefixCache(BlockAllocator([GroupShape("attn", 1, 1)], _NoBacking()), {"attn": 1},
                         cfg.block_size)
    hashes = list({rng.getrandbits(128): None for _ in range(n_cached)})
    populate_index(prefix, hashes)
    n_cached = len(hashes)
    p = cfg.lookup_prompt_blocks
    reqs = []
    for _ in range(64):
        start = rng.randrange(max(1, n_cached - p))
        # a real chain's prefix: half the prompt cached, the rest new
        reqs.append(hashes[start:start + p // 2] + [rng.getrandbits(128) for _ in range(p - p // 2)])
    it = cfg.lookup_iterations
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for i in range(it):
            prefix.lookup(reqs[i & 63])
        best = min(best, time.perf_counter() - t)
    return best / it * 1e6


def _flat_layout(cfg: PrefixBenchConfig):
    from xllm_vmm.models.spec import CacheGroup, CacheLayout, CacheTensor

    bpt = max(1, cfg.tensor_block_bytes // cfg.block_size)  # bytes per token per tensor
    return CacheLayout("bench-prefix", 1, (CacheGroup(
        "attn", (CacheTensor("k", bpt), CacheTensor("v", bpt)), cfg.block_size),))


def _open_driver(kind: str, device_memory: int, populate: bool = False):
    if kind == "sim":
        from xllm_vmm.vmm.sim import SimDriver

        return SimDriver(device_memory)
    from xllm_vmm.vmm import open_driver

    if kind == "acl-emu":
        return open_driver("acl", library="emulation", device_memory=device_memory)
    return open_driver(kind, device_memory=device_memory, populate=populate)


def _workload_sizes(cfg: PrefixBenchConfig) -> tuple[Any, int, int, int]:
    """(layout, blocks per page, device budget bytes, KV capacity in tokens) of the workload."""
    layout = _flat_layout(cfg)
    g = layout.groups[0]
    page = 2 * _MiB
    bpp = page // g.tensor_block_bytes
    budget = cfg.device_budget_slots * page * len(g.tensors)
    return layout, bpp, budget, 4 * cfg.device_budget_slots * bpp * cfg.block_size


def check_host_pool_fits(cfg: PrefixBenchConfig, available_bytes: int | None = None) -> int:
    """The host pool of the workload's host-tier run (HK-06), computed on a simulated device
    (nothing allocated); raises :class:`~xllm_vmm.bench.limits.BenchTooLarge` naming
    ``--host-blocks-factor`` when it does not fit in ``available_bytes`` (default: host
    memory less the host driver's safety margin, less the 64 MiB copy baseline). Returns its
    bytes."""
    from xllm_vmm.bench.limits import check_fits, host_headroom
    from xllm_vmm.kvcache import VirtualKVCache
    from xllm_vmm.kvcache.prefix_setup import plan_host_pool
    from xllm_vmm.pool import BudgetConfig, VmmPool
    from xllm_vmm.vmm.sim import SimDriver

    layout, _, budget, max_tokens = _workload_sizes(cfg)
    arena = VirtualKVCache.arena_bytes(layout, 2 * _MiB, max_tokens)
    driver = SimDriver(arena + 64 * _MiB)
    pool = VmmPool(driver, BudgetConfig(mode="elastic", max_cache_size=budget,
                                        execution_peak_bytes=0), arena)
    try:
        size = plan_host_pool(VirtualKVCache.for_tokens(pool, layout, max_tokens),
                              cfg.host_blocks_factor)
    finally:
        pool.close()
        driver.close()
    room = (host_headroom() - _RING_BYTES) if available_bytes is None else available_bytes
    most = room / size.device_capacity_bytes if size.device_capacity_bytes else None
    check_fits(size.bytes, room, option="--host-blocks-factor", value=cfg.host_blocks_factor,
               what=f"a host KV pool of {size.blocks} blocks, the factor x the workload's "
                    f"device KV capacity of {size.device_capacity_bytes} bytes",
               most=None if most is None or most <= 1 else float(f"{most:.3g}"),
               where="this host")
    return size.bytes


class _SubmitClock:
    """The workload's driver, noting when each host→device batch (a restore's copy) starts —
    submitted to the copy stream, or run by the thread that waits for it: the restore's copy
    time runs from there to the request's ``wait_ready``."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver
        self.last_h2d_submit = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)

    def copy_batch_async(self, dsts, srcs, sizes, kind):  # noqa: ANN001 - the driver's
        from xllm_vmm.vmm import CopyKind

        if kind is CopyKind.H2D:
            self.last_h2d_submit = time.perf_counter()
        return self._driver.copy_batch_async(dsts, srcs, sizes, kind)

    def copy_batch(self, dsts, srcs, sizes, kind):  # noqa: ANN001 - the driver's
        from xllm_vmm.vmm import CopyKind

        if kind is CopyKind.H2D:
            self.last_h2d_submit = time.perf_counter()
        return self._driver.copy_batch(dsts, srcs, sizes, kind)


def _workload(cfg: PrefixBenchConfig, with_host: bool, populate: bool | None = None
              ) -> dict[str, Any]:
    """Many requests over a few long system prompts; device budget below the working set.
    Every request goes through the manager's verbs (lookup, allocate — which starts a host
    restore —, wait_ready, commit, free, step)."""
    from xllm_vmm.kvcache import VirtualKVCache, build_kv_cache_manager
    from xllm_vmm.pool import BudgetConfig, VmmPool

    layout, bpp, budget, max_tokens = _workload_sizes(cfg)
    g = layout.groups[0]
    page = 2 * _MiB
    populate = cfg.populate if populate is None else populate
    driver = _open_driver(cfg.driver, 16 * budget + 64 * _MiB, populate)
    clock = _SubmitClock(driver)
    pool = VmmPool(driver, BudgetConfig(mode="elastic", max_cache_size=budget,
                                        execution_peak_bytes=0),
                   VirtualKVCache.arena_bytes(layout, page, max_tokens))
    mgr = build_kv_cache_manager(pool, layout, enable_prefix_cache=True,
                                 host_blocks_factor=cfg.host_blocks_factor if with_host else 0.0,
                                 max_tokens=max_tokens, driver=clock, compact=False)
    host = mgr.host
    rng = random.Random(cfg.seed)
    bs = cfg.block_size
    systems = [[rng.randrange(152_000) for _ in range(cfg.system_prompt_blocks * bs)]
               for _ in range(cfg.system_prompts)]
    prompt_tokens = hit_tokens = restored_tokens = restores = 0
    restore_s = restore_map_s = 0.0
    restore_sizes: list[int] = []  # bytes of each restore
    memcpy_s = 0.0
    refused = 0
    ring = None
    try:
        if host is not None:
            ring = _MemcpyRing(driver, (cfg.system_prompt_blocks + cfg.suffix_blocks + 1)
                               * g.block_bytes)
        for n in range(cfg.requests):
            rid = f"r{n}"
            toks = systems[rng.randrange(cfg.system_prompts)] + [
                rng.randrange(152_000) for _ in range(cfg.suffix_blocks * bs + 1)]
            mgr.step()  # the scheduler's per-iteration call: finished copies reaped
            hit = mgr.lookup(rid, toks)
            t_alloc = time.perf_counter()
            tables = mgr.allocate(rid, len(toks) - hit.num_tokens, hit=hit)
            if tables is None and host is not None:
                # "not now": blocks pinned by copies in flight; the scheduler retries once
                # they are done
                host.wait_all()
                mgr.step()
                t_alloc = time.perf_counter()
                tables = mgr.allocate(rid, len(toks) - hit.num_tokens, hit=hit)
            if tables is None:
                refused += 1
                mgr.drop(rid)
                continue
            prompt_tokens += len(toks)
            hit_tokens += hit.num_device_tokens
            if hit.num_host_tokens:
                before = clock.last_h2d_submit
                ok = mgr.wait_ready(rid)  # a restore waited for at once: copied on this thread
                t_submit = clock.last_h2d_submit
                if ok and t_submit > before:  # a copy of its own (not a join)
                    restore_s += time.perf_counter() - t_submit
                    restore_map_s += t_submit - t_alloc
                    size = hit.num_host_tokens // bs * g.block_bytes
                    restore_sizes.append(size)
                    memcpy_s += ring.time(size)  # type: ignore[union-attr]
                    restored_tokens += hit.num_host_tokens
                    restores += 1
            # the forward pass would write the rest here; commit publishes the complete blocks
            mgr.commit(rid, len(toks), toks)
            mgr.free(rid)
            if host is not None:
                mgr.step()  # submits this request's write-through
                # ... and lets it finish before the next request: which blocks are pinned when
                # the next one allocates must not depend on the copy thread's timing, so the
                # counts (restores, hit rates, refusals) are the same on every run of a seed
                host.wait_all()
        out: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "hit_tokens": hit_tokens,
            "restored_tokens": restored_tokens,
            "restores": restores,
            "refused": refused,
            "evictions": mgr.stats()["prefix_evictions"],
            "restore_s": restore_s,
            "restore_map_s": restore_map_s,
            "restore_sizes": restore_sizes,
            "hit_rate": (hit_tokens + restored_tokens) / prompt_tokens if prompt_tokens else 0.0,
            "working_set_blocks": cfg.system_prompts * cfg.system_prompt_blocks,
            "device_budget_blocks": cfg.device_budget_slots * bpp,
        }
        if host is not None:
            host.wait_all()
            out["restored_bytes"] = host.stats.restored_bytes
            out["offload"] = _offload_rate(host, mgr.cache, mgr.prefix, driver)
            out["memcpy_s"] = memcpy_s
        return out
    finally:
        if ring is not None:
            ring.close()
        mgr.close()
        pool.close()
        driver.close()


def _offload_rate(host, cache, prefix, driver) -> tuple[int, float]:
    """Bytes and seconds of one batched device→host copy of every cached block (as the
    write-through path submits it)."""
    from xllm_vmm.kvcache.prefix_setup import KvBlockAddresses
    from xllm_vmm.vmm import CopyKind

    addrs = KvBlockAddresses(cache)
    blocks = prefix.lru_order("attn")
    dsts, srcs, sizes = [], [], []
    pool = host.pool
    for i, b in enumerate(blocks[: pool.capacity]):
        off = pool.address(i)
        for a, n in addrs.block_segments("attn", b):
            dsts.append(off)
            srcs.append(a)
            sizes.append(n)
            off += n
    if not sizes:
        return 0, 0.0
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        driver.copy_batch_async(dsts, srcs, sizes, CopyKind.D2H).wait()
        best = min(best, time.perf_counter() - t)
    return sum(sizes), best


_RING_BYTES = 64 * _MiB  # twice a large last-level cache: the baseline copies miss it too


class _MemcpyRing:
    """The restore baseline: one ``memmove`` of a given size from a host buffer of ``driver``
    into mapped pages of ``driver`` whose page tables are present (the kind of destination a
    restore writes, at its best). Source and destination advance through rings of 64 MiB, so,
    like the restores (whose host and device blocks differ from one restore to the next), the
    copies are not served from the CPU caches. Timed right after each restore (interleaved:
    both see the same state of a shared machine). Needs a driver whose mapped memory the CPU
    can address (host, ACL emulation)."""

    def __init__(self, driver: Any, largest: int) -> None:
        self.driver = driver
        g = driver.granularity
        self.n = -(-max(largest, _RING_BYTES) // g)
        self.ring = self.n * g
        self.va = driver.reserve(self.ring)
        self.handles = driver.create_handles(self.n, g)
        self.vas = [self.va + i * g for i in range(self.n)]
        self.src = driver.alloc_host(self.ring)
        driver.map_batch(self.vas, self.handles)
        ctypes.memset(self.src, 1, self.ring)
        ctypes.memmove(self.va, self.src, self.ring)  # page tables present and writable
        self.off = 0

    def time(self, size: int) -> float:
        """Seconds of one memmove of ``size`` bytes (the next slice of the rings)."""
        if self.off + size > self.ring:
            self.off = 0
        o = self.off
        self.off += size
        t = time.perf_counter()
        ctypes.memmove(self.va + o, self.src + o, size)
        return time.perf_counter() - t

    def close(self) -> None:
        d = self.driver
        d.free_host(self.src)
        d.unmap_batch(self.vas)
        for h in self.handles:
            d.free_handle(h)
        d.release(self.va, self.ring)


def _memcpy_s(nbytes: int) -> float:
    a = (ctypes.c_char * nbytes)()
    b = (ctypes.c_char * nbytes)()
    ctypes.memset(a, 1, nbytes)
    ctypes.memset(b, 2, nbytes)
    return _rate(ctypes.memmove, b, a, nbytes)


def _eviction_bench(cfg: PrefixBenchConfig) -> dict[str, Any]:
    """Bytes released per evicted block: slot-emptying eviction against plain LRU."""
    return {mode: _evict_once(cfg, prefer) for mode, prefer in
            (("lru", False), ("slot_emptying", True))}


def _evict_once(cfg: PrefixBenchConfig, prefer: bool) -> float:
    from xllm_vmm.kvcache import VirtualKVCache
    from xllm_vmm.pool import BudgetConfig, VmmPool

    layout = _flat_layout(cfg)
    g = layout.groups[0]
    n_req, per = cfg.evict_requests, cfg.evict_blocks_per_request
    total = n_req * per
    page = 2 * _MiB
    bpp = page // g.tensor_block_bytes
    slots = -(-total // bpp) + 1
    driver = _open_driver("sim", 2 * slots * 2 * page + 64 * _MiB)
    pool = VmmPool(driver, BudgetConfig(mode="elastic", execution_peak_bytes=0),
                   slots * 2 * page)
    cache = VirtualKVCache(pool, layout, {"attn": slots})
    alloc = cache.allocator
    # the policy alone is compared: the prefix cache over the cache's allocator, driven
    # directly (the manager would evict the same way before an allocation)
    prefix = PrefixCache(alloc, {"attn": g.block_bytes}, cfg.block_size)
    rng = random.Random(cfg.seed)
    try:
        # decode-style interleaving: one block per request per step, so slots mix requests
        owned: list[list[int]] = [[] for _ in range(n_req)]
        for _ in range(per):
            for r in range(n_req):
                owned[r].extend(alloc.allocate({"attn": 1})["attn"])
        for r in range(n_req):
            prefix.publish({"attn": owned[r]}, [rng.getrandbits(128) for _ in owned[r]])
        order = list(range(n_req))
        rng.shuffle(order)
        for r in order[n_req // 8:]:  # seven eighths finish, in random order
            prefix.release({"attn": owned[r]})
        # goal: free half of the slots that hold no live block (what any policy could free)
        emptiable = sum(1 for sl in alloc.active_slots("attn") if alloc.slot_live("attn", sl) == 0)
        slot_bytes = cache.geometry["attn"].slot_bytes
        target = max(1, emptiable // 2) * slot_bytes
        before = pool.mapped_bytes
        evicted = 0
        while before - pool.mapped_bytes < target:
            victims = prefix.evict("attn", bpp, prefer_slot_emptying=prefer)  # freed by it
            if not victims:
                break
            evicted += len(victims)
        freed = before - pool.mapped_bytes
        return freed / evicted if evicted else 0.0
    finally:
        pool.close()
        driver.close()


def _restore_fields(run: dict[str, Any], name: str) -> dict[str, float]:
    """Restore bandwidth of a host-tier workload run, copy only and with the allocation that
    maps its blocks, and both over memmove of the same bytes (see the module docstring)."""
    rb, copy_s, map_s = sum(run.get("restore_sizes", ())), run["restore_s"], run["restore_map_s"]
    if not rb or copy_s <= 0:
        return {f"{name}_bytes_per_s": 0.0, f"{name}_vs_memcpy_ratio": 0.0,
                f"{name}_with_map_vs_memcpy_ratio": 0.0}
    memcpy_bw = rb / run["memcpy_s"]
    return {
        f"{name}_bytes_per_s": rb / copy_s,
        f"{name}_with_map_bytes_per_s": rb / (copy_s + map_s),
        f"{name}_memcpy_bytes_per_s": memcpy_bw,
        f"{name}_vs_memcpy_ratio": rb / copy_s / memcpy_bw,
        f"{name}_with_map_vs_memcpy_ratio": rb / (copy_s + map_s) / memcpy_bw,
    }


def run_prefix_bench(cfg: PrefixBenchConfig = PrefixBenchConfig()) -> dict[str, Any]:
    """Run every part; returns a flat dict (see the module docstring for each field)."""
    check_host_pool_fits(cfg)  # before anything runs
    rng = random.Random(cfg.seed)
    res: dict[str, Any] = {"driver": cfg.driver, "block_size": cfg.block_size}
    res.update(_hash_bench(cfg, rng))
    res["lookup_us_1k"] = _lookup_us(cfg.lookup_small_blocks, cfg, rng)
    res["lookup_us_1m"] = _lookup_us(cfg.lookup_blocks, cfg, rng)
    res["lookup_1m_measured_at_blocks"] = cfg.lookup_blocks
    res["lookup_growth_ratio"] = res["lookup_us_1m"] / res["lookup_us_1k"]

    dev = _workload(cfg, with_host=False)
    host = _workload(cfg, with_host=True)
    res["hit_rate_device_only"] = dev["hit_rate"]
    res["hit_rate_with_host"] = host["hit_rate"]
    res["host_hit_rate_gain"] = host["hit_rate"] - dev["hit_rate"]
    res["host_restores"] = host["restores"]
    res["device_evictions"] = host["evictions"]
    res["workload_requests"] = cfg.requests
    res["workload_working_set_blocks"] = dev["working_set_blocks"]
    res["workload_device_budget_blocks"] = dev["device_budget_blocks"]
    res.update(_restore_fields(host, "restore"))
    res["restore_populated"] = cfg.populate and cfg.driver == "host"
    if res["restore_populated"]:
        res.update(_restore_fields(_workload(cfg, with_host=True, populate=False),
                                   "restore_unpopulated"))
    ob, os_ = host.get("offload", (0, 0.0))
    if ob and os_ > 0:
        res["offload_bytes_per_s"] = ob / os_
        res["offload_vs_memcpy_ratio"] = (ob / os_) / (ob / _memcpy_s(ob))
    ev = _eviction_bench(cfg)
    res["bytes_freed_per_eviction_lru"] = ev["lru"]
    res["bytes_freed_per_eviction_slot_emptying"] = ev["slot_emptying"]
    res["bytes_freed_per_eviction_ratio"] = (ev["slot_emptying"] / ev["lru"]
                                             if ev["lru"] else 0.0)
    return res
