"""``xllm-vmm bench attention``: the native paged decode kernel against the gather + SDPA path
(:mod:`xllm_vmm.bench.attention`); registered on ``bench`` by importing this module."""

from __future__ import annotations

from typing import List, Optional

import typer

from xllm_vmm.cli.bench_common import OutputFormat, bench_app, check, emit, run_bench


@bench_app.command(
    "attention", short_help="Paged attention: native kernels in place vs SDPA.",
    help=(
        "Attention over paged K/V in the engine's arena layout, interleaved on the same data. "
        "Decodes: the native kernel reading blocks in place against the torch backend's "
        "bucketed gather + SDPA (case b{B}_d{D}_t{threads}_{dtype}: _native_/_sdpa_ "
        "cpu/wall min/median ms, _native_speedup_ratio = SDPA CPU time over native, and the "
        "roofline: _native_read_gbps, _stream_read_gbps of a plain read of the same bytes, "
        "_roofline_ratio). Prefill chunks (--prefill N or N:OFFSET, --prefill-tokens per "
        "call): the torch backend with its chunks on the native prefill kernel against SDPA "
        "(case p{N}_o{OFFSET}_d{D}_t{threads}_{dtype}, the same fields). Summary: "
        "min_native_speedup_ratio, min_prefill_speedup_ratio, native_impl, prefill_impl."))
def bench_attention(
    batch: List[int] = typer.Option([32, 128], help="Decodes per call (repeatable)."),
    head_dim: List[int] = typer.Option([64, 128], help="Head size (repeatable)."),
    threads: List[int] = typer.Option([1, 2], help="Threads (repeatable)."),
    dtype: List[str] = typer.Option(["bfloat16"],
                                    help="K/V and query dtype: bfloat16, float32 (repeatable)."),
    min_keys: int = typer.Option(64, help="Fewest keys of a decode."),
    max_keys: int = typer.Option(640, help="Most keys of a decode."),
    heads: int = typer.Option(8, help="Query heads."),
    kv_heads: int = typer.Option(4, help="KV heads."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    repeats: int = typer.Option(7, help="Interleaved runs of each path (1 to 100)."),
    seed: int = typer.Option(0, help="Seed of the lengths, block tables and data."),
    prefill: List[str] = typer.Option(
        ["512", "128", "512:1024", "32"],
        help="Prefill case: chunks of N queries after OFFSET cached keys, N or N:OFFSET "
             "(repeatable; --prefill none for decodes only)."),
    prefill_tokens: int = typer.Option(2048, help="Query tokens per prefill call (chunks of N)."),
    vllm_venv: Optional[str] = typer.Option(
        None, "--vllm-venv", help="A venv with vLLM's CPU build: run its CPU attention op on the "
        "same cases after ours (_vllm_ fields, _native_vs_vllm_ratio = vLLM's CPU time over "
        "ours, min_native_vs_vllm_ratio, min_prefill_vs_vllm_ratio)."),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", help="table or json."),
) -> None:
    from xllm_vmm.bench import attention

    for b in batch:
        check("--batch", b, 1, 4096)
    for d in head_dim:
        check("--head-dim", d, 1, 512)
    for t in threads:
        check("--threads", t, 1, 64)
    check("--repeats", repeats, 1, 100)
    check("--max-keys", max_keys, 1, 32768)
    check("--block-size", block_size, 1, 1024)
    check("--prefill-tokens", prefill_tokens, 1, 65536)
    prefill = [p for p in prefill if p != "none"]  # a bad case: ValueError, exit 2 (_run)
    results = run_bench("bench attention", lambda: attention.run(
        batches=batch, head_dims=head_dim, threads=threads, dtypes=dtype, min_keys=min_keys,
        max_keys=max_keys, heads=heads, kv_heads=kv_heads, block_size=block_size,
        repeats=repeats, seed=seed, prefill=prefill, prefill_tokens=prefill_tokens,
        vllm_venv=vllm_venv))
    emit("bench attention (native kernels in place vs SDPA)", results, fmt)
