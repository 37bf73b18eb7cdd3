"""``xllm-vmm bench attention``: decode attention over paged K/V — the native kernel reading
blocks in place (:mod:`xllm_vmm.engine.attention.native_decode`) against the torch backend's
bucketed gather + SDPA path (:class:`~xllm_vmm.engine.attention.torch_sdpa.TorchSDPABackend`
with ``native_decode=False``), on the same arena, queries and block tables, interleaved.

For every case (``B`` decodes of uniformly random length in ``[min_keys, max_keys]``, bf16 or
fp32 K/V, ``H`` query heads over ``Hkv`` KV heads of ``D``, ``threads`` threads): the arena has
the engine's layout (``S`` pages of ``blocks_per_slot`` blocks of ``block_size`` tokens per
tensor; :mod:`xllm_vmm.engine.attention.kv`), the blocks of each sequence are scattered over it
(a seeded permutation), and both paths run ``repeats`` times in turn. Fields per case
(``{case}`` = ``b{B}_d{D}_t{threads}_{dtype}``): ``{case}_native_cpu_min_ms`` /
``_cpu_median_ms`` and the same for ``{case}_sdpa_`` (CPU time of the whole process, all
threads: ``time.process_time``), the same as ``_wall_min_ms`` / ``_wall_median_ms``,
``{case}_native_speedup_ratio`` (SDPA's median CPU time over the native one's: above 1 = native
is cheaper), ``{case}_max_abs_diff`` (between the two outputs). Summary:
``min_native_speedup_ratio`` (the least case) and ``native_impl`` (``avx512-bf16`` /
``avx512-f32`` / ``portable``, for bf16 K/V).

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
    page = bps * bs * hd
    flat_k = torch.randn(slots * page, generator=g).to(dtype)
    flat_v = torch.randn(slots * page, generator=g).to(dtype)
    shape, stride = (slots, bps * bs, hkv, d), (page, hd, d, 1)
    k_slots, v_slots = flat_k.as_strided(shape, stride), flat_v.as_strided(shape, stride)
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


def run(*, batches: Sequence[int] = (32, 128), head_dims: Sequence[int] = (64, 128),
        threads: Sequence[int] = (1, 2), dtypes: Sequence[str] = ("bfloat16",),
        min_keys: int = 64, max_keys: int = 640, heads: int = 8, kv_heads: int = 4,
        block_size: int = 16, blocks_per_slot: int = 4, repeats: int = 7,
        seed: int = 0) -> dict[str, Any]:
    from xllm_vmm.bench.threads import passive_omp_wait

    policy = passive_omp_wait()  # before torch loads (torch's SDPA threads, as bench engine)
    import torch

    from xllm_vmm.engine.attention import native_decode as nd
    from xllm_vmm.engine.attention.torch_sdpa import TorchSDPABackend

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
    speedups = []
    try:
        for dname in dtypes:
            dtype = table[dname]
            for d in head_dims:
                for b in batches:
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

                    for nt in threads:
                        torch.set_num_threads(nt)
                        diff = (native(nt).float() - sdpa(nt).float()).abs().max().item()
                        times: dict[str, tuple[list, list]] = {"native": ([], []),
                                                               "sdpa": ([], [])}
                        for _ in range(repeats):
                            for name, fn in (("native", native), ("sdpa", sdpa)):
                                c0, w0 = time.process_time(), time.perf_counter()
                                fn(nt)
                                times[name][0].append((time.process_time() - c0) * 1e3)
                                times[name][1].append((time.perf_counter() - w0) * 1e3)
                        key = f"b{b}_d{d}_t{nt}_{dname}"
                        for name, (cpu, wall) in times.items():
                            out[f"{key}_{name}_cpu_min_ms"] = round(min(cpu), 3)
                            out[f"{key}_{name}_cpu_median_ms"] = round(statistics.median(cpu), 3)
                            out[f"{key}_{name}_wall_min_ms"] = round(min(wall), 3)
                            out[f"{key}_{name}_wall_median_ms"] = round(statistics.median(wall), 3)
                        ratio = statistics.median(times["sdpa"][0]) / max(
                            statistics.median(times["native"][0]), 1e-9)
                        out[f"{key}_native_speedup_ratio"] = round(ratio, 3)
                        out[f"{key}_max_abs_diff"] = diff
                        speedups.append(ratio)
    finally:
        torch.set_num_threads(before)
    out["min_native_speedup_ratio"] = round(min(speedups), 3) if speedups else None
    return out
