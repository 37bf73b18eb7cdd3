"""vLLM's CPU attention op on ``bench attention``'s shapes, run inside a venv holding vLLM's CPU
build (``bench attention --vllm-venv``; never imported by xllm_vmm: this file imports only
torch and vllm).

Reads a JSON spec on stdin — ``{"cases": [...], "repeats": R}``, each case ``{"key": ...,
"kind": "decode" | "prefill", "dtype": "bfloat16" | "float32", "heads", "kv_heads",
"head_dim", "threads"}`` plus ``"lens"`` (a decode per entry) or ``"n", "off", "chunks"`` (chunks
of n queries each ending a sequence of off + n keys) — and writes one JSON object to stdout:
``{key}_vllm_cpu_min_ms`` / ``_vllm_cpu_median_ms`` / ``_vllm_wall_median_ms`` per case (CPU
time of the whole process, ``time.process_time``, of one ``cpu_attention_with_kv_cache`` call:
one layer) and ``vllm_isa``. The KV cache has vLLM's own CPU layout and default block size
(``[blocks, kv_heads, 128, 2 * head_dim]``, head-major blocks), filled with random values, the
blocks of each sequence scattered by a seeded permutation; the scheduler metadata is built once
per case, outside the timing, as vLLM builds it once per step.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

BLOCK = 128


def _isa(torch, dtype) -> str:
    amx = dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()
    if amx:
        torch._C._cpu._init_amx()  # the tile data permission vLLM's CPU worker asks for
    return "amx" if amx else "vec"


def _case(torch, ops, c: dict, repeats: int) -> dict:
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[c["dtype"]]
    h, hkv, d = c["heads"], c["kv_heads"], c["head_dim"]
    g = torch.Generator().manual_seed(0)
    if c["kind"] == "decode":
        lens = list(c["lens"])
        qlens = [1] * len(lens)
    else:
        lens = [c["off"] + c["n"]] * c["chunks"]
        qlens = [c["n"]] * c["chunks"]
    nbs = [-(-n // BLOCK) for n in lens]
    nblk = sum(nbs) + 1
    kvc = torch.randn(nblk, hkv, BLOCK, 2 * d, generator=g).to(dtype)
    kc, vc = kvc.view(nblk, hkv, BLOCK * 2, d).chunk(2, dim=2)
    perm = torch.randperm(nblk, generator=g)
    table = torch.zeros(len(lens), max(nbs), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nbs):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    q = torch.randn(sum(qlens), h, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    qsl = torch.tensor([0] + [sum(qlens[:i + 1]) for i in range(len(qlens))], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    isa = _isa(torch, dtype)
    torch.set_num_threads(c["threads"])
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(lens), num_heads=h, num_kv_heads=hkv, head_dim=d, seq_lens=sl, dtype=dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)

    def call() -> None:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=sl,
            scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0, scheduler_metadata=md, s_aux=None)

    call()
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        call()
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    k = c["key"]
    return {f"{k}_vllm_cpu_min_ms": round(min(cpu), 3),
            f"{k}_vllm_cpu_median_ms": round(statistics.median(cpu), 3),
            f"{k}_vllm_wall_median_ms": round(statistics.median(wall), 3), "vllm_isa": isa}


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    spec = json.load(sys.stdin)
    import torch
    from vllm import _custom_ops as ops
    import vllm._C  # noqa: F401  (registers torch.ops._C)

    res: dict = {}
    for c in spec["cases"]:
        res.update(_case(torch, ops, c, spec["repeats"]))
    sys.stdout.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
