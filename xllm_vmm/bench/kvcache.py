"""``xllm-vmm bench kvcache``: the virtual KV cache against a plain free-list block pool.

Everything runs in one process on one trace, and the results are ratios against the baseline
measured in the same run (absolute times move from run to run on shared machines):

- ``alloc_vs_freelist_ratio``: operations per second of the page-aware
  :class:`~xllm_vmm.kvcache.BlockAllocator` (bookkeeping only: a backing that maps nothing)
  over those of :class:`FreeListBlockPool` on the same allocate/free trace, the allocator
  called the way the manager calls it for a one-group model
  (``allocate_group("attn", n, last block)``, ``free_group("attn", blocks)``; the dict API
  ``allocate``/``free`` delegates to these per group).
  ``cache_vs_freelist_ratio`` is the same for the whole stack (cache + pool + driver, mapping
  slots on the selected driver).
- ``admission_us``: the cost of one admission decision (:meth:`Admission.check_prefill`), and
  ``freelist_admission_us`` for the free list's ``len(free) >= need``.
- Fragmentation on a staggered-decode trace of a realistic model (default: 36 layers, 8 KV heads
  of 128, bf16, 128-token blocks: 8 blocks per 2 MiB page, 144 MiB per slot): sequences arrive
  one per step, prefill their prompt, decode one token per step and finish at different
  times; a fraction are long-running and outlive the burst.
  ``peak_footprint_ratio`` = peak mapped bytes / peak packed floor, and
  ``idle_footprint_ratio`` = mapped bytes / packed floor once every short sequence has finished
  (only the long tail left), after the scheduler compacted the cache at that point
  (:meth:`~xllm_vmm.kvcache.VirtualKVCache.compact`; it rewrites its block tables with the
  moves and the long tail keeps decoding in the moved blocks);
  ``idle_footprint_ratio_before_compaction`` is the figure before, and
  ``compaction_bytes_copied`` / ``compaction_blocks_moved`` / ``compaction_bytes_released`` /
  ``compaction_ms`` what the compaction cost and gave back. The packed floor is the live blocks of each group rounded up to
  whole slots. Targets: idle ≤ 1.15 (the best published system reports 1.4), peak ≤ 1.1.
  ``freelist_idle_footprint_ratio`` / ``freelist_peak_footprint_ratio`` are what mapping the
  slots a FIFO free list touches would hold on the same trace.
- ``map_calls_per_1k_tokens``: batched map calls per 1,000 generated (decode) tokens.
- The full-pool steady state (``--full-pool-requests N``, off by default: ``full_*`` fields,
  :func:`run_full_pool`): the serving, multi-turn and no-reuse traces at 64 and 4,096 running
  requests, blocks of 16 and 128 tokens, each on a pool pre-filled with cached prefixes, the
  manager against the exact-LRU free-list baseline: per-op cost ratio, its growth from 64 to
  4,096 running, and hit tokens request by request (``hit_losses``: requests whose hit is
  shorter than exact LRU's).

The throughput replays (``alloc_*``, ``manager_cycle_*``, ``cost_growth_*``) are timed with the
thread's CPU time (:data:`_clock`), both sides alike; ``cache_vs_freelist_ratio`` and the
admission figures use the wall clock per call.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import statistics
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from xllm_vmm.kvcache import Admission, BlockAllocator, GroupShape, VirtualKVCache
from xllm_vmm.kvcache.hashing import block_hashes
from xllm_vmm.models.spec import CacheGroup, CacheLayout, CacheTensor
from xllm_vmm.pool import BudgetConfig, VmmPool

__all__ = ["FreeListBlockPool", "FreeListPrefixPool", "KvBenchConfig", "gqa_layout",
           "make_serving_trace", "make_trace", "run_kvcache_bench"]

_MiB = 1 << 20
#: the clock of every throughput replay (allocator, free list, manager cycles, baseline): this
#: thread's CPU time, so that other jobs on a shared machine do not count against either side
#: (on a quiet machine it equals the wall time; nothing in the replays runs on other threads)
_clock = time.thread_time
_PAGE = 2 * _MiB
_TOKEN_BYTES = 8 * 128 * 2  # one layer's K (or V) per token: 8 KV heads of 128, bf16
#: the largest block (tokens) whose bytes in one tensor fit in a 2 MiB page
MAX_BLOCK_SIZE = _PAGE // _TOKEN_BYTES


class FreeListBlockPool:
    """The baseline: a plain reference-counted block pool over one FIFO free list (the shape
    of vLLM's and nano-vllm's block managers), with no notion of pages."""

    def __init__(self, num_blocks: int) -> None:
        self.free_ids = deque(range(num_blocks))
        self.ref = [0] * num_blocks

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_ids):
            return None
        pop = self.free_ids.popleft
        out = [pop() for _ in range(n)]
        ref = self.ref
        for b in out:
            ref[b] = 1
        return out

    def free(self, blocks: Sequence[int]) -> None:
        ref = self.ref
        for b in blocks:
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                self.free_ids.append(b)

    def can_allocate(self, n: int) -> bool:
        return len(self.free_ids) >= n


class _NullBacking:
    def activate(self, slots: Mapping[str, Sequence[int]]) -> bool:
        return True

    def deactivate(self, slots: Mapping[str, Sequence[int]]) -> None:
        return None


def gqa_layout(layers: int = 36, kv_heads: int = 8, head_dim: int = 128, dtype_bytes: int = 2,
               block_size: int = 128) -> CacheLayout:
    """Full-attention K/V per layer of a GQA model (one worker)."""
    bpt = kv_heads * head_dim * dtype_bytes
    tensors = tuple(CacheTensor(f"layer{i}.{kv}", bpt) for i in range(layers) for kv in "kv")
    return CacheLayout(f"gqa-{layers}l", 1, (CacheGroup("attn", tensors, block_size),))


@dataclass(frozen=True)
class KvBenchConfig:
    """Sizes of the benchmark. ``sequences``: sequences in the burst; ``long_fraction``: the
    share that outlives it; prompt and decode lengths in tokens."""

    sequences: int = 256
    prompt_tokens: tuple[int, int] = (128, 2048)
    decode_tokens: tuple[int, int] = (64, 768)
    long_fraction: float = 0.1
    long_decode_tokens: int = 4096
    layers: int = 36
    block_size: int = 128
    seed: int = 0
    driver: str = "sim"  # "sim" or "host"
    repeats: int = 7  # interleaved repeats of every speed measurement (ABBA order)
    min_seconds: float = 0.2  # each speed measurement replays its trace at least this long
    # whole request cycles through the manager (serving trace, prefix caching on)
    cycle_block_size: int = 16
    cycle_concurrency: int = 64
    cycle_requests: int = 2048
    growth_concurrency: tuple[int, int] = (64, 4096)
    growth_requests: int = 8192
    # the full-pool steady state (run_full_pool): requests per trace, 0 = not measured
    full_pool_requests: int = 0
    full_pool_block_sizes: tuple[int, ...] = (16, 128)


@dataclass
class _Op:
    kind: str  # "alloc" | "free" | "idle" (marker: every short sequence has finished)
    seq: int
    n: int = 0
    tokens: int = 0  # tokens of the sequence after this op (admission input)


def make_trace(cfg: KvBenchConfig) -> tuple[list[_Op], int]:
    """A staggered-decode trace: one arrival per step; each step every running sequence
    decodes one token (a block when it crosses a boundary). Returns the ops and the number of
    decode tokens generated."""
    rng = random.Random(cfg.seed)
    bs = cfg.block_size
    n_long = max(1, int(cfg.sequences * cfg.long_fraction))
    long_ids = set(rng.sample(range(cfg.sequences), n_long))
    ops: list[_Op] = []
    running: dict[int, list[int]] = {}  # seq -> [tokens, remaining decode]
    arrivals = 0
    generated = 0
    idle_marked = False
    while arrivals < cfg.sequences or running:
        if arrivals < cfg.sequences:
            p = rng.randint(*cfg.prompt_tokens)
            dec = (cfg.long_decode_tokens if arrivals in long_ids
                   else rng.randint(*cfg.decode_tokens))
            ops.append(_Op("alloc", arrivals, -(-p // bs), p))
            running[arrivals] = [p, dec]
            arrivals += 1
        for sid in list(running):
            t, rem = running[sid]
            if rem == 0:
                ops.append(_Op("free", sid))
                del running[sid]
                continue
            if t % bs == 0:
                ops.append(_Op("alloc", sid, 1, t + 1))
            running[sid] = [t + 1, rem - 1]
            generated += 1
        if (not idle_marked and arrivals == cfg.sequences
                and all(s in long_ids for s in running)):
            ops.append(_Op("idle", -1))
            idle_marked = True
    return ops, generated


def _replay_freelist(ops: list[_Op], pool: FreeListBlockPool) -> float:
    held: dict[int, list[int]] = {}
    allocate, free = pool.allocate, pool.free  # the same caller bookkeeping on both sides
    t0 = _clock()
    for op in ops:
        if op.kind == "alloc":
            mine = held.get(op.seq)
            got = allocate(op.n)
            if got is None:
                raise RuntimeError("free-list baseline ran out of blocks; size it larger")
            if mine is None:
                held[op.seq] = got
            else:
                mine.extend(got)
        elif op.kind == "free":
            free(held.pop(op.seq))
    return _clock() - t0


def _replay_allocator(ops: list[_Op], alloc: Any) -> float:
    """The allocator on the trace through the path the manager uses for a one-group model:
    ``allocate_group(group, n, last block)`` / ``free_group(group, blocks)``."""
    held: dict[int, list[int]] = {}
    allocate, free = alloc.allocate_group, alloc.free_group
    t0 = _clock()
    for op in ops:
        if op.kind == "alloc":
            mine = held.get(op.seq)
            got = allocate("attn", op.n, mine[-1] if mine else -1)
            if got is None:
                raise RuntimeError("allocator ran out of blocks on the benchmark trace")
            if mine is None:
                held[op.seq] = got
            else:
                mine.extend(got)
        elif op.kind == "free":
            free("attn", held.pop(op.seq))
    return _clock() - t0


# -- whole request cycles through the manager (prefix caching on) --------------------------

class FreeListPrefixPool:
    """The cycle baseline: a plain free list plus a dict hash index doing the same block
    operations as the manager on the same trace — vLLM v1's block-pool shape with prefix
    caching, at its leanest: one ``OrderedDict`` free queue (least recently freed first; a
    cached block stays in it, indexed, until it is popped for reuse, which evicts its hash),
    reference counts, ``hash → block``, and per request its block table and hashes. It hashes
    with the same XXH3-128 chain (both sides do the same hashing work); it knows no pages."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free_q: "OrderedDict[int, None]" = OrderedDict.fromkeys(range(num_blocks))
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.index: dict[int, int] = {}
        self.bs = block_size
        self.reqs: dict[str, list] = {}  # rid -> [table, hashes, published, computed]

    def _pop(self, n: int) -> list[int] | None:
        if n > len(self.free_q):
            return None
        pop = self.free_q.popitem
        out = []
        ref, bh, index = self.ref, self.block_hash, self.index
        for _ in range(n):
            b = pop(last=False)[0]
            h = bh[b]
            if h is not None:  # a cached block reused: its hash goes
                del index[h]
                bh[b] = None
            ref[b] = 1
            out.append(b)
        return out

    def lookup(self, rid: str, tokens: list[int]) -> int:
        bs = self.bs
        hashes = block_hashes(tokens, bs)
        cap = (len(tokens) - 1) // bs
        index, ref, fq = self.index, self.ref, self.free_q
        table = []
        for h in hashes[:cap]:
            b = index.get(h)
            if b is None:
                break
            if ref[b] == 0:
                del fq[b]
            ref[b] += 1
            table.append(b)
        self.reqs[rid] = [table, hashes, len(table), len(table) * bs]
        return len(table) * bs

    def allocate(self, rid: str, num_new: int) -> list[int] | None:
        r = self.reqs[rid]
        table = r[0]
        need = -(-(r[3] + num_new) // self.bs) - len(table)
        if need > 0:
            got = self._pop(need)
            if got is None:
                return None
            table.extend(got)
        return table

    def commit(self, rid: str, num_computed: int, tokens: list[int]) -> None:
        r = self.reqs[rid]
        r[3] = num_computed
        bs = self.bs
        full = num_computed // bs
        first = r[2]
        if full <= first:
            return
        hashes = r[1]
        have = len(hashes)
        if have < full:
            hashes.extend(block_hashes(tokens[have * bs:full * bs], bs,
                                       parent=hashes[-1] if have else None, first_block=have))
        table, index, bh = r[0], self.index, self.block_hash
        for i in range(first, full):
            h = hashes[i]
            if h not in index and bh[table[i]] is None:
                index[h] = table[i]
                bh[table[i]] = h
        r[2] = full

    def free(self, rid: str) -> None:
        table = self.reqs.pop(rid)[0]
        ref, fq = self.ref, self.free_q
        for b in reversed(table):
            c = ref[b] - 1
            ref[b] = c
            if c == 0:
                fq[b] = None


def cycle_layout(block_size: int) -> CacheLayout:
    """One layer's K and V, 8 blocks per 2 MiB page (bookkeeping runs on the sim driver)."""
    return CacheLayout("cycles", 1, (CacheGroup(
        "attn", (CacheTensor("k", _PAGE // 8 // block_size),
                 CacheTensor("v", _PAGE // 8 // block_size)), block_size),))


def make_serving_trace(concurrency: int, requests: int, block_size: int, seed: int = 0,
                       system_prompts: int = 8, system_blocks: int = 4,
                       suffix_blocks: tuple[int, int] = (1, 3),
                       decode_tokens: tuple[int, int] = (8, 32)) -> list[tuple]:
    """A serving trace at ``concurrency`` running requests: each arrival's prompt is one of
    ``system_prompts`` shared system prompts plus a unique suffix (whole blocks and a partial
    one); every step each running request decodes one token; a finished request leaves and the
    next arrives.

    The trace is *flat*: what a replay reads is prepared here, so that the harness does the
    same small constant work per event at any concurrency (no per-op allocation, no growing
    lists, no per-request dicts of its own). Each request's whole token list (prompt, then
    every token it will decode) is built once, its int objects created together (one
    ``array.tolist()``: adjacent in memory, as an engine's per-request token buffer is), and
    every event refers to it. Events: ``(0, rid, prompt, tokens)`` arrive (``prompt`` = the
    first ``len(prompt)`` entries of ``tokens``, the same int objects), ``(1, rid, n, tokens)``
    decode the token that makes ``n`` tokens (the replay allocates for it and commits ``n``
    with ``tokens``; a list longer than ``n`` is what an engine's buffer is too), ``(2, rid)``
    finish, ``(3,)`` end of a step. The token values are those of the unflattened trace
    (same seed, same draws)."""
    rng = random.Random(seed)
    bs = block_size
    systems = [[rng.randrange(1, 150_000) for _ in range(system_blocks * bs)]
               for _ in range(system_prompts)]
    events: list[tuple] = []
    running: dict[str, int] = {}
    nxt = 0
    while nxt < requests or running:
        while len(running) < concurrency and nxt < requests:
            rid = f"r{nxt}"
            nxt += 1
            suffix = [rng.randrange(1, 150_000)
                      for _ in range(rng.randint(*suffix_blocks) * bs + rng.randrange(1, bs))]
            events.append((0, rid, systems[rng.randrange(system_prompts)] + suffix))
            running[rid] = rng.randint(*decode_tokens)
        for rid in list(running):
            if running[rid] == 0:
                events.append((2, rid))
                del running[rid]
            else:
                events.append((1, rid, rng.randrange(1, 150_000)))
                running[rid] -= 1
        events.append((3,))
    return _flatten(events)


def _flatten(events: list[tuple]) -> list[tuple]:
    """Raw events (``(0, rid, prompt)``, ``(1, rid, token)``, ...) → the flat form of
    :func:`make_serving_trace`: one token list per request, fresh int objects side by side."""
    toks: dict[str, list[int]] = {}
    for ev in events:
        if ev[0] == 0:
            toks[ev[1]] = list(ev[2])
        elif ev[0] == 1:
            toks[ev[1]].append(ev[2])
    full = {rid: array("I", t).tolist() for rid, t in toks.items()}
    count: dict[str, int] = {}
    out: list[tuple] = []
    for ev in events:
        k = ev[0]
        if k == 0:
            rid = ev[1]
            t = full[rid]
            n = count[rid] = len(ev[2])
            out.append((0, rid, t[:n], t))
        elif k == 1:
            rid = ev[1]
            n = count[rid] = count[rid] + 1
            out.append((1, rid, n, full[rid]))
        else:
            out.append(ev)
    return out


def _trace_blocks(events: list[tuple], block_size: int) -> int:
    """Blocks that hold everything the trace ever writes (nothing needs evicting)."""
    n = 0
    for ev in events:
        if ev[0] == 0:
            n += -(-len(ev[2]) // block_size) + 1
        elif ev[0] == 1:
            n += 1  # at most one block per token (generous)
    return n // 2 + 64


def _replay_cycles_baseline(events: list[tuple], pool: FreeListPrefixPool) -> tuple[float, int]:
    """The baseline's verbs on the flat trace (the same loop as the manager's below, verb for
    verb). Returns (CPU seconds, verb calls)."""
    ops = 0
    lookup, allocate, commit, free = pool.lookup, pool.allocate, pool.commit, pool.free
    t0 = _clock()
    for ev in events:
        k = ev[0]
        if k == 1:
            if allocate(ev[1], 1) is None:
                raise RuntimeError("free-list baseline ran out of blocks on the serving trace")
            commit(ev[1], ev[2], ev[3])
            ops += 2
        elif k == 0:
            rid, prompt = ev[1], ev[2]
            hit = lookup(rid, prompt)
            if allocate(rid, len(prompt) - hit) is None:
                raise RuntimeError("free-list baseline ran out of blocks on the serving trace")
            commit(rid, len(prompt), ev[3])
            ops += 3
        elif k == 2:
            free(ev[1])
            ops += 1
    return _clock() - t0, ops


def _replay_cycles_manager(events: list[tuple], mgr: Any) -> tuple[float, int]:
    """The manager's verbs on the flat trace, plus ``step()`` once per engine step.
    Returns (CPU seconds, verb calls; ``step`` is not counted)."""
    ops = 0
    lookup, allocate, commit, free, step = (mgr.lookup, mgr.allocate, mgr.commit, mgr.free,
                                            mgr.step)
    t0 = _clock()
    for ev in events:
        k = ev[0]
        if k == 1:
            if allocate(ev[1], 1) is None:
                raise RuntimeError("the manager ran out of blocks on the serving trace")
            commit(ev[1], ev[2], ev[3])
            ops += 2
        elif k == 0:
            rid, prompt = ev[1], ev[2]
            hit = lookup(rid, prompt)
            if allocate(rid, len(prompt) - hit.num_tokens, hit=hit) is None:
                raise RuntimeError("the manager ran out of blocks on the serving trace")
            commit(rid, len(prompt), ev[3])
            ops += 3
        elif k == 2:
            free(ev[1])
            ops += 1
        else:
            step()
    return _clock() - t0, ops


def _manager_for(num_blocks: int, block_size: int) -> tuple[Any, Any, Any]:
    from xllm_vmm.kvcache import build_kv_cache_manager
    from xllm_vmm.vmm.sim import SimDriver

    layout = cycle_layout(block_size)
    slots = -(-num_blocks // 8)
    arena = slots * 2 * _PAGE
    # a fixed pool: the region is backed once at start, so the cycles measure block
    # operations (what the baseline does), not the driver's page mapping
    driver = SimDriver(2 * arena + 64 * _MiB)
    pool = VmmPool(driver, BudgetConfig(mode="fixed", max_memory_utilization=0.9,
                                        execution_peak_bytes=0), arena)
    mgr = build_kv_cache_manager(pool, layout, enable_prefix_cache=True,
                                 max_tokens=slots * 8 * block_size)
    return mgr, pool, driver


#: verb calls a replay makes per event kind: lookup + allocate + commit per arrival, allocate
#: + commit per decode token, free per finish (``step`` at the end of a step is not counted)
_VERBS_PER_EVENT = {0: 3, 1: 2, 2: 1}


def _loops_for(replay: Callable[[], float], min_seconds: float) -> int:
    """Replays per measurement so that one lasts at least ``min_seconds``: calibrated on the
    faster of two untimed calls of ``replay`` (seconds of one replay; the first call also warms
    the caches), with 20 % to spare so that a faster repeat still lasts long enough; 1 when
    ``min_seconds`` is 0."""
    if min_seconds <= 0:
        return 1
    seconds = min(replay(), replay())
    return max(1, math.ceil(1.2 * min_seconds / max(seconds, 1e-9)))


def _replay_on_fresh_manager(events: list[tuple], nblocks: int, block_size: int
                             ) -> tuple[float, int]:
    mgr, pool, driver = _manager_for(nblocks, block_size)
    try:
        return _replay_cycles_manager(events, mgr)
    finally:
        mgr.close()
        pool.close()
        driver.close()


def _measure_cycles(traces: Sequence[list[tuple]], block_size: int, min_seconds: float,
                    repeats: int, compared: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Interleaved repeats of the manager and the baseline on each trace of ``traces``: each
    repeat runs every trace once, manager then baseline, so that a change of load on a shared
    machine moves every figure alike (the cost-growth ratio compares two traces); every other
    repeat runs them in the reverse order (traces and sides: ABBA), so that a load that
    changes during a repeat does not favour what runs first. Before the
    repeats, untimed replays of each trace and side (:func:`_loops_for`) set how many times
    each measurement of that side replays it (``loops``, ``baseline_loops``), so that every
    measurement, the first one and the faster side's included, lasts at least
    ``min_seconds``; ``shortest_s`` is the shortest one's CPU seconds. The traces whose
    figures are compared with each other (``compared``: indices; the cost-growth traces) are
    measured alike: each side replays every one of them the largest of their calibrated
    counts, so that a ratio never sets a sum of two replays against a single one (the counts
    sit near 1-2 at the default ``min_seconds``, and which one a trace gets varies from run
    to run). Per-op seconds, one dict per trace."""
    nblocks = [_trace_blocks(ev, block_size) for ev in traces]
    out: list[dict[str, Any]] = []
    for events, nb in zip(traces, nblocks):  # calibration (untimed)
        out.append({"manager_s_per_op": [], "baseline_s_per_op": [],
                    "loops": _loops_for(
                        lambda: _replay_on_fresh_manager(events, nb, block_size)[0],
                        min_seconds),
                    "baseline_loops": _loops_for(
                        lambda: _replay_cycles_baseline(
                            events, FreeListPrefixPool(nb, block_size))[0], min_seconds),
                    "ops_per_replay": sum(_VERBS_PER_EVENT.get(e[0], 0) for e in events)})
    if compared:
        for key in ("loops", "baseline_loops"):
            most = max(out[i][key] for i in compared)
            for i in compared:
                out[i][key] = most
    runs = list(zip(traces, nblocks, out))
    for r in range(repeats):
        # ABBA order: every other repeat runs the traces, and the two sides of each, in the
        # reverse order, so that a load that rises or falls during a repeat does not favour
        # the trace (or the side) measured first
        for events, nb, res in (runs if r % 2 == 0 else runs[::-1]):
            for kind in (("manager", "baseline") if r % 2 == 0 else ("baseline", "manager")):
                total = 0.0
                nops = 0
                for _ in range(res["loops" if kind == "manager" else "baseline_loops"]):
                    if kind == "manager":
                        s, n = _replay_on_fresh_manager(events, nb, block_size)
                    else:
                        s, n = _replay_cycles_baseline(events, FreeListPrefixPool(nb,
                                                                                  block_size))
                    total += s
                    nops += n
                res[f"{kind}_s_per_op"].append(total / nops)
                res["shortest_s"] = min(res.get("shortest_s", total), total)
    return out


def _ratio_fields(prefix: str, num: list[float], den: list[float]) -> dict[str, float]:
    """``num``/``den`` are per-op seconds of interleaved repeats: the ratio of speeds,
    best (min time each) and median, and their spread."""
    ratios = [d / n for n, d in zip(num, den)]
    return {f"{prefix}": min(den) / min(num), f"{prefix}_median": statistics.median(ratios),
            f"{prefix}_min": min(ratios), f"{prefix}_max": max(ratios)}


def _peak_live_blocks(ops: list[_Op]) -> int:
    live = peak = 0
    held: dict[int, int] = {}
    for op in ops:
        if op.kind == "alloc":
            live += op.n
            held[op.seq] = held.get(op.seq, 0) + op.n
        elif op.kind == "free":
            live -= held.pop(op.seq)
        peak = max(peak, live)
    return peak


def _open_driver(kind: str, device_memory: int) -> Any:
    if kind == "sim":
        from xllm_vmm.vmm.sim import SimDriver

        return SimDriver(device_memory)
    if kind == "host":
        from xllm_vmm.vmm import open_driver

        return open_driver("host", device_memory=device_memory)
    raise ValueError(f"--driver must be 'sim' or 'host', got {kind!r}")


def _fragmentation(ops: list[_Op], cfg: KvBenchConfig, num_slots: int, generated: int
                   ) -> dict[str, Any]:
    layout = gqa_layout(layers=cfg.layers, block_size=cfg.block_size)
    group = layout.groups[0]
    bps = group.blocks_per_page(_PAGE)
    slot_bytes = group.slot_bytes(_PAGE)
    arena = num_slots * slot_bytes
    driver = _open_driver(cfg.driver, arena + 64 * _MiB)
    pool = VmmPool(driver, BudgetConfig(mode="elastic", execution_peak_bytes=0), arena)
    cache = VirtualKVCache(pool, layout, {"attn": num_slots})
    # the baseline's footprint: slots a FIFO free list touches (what it would have to map)
    fl = FreeListBlockPool(num_slots * bps)
    fl_occ = [0] * num_slots
    fl_touched = 0
    held: dict[int, list[int]] = {}
    fl_held: dict[int, list[int]] = {}
    live = 0
    peak_mapped = peak_floor = fl_peak = 0
    idle = fl_idle = None
    compaction = None
    t_compact = 0.0
    t_cache = 0.0
    for op in ops:
        if op.kind == "alloc":
            mine = held.get(op.seq)
            t0 = time.perf_counter()
            got = cache.allocator.allocate({"attn": op.n}, {"attn": mine[-1]} if mine else None)
            t_cache += time.perf_counter() - t0
            if got is None:
                raise RuntimeError("virtual KV cache ran out of memory on the benchmark trace")
            held.setdefault(op.seq, []).extend(got["attn"])
            fgot = fl.allocate(op.n)
            assert fgot is not None
            fl_held.setdefault(op.seq, []).extend(fgot)
            for b in fgot:
                s = b // bps
                if fl_occ[s] == 0:
                    fl_touched += 1
                fl_occ[s] += 1
            live += op.n
        elif op.kind == "free":
            blocks = held.pop(op.seq)
            t0 = time.perf_counter()
            cache.allocator.free({"attn": blocks})
            t_cache += time.perf_counter() - t0
            fblocks = fl_held.pop(op.seq)
            fl.free(fblocks)
            for b in fblocks:
                s = b // bps
                fl_occ[s] -= 1
                if fl_occ[s] == 0:
                    fl_touched -= 1
            live -= len(blocks)
        floor = -(-live // bps) * slot_bytes
        mapped = pool.mapped_bytes
        if op.kind == "idle":
            before = mapped
            # the scheduler compacts the idle cache and rewrites its block tables
            t0 = time.perf_counter()
            comp = cache.compact()
            t_compact = time.perf_counter() - t0
            moves = comp.moves["attn"]
            if moves:
                for blocks in held.values():
                    blocks[:] = [moves.get(b, b) for b in blocks]
            compaction = comp
            mapped = pool.mapped_bytes
            idle = (mapped, floor, fl_touched * slot_bytes, before)
        peak_mapped = max(peak_mapped, mapped)
        peak_floor = max(peak_floor, floor)
        fl_peak = max(fl_peak, fl_touched * slot_bytes)
    stats = pool.stats()
    pool.close()
    driver.close()
    if idle is None or idle[1] == 0:
        idle_ratio = fl_idle_ratio = before_ratio = 1.0
        idle_mapped = idle_floor = before_mapped = 0
    else:
        idle_mapped, idle_floor, fl_idle, before_mapped = idle
        idle_ratio = idle_mapped / idle_floor
        before_ratio = before_mapped / idle_floor
        fl_idle_ratio = fl_idle / idle_floor
    return {
        "model_layers": cfg.layers,
        "blocks_per_slot": bps,
        "slot_bytes": slot_bytes,
        "generated_tokens": generated,
        "peak_mapped_bytes": peak_mapped,
        "peak_packed_floor_bytes": peak_floor,
        "peak_footprint_ratio": peak_mapped / peak_floor if peak_floor else 1.0,
        "idle_mapped_bytes": idle_mapped,
        "idle_packed_floor_bytes": idle_floor,
        "idle_footprint_ratio": idle_ratio,
        "idle_footprint_ratio_before_compaction": before_ratio,
        "idle_mapped_bytes_before_compaction": before_mapped,
        "compaction_bytes_copied": compaction.bytes_copied if compaction else 0,
        "compaction_blocks_moved": compaction.blocks_moved if compaction else 0,
        "compaction_bytes_released": compaction.bytes_released if compaction else 0,
        "compaction_ms": t_compact * 1e3,
        "freelist_peak_footprint_ratio": fl_peak / peak_floor if peak_floor else 1.0,
        "freelist_idle_footprint_ratio": fl_idle_ratio,
        "map_calls": stats.map_calls,
        "unmap_calls": stats.unmap_calls,
        "map_calls_per_1k_tokens": 1000.0 * stats.map_calls / max(1, generated),
        "cache_seconds": t_cache,
    }


def _check_host_fits(cfg: KvBenchConfig, peak_floor: int) -> None:
    """On the host driver the trace maps real memory: at least its peak packed floor (live
    blocks rounded up to whole slots). Refused up front when that does not fit."""
    from xllm_vmm.bench.limits import check_fits, host_headroom

    room = host_headroom()
    most = None
    if peak_floor > room:  # the largest --sequences whose trace fits (bisection, ~0.2 s)
        group = gqa_layout(layers=cfg.layers, block_size=cfg.block_size).groups[0]
        slot = group.slot_bytes(_PAGE)
        bps = group.blocks_per_page(_PAGE)

        def fits(n: int) -> bool:
            ops, _ = make_trace(dataclasses.replace(cfg, sequences=n))
            return -(-_peak_live_blocks(ops) // bps) * slot <= room
        lo, hi = 0, cfg.sequences
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        most = lo or None
    check_fits(peak_floor, room, option="--sequences", value=cfg.sequences,
               what=f"the trace's peak of live KV blocks, {cfg.layers} layers, whole slots; "
                    "lower --sequences or --layers, or use --driver sim",
               most=most, where="this host")


def run_kvcache_bench(cfg: KvBenchConfig = KvBenchConfig()) -> dict[str, Any]:
    """Run every part of the benchmark and return a flat dict of results."""
    if cfg.sequences < 1:
        raise ValueError(f"--sequences must be >= 1, got {cfg.sequences}")
    if cfg.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {cfg.layers}")
    if not 1 <= cfg.block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"--block-size must be in [1, {MAX_BLOCK_SIZE}] (a block of one "
                         f"layer's K, {_TOKEN_BYTES} bytes per token, must fit in a 2 MiB "
                         f"page), got {cfg.block_size}")
    ops, generated = make_trace(cfg)
    layout = gqa_layout(layers=cfg.layers, block_size=cfg.block_size)
    bps = layout.groups[0].blocks_per_page(_PAGE)
    peak_live = _peak_live_blocks(ops)
    num_slots = -(-peak_live // bps) * 2 + 2  # room for any fragmentation
    if cfg.driver == "host":
        _check_host_fits(cfg, -(-peak_live // bps) * layout.groups[0].slot_bytes(_PAGE))
    n_alloc = sum(1 for op in ops if op.kind != "idle")
    # the serving traces of the whole-cycle and cost-growth measurements, built up front
    cyc_events = make_serving_trace(cfg.cycle_concurrency, cfg.cycle_requests,
                                    cfg.cycle_block_size, cfg.seed)
    growth_traces = [make_serving_trace(conc, cfg.growth_requests, cfg.cycle_block_size,
                                        cfg.seed) for conc in cfg.growth_concurrency]
    # what lives for the whole run (the traces above all) leaves the collector's generations
    # before anything is measured, as the engine's own start-up does (LLMEngine's
    # _freeze_heap: gc.freeze() once it is built): a full collection during a replay then
    # walks what the replay made, not the ~0.4 M objects of the prepared traces (≈ 60 ms of
    # CPU that fell into one replay in some runs); both sides alike. A heap someone else
    # froze (an engine in this process) is left as it is: unfreezing would thaw theirs too
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        out = _run_measurements(cfg, ops, layout, bps, peak_live, num_slots, generated,
                                n_alloc, cyc_events, growth_traces)
        if cfg.full_pool_requests > 0:
            out.update(run_full_pool(cfg.full_pool_block_sizes, cfg.growth_concurrency,
                                     cfg.full_pool_requests, max(1, cfg.repeats), cfg.seed))
        return out
    finally:
        if freeze:
            gc.unfreeze()


def _run_measurements(cfg: KvBenchConfig, ops: list[_Op], layout: CacheLayout, bps: int,
                      peak_live: int, num_slots: int, generated: int, n_alloc: int,
                      cyc_events: list[tuple], growth_traces: list[list[tuple]]
                      ) -> dict[str, Any]:
    """The measurements of :func:`run_kvcache_bench` on its prepared traces."""
    # throughput: interleaved repeats on fresh pools (bookkeeping only); an untimed replay of
    # each side first sets how many replays make one of its measurements last at least
    # min_seconds (the free list's own count: it is the faster side)
    def fresh_allocator() -> BlockAllocator:
        return BlockAllocator([GroupShape("attn", num_slots, bps)], _NullBacking())

    loops = _loops_for(lambda: _replay_allocator(ops, fresh_allocator()), cfg.min_seconds)
    fl_loops = _loops_for(lambda: _replay_freelist(ops, FreeListBlockPool(num_slots * bps)),
                          cfg.min_seconds)
    fl_runs: list[float] = []
    al_runs: list[float] = []
    shortest = float("inf")  # CPU seconds of the shortest measurement (>= --min-seconds)
    for _ in range(max(1, cfg.repeats)):
        t_al = sum(_replay_allocator(ops, fresh_allocator()) for _ in range(loops))
        t_fl = sum(_replay_freelist(ops, FreeListBlockPool(num_slots * bps))
                   for _ in range(fl_loops))
        shortest = min(shortest, t_al, t_fl)
        al_runs.append(t_al / loops)
        fl_runs.append(t_fl / fl_loops)
    fl_best, al_best = min(fl_runs), min(al_runs)

    # whole request cycles through the manager against the free list + dict index: the cycle
    # trace and the two cost-growth traces, their repeats interleaved
    cyc, *grown = _measure_cycles([cyc_events] + growth_traces, cfg.cycle_block_size,
                                  cfg.min_seconds, max(1, cfg.repeats),
                                  compared=range(1, 1 + len(growth_traces)))
    growth: dict[int, dict[str, Any]] = dict(zip(cfg.growth_concurrency, grown))

    frag = _fragmentation(ops, cfg, num_slots, generated)

    # admission: one decision on a cache holding the trace's peak, vs. the free-list check
    driver = _open_driver("sim", num_slots * layout.groups[0].slot_bytes(_PAGE) + 64 * _MiB)
    pool = VmmPool(driver, BudgetConfig(mode="elastic", execution_peak_bytes=0),
                   num_slots * layout.groups[0].slot_bytes(_PAGE))
    cache = VirtualKVCache(pool, layout, {"attn": num_slots})
    cache.allocator.allocate({"attn": peak_live // 2})
    adm = Admission([cache])
    fl = FreeListBlockPool(num_slots * bps)
    fl.allocate(peak_live // 2)
    n = 2000
    t0 = time.perf_counter()
    for i in range(n):
        adm.check_prefill(1000 + i)
    adm_s = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for i in range(n):
        fl.can_allocate(-(-(1000 + i) // cfg.block_size))
    fl_adm_s = (time.perf_counter() - t0) / n
    pool.close()
    driver.close()

    out: dict[str, Any] = {
        "driver": cfg.driver,
        # the allocator's block-table passes: "native" (libxllm_kvtable.so) or "python"
        "block_tables": "native" if fresh_allocator().native else "python",
        "sequences": cfg.sequences,
        "trace_ops": n_alloc,
        "freelist_ops_per_s": n_alloc / fl_best,
        "alloc_ops_per_s": n_alloc / al_best,
        "alloc_vs_freelist_ratio": fl_best / al_best,
        "alloc_vs_freelist_ratio_median": statistics.median(f / a for f, a in zip(fl_runs,
                                                                               al_runs)),
        "alloc_measure_loops": [loops, fl_loops],  # replays per measurement (allocator, list)
        # the shortest of every throughput measurement (allocation, cycles, growth), CPU s
        "shortest_measurement_s": min([shortest, cyc["shortest_s"]]
                                      + [g["shortest_s"] for g in grown]),
        "cache_ops_per_s": n_alloc / frag["cache_seconds"],
        "cache_vs_freelist_ratio": fl_best / frag["cache_seconds"],
        "admission_us": adm_s * 1e6,
        "freelist_admission_us": fl_adm_s * 1e6,
    }
    out.update(_ratio_fields("manager_cycle_vs_freelist_ratio", cyc["manager_s_per_op"],
                             cyc["baseline_s_per_op"]))
    out["manager_cycle_us_per_op"] = min(cyc["manager_s_per_op"]) * 1e6
    out["freelist_cycle_us_per_op"] = min(cyc["baseline_s_per_op"]) * 1e6
    out["cycle_ops"] = cyc["ops_per_replay"]
    # replays per measurement (each >= --min-seconds), manager and baseline
    out["cycle_measure_loops"] = [cyc["loops"], cyc["baseline_loops"]]
    out["cycle_concurrency"] = cfg.cycle_concurrency
    lo, hi = cfg.growth_concurrency
    m_lo, m_hi = growth[lo]["manager_s_per_op"], growth[hi]["manager_s_per_op"]
    b_lo, b_hi = growth[lo]["baseline_s_per_op"], growth[hi]["baseline_s_per_op"]
    out[f"cost_growth_{hi}_vs_{lo}"] = min(m_hi) / min(m_lo)
    out[f"cost_growth_{hi}_vs_{lo}_median"] = statistics.median(m_hi) / statistics.median(m_lo)
    out[f"freelist_cost_growth_{hi}_vs_{lo}"] = min(b_hi) / min(b_lo)
    out[f"manager_us_per_op_at_{lo}"] = min(m_lo) * 1e6
    out[f"manager_us_per_op_at_{hi}"] = min(m_hi) * 1e6
    out["growth_ops"] = growth[hi]["ops_per_replay"]
    out["growth_measure_loops"] = [[growth[c]["loops"], growth[c]["baseline_loops"]]
                                   for c in cfg.growth_concurrency]
    out.update({k: v for k, v in frag.items() if k != "cache_seconds"})
    return out


# -- the full-pool steady state -------------------------------------------------------------
#: the traces of the full-pool steady state (see :func:`run_full_pool`)
FULL_POOL_TRACES = ("serving", "multi_turn", "no_reuse")


def make_multi_turn_trace(concurrency: int, requests: int, block_size: int, seed: int = 0,
                          conversations: int | None = None, user_blocks: tuple[int, int] = (1, 2),
                          decode_tokens: tuple[int, int] = (8, 32)) -> list[tuple]:
    """Multi-turn chats at ``concurrency`` running requests: ``conversations`` (default
    ``1.5 × concurrency``) histories, each turn's prompt the conversation's whole history (every
    earlier prompt and answer) plus a new user message; a finished turn's conversation goes to
    the back of the queue, so its history waits for others' turns before it is read again
    (what an LRU has to keep). Flat events, as :func:`make_serving_trace`."""
    rng = random.Random(seed)
    bs = block_size
    n_conv = conversations or concurrency + concurrency // 2
    history: list[list[int]] = [[] for _ in range(n_conv)]
    queue = deque(range(n_conv))
    events: list[tuple] = []
    running: dict[str, list] = {}  # rid -> [conversation, tokens left, tokens so far]
    nxt = 0
    while nxt < requests or running:
        while len(running) < concurrency and nxt < requests and queue:
            c = queue.popleft()
            rid = f"r{nxt}"
            nxt += 1
            msg = [rng.randrange(1, 150_000)
                   for _ in range(rng.randint(*user_blocks) * bs + rng.randrange(1, bs))]
            prompt = history[c] + msg
            events.append((0, rid, prompt))
            running[rid] = [c, rng.randint(*decode_tokens), list(prompt)]
        for rid in list(running):
            r = running[rid]
            if r[1] == 0:
                events.append((2, rid))
                history[r[0]] = r[2]
                queue.append(r[0])
                del running[rid]
            else:
                t = rng.randrange(1, 150_000)
                events.append((1, rid, t))
                r[2].append(t)
                r[1] -= 1
        events.append((3,))
    return _flatten(events)


def make_full_pool_trace(kind: str, concurrency: int, requests: int, block_size: int,
                         seed: int = 0) -> list[tuple]:
    """One of :data:`FULL_POOL_TRACES` (``no_reuse``: unique prompts, no shared prefix)."""
    if kind == "serving":
        return make_serving_trace(concurrency, requests, block_size, seed)
    if kind == "multi_turn":
        return make_multi_turn_trace(concurrency, requests, block_size, seed)
    if kind == "no_reuse":
        return make_serving_trace(concurrency, requests, block_size, seed, system_prompts=1,
                                  system_blocks=0, suffix_blocks=(2, 6))
    raise ValueError(f"unknown full-pool trace {kind!r}; one of {FULL_POOL_TRACES}")


def _peak_running_blocks(events: list[tuple], block_size: int) -> int:
    """The most blocks the running requests of ``events`` hold together (no sharing counted)."""
    held: dict[str, int] = {}
    live = peak = 0
    for ev in events:
        k = ev[0]
        if k == 0:
            n = -(-len(ev[2]) // block_size)
            held[ev[1]] = n
            live += n
        elif k == 1:
            n = -(-ev[2] // block_size)
            live += n - held[ev[1]]
            held[ev[1]] = n
        elif k == 2:
            live -= held.pop(ev[1])
        peak = max(peak, live)
    return peak


def full_pool_blocks(events: list[tuple], block_size: int) -> int:
    """The pool of the full-pool steady state: 1.5 × the running requests' peak, in whole
    slots of 8 blocks (the cycle layout's), so that about a third of it holds cached
    prefixes while the trace runs, and eviction runs on most allocations."""
    return -(-(3 * _peak_running_blocks(events, block_size) // 2 + 8) // 8) * 8


def _prefill_events(num_blocks: int, block_size: int, seed: int) -> list[tuple]:
    """Requests of 8 unique complete blocks (and a partial one), each freed at once: replayed
    before a trace they leave every block of a ``num_blocks`` pool cached (published, ref 0)."""
    rng = random.Random(seed ^ 0x5EED)
    raw: list[tuple] = []
    for i in range(-(-num_blocks // 8)):
        raw.append((0, f"p{i}", [rng.randrange(1, 150_000) for _ in range(8 * block_size + 1)]))
        raw.append((2, f"p{i}"))
        raw.append((3,))
    return _flatten(raw)


def _full_pool_hits(events: list[tuple], side: Any) -> list[int]:
    """Hit tokens of every arrival of ``events`` on ``side`` (the manager or the exact-LRU
    baseline), the trace replayed once through its verbs (untimed)."""
    hits: list[int] = []
    manager = not isinstance(side, FreeListPrefixPool)
    for ev in events:
        k = ev[0]
        if k == 1:
            if side.allocate(ev[1], 1) is None:
                raise RuntimeError("the full-pool trace ran out of blocks")
            side.commit(ev[1], ev[2], ev[3])
        elif k == 0:
            rid, prompt = ev[1], ev[2]
            hit = side.lookup(rid, prompt)
            n = hit.num_tokens if manager else hit
            if manager:
                got = side.allocate(rid, len(prompt) - n, hit=hit)
            else:
                got = side.allocate(rid, len(prompt) - n)
            if got is None:
                raise RuntimeError("the full-pool trace ran out of blocks")
            side.commit(rid, len(prompt), ev[3])
            hits.append(n)
        elif k == 2:
            side.free(ev[1])
        elif manager:
            side.step()
    return hits


def _full_pool_side(kind: str, nb: int, block_size: int, prefill: list[tuple]) -> tuple:
    """A fresh side pre-filled with cached prefixes: (side, close)."""
    if kind == "manager":
        mgr, pool, driver = _manager_for(nb, block_size)
        _replay_cycles_manager(prefill, mgr)

        def close() -> None:
            mgr.close()
            pool.close()
            driver.close()
        return mgr, close
    base = FreeListPrefixPool(nb, block_size)
    _replay_cycles_baseline(prefill, base)
    return base, lambda: None


def run_full_pool(block_sizes: Sequence[int] = (16, 128), concurrency: Sequence[int] = (64, 4096),
                  requests: int = 8192, repeats: int = 5, seed: int = 0,
                  traces: Sequence[str] = FULL_POOL_TRACES) -> dict[str, Any]:
    """The full-pool steady state: every trace at every block size and concurrency, on a pool
    (:func:`full_pool_blocks`) pre-filled with cached prefixes, the manager against the
    exact-LRU free-list baseline (:class:`FreeListPrefixPool`, vLLM v1's block-pool shape) on
    the same blocks. Per case ``full_<trace>_b<bs>_c<conc>_``: ``vs_freelist_ratio`` (baseline
    CPU s per op / the manager's, medians of ``repeats`` ABBA-interleaved replays, each on a
    fresh pre-filled side; the pre-fill is not timed), ``manager_us_per_op``,
    ``hit_tokens`` / ``freelist_hit_tokens`` (sums) and ``hit_losses`` (requests whose hit is
    shorter than exact LRU's: the target is 0); per trace and block size, ``growth``: the
    manager's median per-op cost at the highest concurrency over the lowest (and
    ``freelist_growth``)."""
    out: dict[str, Any] = {}
    for bs in block_sizes:
        for trace in traces:
            med: dict[int, tuple[float, float]] = {}
            for conc in concurrency:
                events = make_full_pool_trace(trace, conc, requests, bs, seed)
                nb = full_pool_blocks(events, bs)
                prefill = _prefill_events(nb, bs, seed)
                key = f"full_{trace}_b{bs}_c{conc}"
                hits = {}
                for kind in ("manager", "baseline"):
                    side, close = _full_pool_side(kind, nb, bs, prefill)
                    try:
                        hits[kind] = _full_pool_hits(events, side)
                    finally:
                        close()
                times: dict[str, list[float]] = {"manager": [], "baseline": []}
                for r in range(repeats):
                    for kind in (("manager", "baseline") if r % 2 == 0
                                 else ("baseline", "manager")):
                        side, close = _full_pool_side(kind, nb, bs, prefill)
                        try:
                            replay = (_replay_cycles_manager if kind == "manager"
                                      else _replay_cycles_baseline)
                            s, n = replay(events, side)
                        finally:
                            close()
                        times[kind].append(s / n)
                m, b = statistics.median(times["manager"]), statistics.median(times["baseline"])
                med[conc] = (m, b)
                out[f"{key}_vs_freelist_ratio"] = b / m
                out[f"{key}_manager_us_per_op"] = m * 1e6
                out[f"{key}_pool_blocks"] = nb
                out[f"{key}_hit_tokens"] = sum(hits["manager"])
                out[f"{key}_freelist_hit_tokens"] = sum(hits["baseline"])
                out[f"{key}_hit_losses"] = sum(1 for x, y in zip(hits["manager"],
                                                                 hits["baseline"]) if x < y)
            lo, hi = min(concurrency), max(concurrency)
            if lo != hi:
                out[f"full_{trace}_b{bs}_growth_{hi}_vs_{lo}"] = med[hi][0] / med[lo][0]
                out[f"full_{trace}_b{bs}_freelist_growth_{hi}_vs_{lo}"] = med[hi][1] / med[lo][1]
    return out
