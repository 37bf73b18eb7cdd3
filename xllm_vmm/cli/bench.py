"""``xllm-vmm bench ...``: benchmarks that print ratios against a baseline run in the same
process. Each subcommand calls a function in :mod:`xllm_vmm.bench` that returns a flat dict of
results; this module only checks the options and formats the results
(:mod:`xllm_vmm.cli.bench_common`: ``--format table`` or ``json``).

Subcommands here: map/copy (device layer), kvcache (virtual KV cache), prefix (prefix cache
and host tier), weights, engine, serve; ``spec`` and ``attention`` are in their own modules."""

from __future__ import annotations

from typing import Optional

import typer

from xllm_vmm.cli.bench_common import (  # noqa: F401  (emit, plain, unit_of, target_text: the table, re-exported)
    ACL_HELP,
    DEVICE_HELP,
    MAX_REPEATS,
    TARGETS,
    OutputFormat,
    bench_app,
    check,
    emit,
    fail,
    plain,
    run_bench,
    run_on_driver,
    target_text,
    unit_of,
)


@bench_app.command(
    "map", short_help="Map+unmap cost per 2 MiB page against the raw system-call loop.",
    help=(
        'Map+unmap cost per 2 MiB page: batched native call vs one call per page vs the raw '
        'system-call loop (fields batched_vs_raw_ratio, python_overhead_us_per_page); on the host'
        ' driver also with populated mappings, and map + first write with and without populating.'))
def bench_map(
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    device_index: int = typer.Option(0, "--device-index", min=0, help="Device number."),
    pages: int = typer.Option(64, "--pages", help="2 MiB pages mapped per batch (must fit in "
                                                  "free memory twice on the host driver)."),
    rounds: int = typer.Option(20, "--rounds", help="Map+unmap rounds per measurement (1 to "
                                                    "100000)."),
    repeats: int = typer.Option(7, "--repeats", help="Interleaved measurements of every way; "
                                                     "the best and the median are reported "
                                                     "(1 to 100)."),
    release_pages: int = typer.Option(64, "--release-pages", help="Host driver: written 2 MiB "
                                      "pages unmapped + released per backing (fields "
                                      "release_ms_per_gib_*); 0 skips it."),
    hugepages_setup: bool = typer.Option(True, "--hugepages-setup/--no-hugepages-setup",
                                         help="Host driver, root: turn huge pages on for the "
                                              "release measurement and restore the settings."),
    acl_library: Optional[str] = typer.Option(None, "--acl-library", help=ACL_HELP),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help="table or json."),
) -> None:
    from xllm_vmm.bench import map as map_bench

    check("--pages", pages, 1, 1 << 30)
    check("--rounds", rounds, 1, 100_000)
    check("--repeats", repeats, 1, MAX_REPEATS)
    check("--release-pages", release_pages, 0, 1 << 20)
    run_on_driver("bench map", "bench map (µs per page, map+unmap)", fmt, device, device_index,
                  acl_library, lambda driver: map_bench.run(
                      driver, pages=pages, rounds=rounds, repeats=repeats,
                      release_pages=release_pages, hugepages_setup=hugepages_setup))


@bench_app.command(
    "copy", short_help="Gather/scatter of scattered blocks against memcpy of the same bytes.",
    help=(
        'Gather/scatter of scattered blocks vs one plain memcpy of the same bytes (field '
        'copy_vs_memcpy_ratio).'))
def bench_copy(
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    device_index: int = typer.Option(0, "--device-index", min=0, help="Device number."),
    blocks: int = typer.Option(128, "--blocks", help="Blocks per batch, one per 2 MiB page "
                                                     "(pages and a host buffer must fit in "
                                                     "free memory)."),
    min_block: int = typer.Option(64 * 1024, "--min-block", help="Smallest block, bytes."),
    max_block: int = typer.Option(2 * 1024 * 1024, "--max-block", help="Largest block, bytes (≤ 2 MiB)."),
    repeats: int = typer.Option(5, "--repeats", help="Measurements; the best is kept (1 to 100)."),
    acl_library: Optional[str] = typer.Option(None, "--acl-library", help=ACL_HELP),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help="table or json."),
) -> None:
    from xllm_vmm.bench import copy as copy_bench

    check("--blocks", blocks, 1, 1 << 30)
    check("--repeats", repeats, 1, MAX_REPEATS)
    run_on_driver("bench copy", "bench copy (GB/s)", fmt, device, device_index, acl_library,
                  lambda driver: copy_bench.run(driver, blocks=blocks, min_block=min_block,
                                                max_block=max_block, repeats=repeats))


@bench_app.command(
    "kvcache", short_help="Virtual KV cache against a plain free-list block pool: throughput, fragmentation.",
    help=(
        'Virtual KV cache vs. a plain free-list block pool: allocator throughput, whole request '
        'cycles through the KV cache manager (prefix caching on) against a free list with a '
        'dict hash index, per-op cost growth from 64 to 4096 running requests, admission cost, '
        'fragmentation (idle and peak footprint over the packed floor) and map calls per 1k '
        'tokens.'))
def bench_kvcache(
    sequences: int = typer.Option(256, help="Sequences in the staggered-decode burst (1 to "
                                            "16384)."),
    layers: int = typer.Option(36, help="Layers of the modelled GQA model (8 KV heads of 128, "
                                        "bf16; 1 to 512)."),
    block_size: int = typer.Option(128, help="Tokens per block (1 to 1024: a block of one "
                                             "layer's K must fit in a 2 MiB page)."),
    long_fraction: float = typer.Option(0.1, help="Share of sequences that outlive the burst."),
    driver: str = typer.Option("sim", help="Driver for the fragmentation trace: sim (maps "
                                           "nothing) or host (maps real memory: the trace's "
                                           "peak is 40.4 GiB with the defaults and 12.1 GiB "
                                           "with --sequences 64 at 36 layers; a size that "
                                           "does not fit is refused, naming the largest "
                                           "--sequences that does)."),
    seed: int = typer.Option(0, help="Seed of the trace."),
    repeats: int = typer.Option(7, help="Interleaved repeats of every speed measurement (min "
                                        "and median reported; 1 to 100)."),
    min_seconds: float = typer.Option(0.2, help="Each speed measurement replays its trace at "
                                                "least this long (seconds, 0 to 60)."),
    cycle_requests: int = typer.Option(2048, help="Requests of the serving trace whose whole "
                                                  "cycles run through the manager (1 to "
                                                  "1048576)."),
    growth_requests: int = typer.Option(8192, help="Requests of each cost-growth trace (at 64 "
                                                   "and 4096 running; 1 to 1048576)."),
    full_pool_requests: int = typer.Option(0, help="Requests of each full-pool steady-state "
                                                   "trace (serving, multi-turn, no reuse; "
                                                   "blocks of 16 and 128; a pool pre-filled "
                                                   "with cached prefixes); 0 (default) skips "
                                                   "it (0 to 1048576)."),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help="table or json."),
) -> None:
    from xllm_vmm.bench.kvcache import MAX_BLOCK_SIZE, KvBenchConfig, run_kvcache_bench

    if driver not in ("sim", "host"):
        raise fail(2, f"--driver must be 'sim' or 'host', got {driver!r}")
    check("--sequences", sequences, 1, 16384)
    check("--layers", layers, 1, 512)
    check("--block-size", block_size, 1, MAX_BLOCK_SIZE)
    check("--repeats", repeats, 1, MAX_REPEATS)
    check("--seed", seed, 0, 2 ** 63 - 1)
    if not 0.0 < long_fraction < 1.0:  # NaN fails this too
        raise fail(2, f"--long-fraction must be in (0, 1), got {long_fraction}")
    if not 0.0 <= min_seconds <= 60.0:  # NaN fails this too
        raise fail(2, f"--min-seconds must be in [0, 60], got {min_seconds}")
    check("--cycle-requests", cycle_requests, 1, 1 << 20)
    check("--growth-requests", growth_requests, 1, 1 << 20)
    check("--full-pool-requests", full_pool_requests, 0, 1 << 20)
    cfg = KvBenchConfig(full_pool_requests=full_pool_requests,
                        sequences=sequences, layers=layers, block_size=block_size,
                        long_fraction=long_fraction, driver=driver, seed=seed, repeats=repeats,
                        min_seconds=min_seconds, cycle_requests=cycle_requests,
                        growth_requests=growth_requests)
    emit("bench kvcache", run_bench(f"bench kvcache --driver {driver}",
                               lambda: run_kvcache_bench(cfg)), fmt)


@bench_app.command(
    "prefix", short_help="Prefix cache and host KV tier: hashing, lookup, hit rates, restore bandwidth.",
    help=(
        'Prefix cache and host KV tier: XXH3-128 vs SHA-256 hash chain, lookup cost at 1k and 1M '
        'cached blocks, device-only vs host-tier hit rate under memory pressure, restore/offload '
        'vs memcpy bandwidth, and bytes freed per evicted block (slot-emptying vs plain LRU).'))
def bench_prefix(
    driver: str = typer.Option("host", help="Driver for the shared-prefix workload: host, or "
                                            "acl-emu (the bundled ACL emulation)."),
    block_size: int = typer.Option(128, help="Tokens per block (1 to 1024)."),
    hash_tokens: int = typer.Option(1 << 19, help="Tokens hashed by the hash-chain comparison "
                                                  "(--block-size to 8388608)."),
    lookup_blocks: int = typer.Option(1 << 20, help="Cached blocks for lookup_us_1m (1024 to "
                                                    "4194304; ~200 MiB per 1M)."),
    requests: int = typer.Option(120, help="Requests in the shared-prefix workload (1 to "
                                           "1000; ~20 ms each)."),
    system_prompts: int = typer.Option(6, help="Distinct system prompts in the workload (1 to "
                                               "256)."),
    host_blocks_factor: float = typer.Option(4.0, help="host_blocks_factor of the host tier "
                                                       "run (> 1, up to 1024; the host pool "
                                                       "must fit in host memory)."),
    seed: int = typer.Option(0, help="Seed of the workload."),
    populate: bool = typer.Option(True, "--populate/--no-populate",
                                  help="Host driver: populate KV slot mappings at map time "
                                       "(and run the workload once more without, to compare)."),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help="table or json."),
) -> None:
    from xllm_vmm.bench.prefix import PrefixBenchConfig, run_prefix_bench

    if driver not in ("host", "acl-emu"):
        raise fail(2, f"--driver must be 'host' or 'acl-emu', got {driver!r}")
    check("--block-size", block_size, 1, 1024)
    for name, value, least, most in (("--hash-tokens", hash_tokens, block_size, 1 << 23),
                                     ("--lookup-blocks", lookup_blocks, 1024, 1 << 22),
                                     ("--requests", requests, 1, 1000),
                                     ("--system-prompts", system_prompts, 1, 256),
                                     ("--seed", seed, 0, 2 ** 63 - 1)):
        if value < least:
            raise fail(2, f"{name} must be >= {least}, got {value}")
        check(name, value, least, most)
    if not host_blocks_factor > 1:  # NaN fails this too
        raise fail(2, f"--host-blocks-factor must be > 1 (the host tier is off at 1 or "
                       f"less, HK-03), got {host_blocks_factor}")
    check("--host-blocks-factor", host_blocks_factor, 1, 1024)
    cfg = PrefixBenchConfig(driver=driver, block_size=block_size, hash_tokens=hash_tokens,
                            lookup_blocks=lookup_blocks, requests=requests,
                            system_prompts=system_prompts,
                            host_blocks_factor=host_blocks_factor, seed=seed,
                            populate=populate)
    emit("bench prefix", run_bench(f"bench prefix --driver {driver}", lambda: run_prefix_bench(cfg)),
         fmt)


@bench_app.command(
    "weights", short_help="Weights in the pool: load, light/deep sleep, wakeup, fork, cycles.",
    help=(
        'Weights in the VMM pool on a checkpoint built locally (default about 1 GiB of bf16 in 4 '
        'shards, removed afterwards) or --model DIR: load_seconds (full reload, page cache '
        'dropped), light_sleep_seconds, sleep_released_fraction, wakeup_seconds, '
        'wakeup_vs_reload_ratio, wakeup_vs_memcpy_ratio, phases of sleep and wakeup, the engine '
        'sleep with a KV cache, deep_wakeup_seconds, fork_extra_weight_bytes, '
        'cycle_growth_bytes; on cpu once per huge-page backing (--hugepages).'))
def bench_weights(
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    device_index: int = typer.Option(0, "--device-index", min=0, help="Device number."),
    size: str = typer.Option("1GiB", "--size", help="Bytes of the built checkpoint (1MiB to "
                                                    "1TiB; needs about 3 times that of host "
                                                    "memory)."),
    shards: int = typer.Option(4, "--shards", help="Safetensors files of the built checkpoint "
                                                   "(1 to 1024)."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32."),
    model: Optional[str] = typer.Option(None, "--model", help="Benchmark this model directory "
                                                              "instead of building one."),
    repeats: int = typer.Option(3, "--repeats", help="Measurements per figure (1 to 100); the "
                                                     "best and the median are reported."),
    cycles: int = typer.Option(20, "--cycles", help="Sleep/wake cycles for cycle_growth_bytes "
                                                    "(1 to 10000)."),
    acl_library: Optional[str] = typer.Option(None, "--acl-library", help=ACL_HELP),
    hugepages: str = typer.Option("hugetlb,thp,off", "--hugepages",
                                  help="cpu: backings to measure, comma-separated, of hugetlb, "
                                       "thp, off, auto (the first gives the top-level fields; "
                                       "as root the bench enables hugetlb/thp for its own "
                                       "measurement and restores the settings)."),
    kv_size: str = typer.Option("256MiB", "--kv-size", help="KV cache (prefix-cached blocks) "
                                                             "slept with the weights for the "
                                                             "engine_* fields; 0 skips them."),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", "-f", help="table or json."),
) -> None:
    from xllm_vmm.bench import weights as weights_bench
    from xllm_vmm.config.values import parse_size

    try:
        size_bytes = parse_size(size)
    except ValueError:
        raise fail(2, f"--size {size!r} is not a size (e.g. 1GiB, 512MiB)") from None
    check("--size", size_bytes, 1 << 20, 1 << 40)
    check("--shards", shards, 1, 1024)
    check("--repeats", repeats, 1, MAX_REPEATS)
    check("--cycles", cycles, 1, 10_000)
    try:
        kv_bytes = parse_size(kv_size)
        backings = weights_bench.parse_backings(hugepages)
    except ValueError as exc:
        raise fail(2, str(exc) if "--hugepages" in str(exc)
                    else f"--kv-size {kv_size!r} is not a size (e.g. 256MiB, 0)") from None
    check("--kv-size", kv_bytes, 0, 1 << 40)
    opts = dict(size_bytes=size_bytes, shards=shards, dtype=dtype, repeats=repeats,
                cycles=cycles, model_dir=model, kv_size=kv_bytes)
    from xllm_vmm.vmm import DRIVER_KINDS

    if DRIVER_KINDS.get(device.lower()) == "host":
        results = run_bench("bench weights", lambda: weights_bench.run_host(
            backings, device_index=device_index, **opts))
        emit("bench weights", results, fmt)
        return
    run_on_driver("bench weights", "bench weights", fmt, device, device_index, acl_library,
                  lambda driver: weights_bench.run(driver, **opts))


@bench_app.command(
    "engine", short_help="LLM.generate against Hugging Face generate on the same checkpoint and prompts.",
    help=(
        'LLM.generate (continuous batching over the VMM pool) vs Hugging Face generate (padded '
        'static batches) on the same checkpoint and prompts, side by side in one run (fields '
        'vs_hf_generate_ratio, ttft_s_*, tpot_s_*, tokens/s by batch size, '
        'peak_mapped_over_live_kv). Needs transformers.'))
def bench_engine(
    model: Optional[str] = typer.Option(None, "--model", help="Local model directory (default: a "
                                        "Llama built locally from --layers/--hidden/--dtype)."),
    prompts: int = typer.Option(128, help="Prompts in the trace (1 to 4096)."),
    min_prompt: int = typer.Option(64, help="Shortest prompt, tokens."),
    max_prompt: int = typer.Option(512, help="Longest prompt, tokens."),
    new_tokens: int = typer.Option(128, help="New tokens per prompt."),
    hf_batch: int = typer.Option(32, help="Prompts per padded HF batch."),
    batch_sizes: str = typer.Option("1,8,32", help="Batch sizes of the equal-prompt runs."),
    equal_prompt: int = typer.Option(128, help="Prompt tokens of the equal-prompt runs."),
    repeats: int = typer.Option(2, help="Alternating engine/HF runs of the trace (1 to 100)."),
    layers: int = typer.Option(4, help="Layers of the built model (1 to 64)."),
    hidden: int = typer.Option(512, help="Hidden size of the built model (64 to 8192)."),
    dtype: str = typer.Option("bfloat16", help="float32 or bfloat16."),
    elastic: bool = typer.Option(True, "--elastic/--fixed", help="Elastic or fixed VMM pool."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    device_memory: str = typer.Option("4GiB", help="Emulated device memory the engine sizes for."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's)."),
    seed: int = typer.Option(0, help="Seed of the trace."),
    vllm_venv: Optional[str] = typer.Option(None, "--vllm-venv", help="A venv with vLLM's CPU "
                                            "build: its LLM.generate runs side by side "
                                            "(vs_vllm_ratio)."),
    max_tokens_per_batch: int = typer.Option(2048, "--max-tokens-per-batch", help="The engine's per-step token budget (vLLM keeps its own; both are printed)."),
    residency: str = typer.Option("exclusive", "--residency", help="With --vllm-venv: exclusive (vLLM started for each of its runs and stopped after it, never resident while the engine and HF run) or shared (started once, paused while the others run)."),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", help="table or json."),
) -> None:
    from xllm_vmm.bench import engine as engine_bench

    check("--prompts", prompts, 1, 4096)
    check("--max-prompt", max_prompt, 1, 32768)
    check("--new-tokens", new_tokens, 1, 32768)
    check("--repeats", repeats, 1, MAX_REPEATS)
    check("--layers", layers, 1, 64)
    check("--hidden", hidden, 64, 8192)
    try:
        sizes = [int(x) for x in batch_sizes.split(",") if x.strip()]
    except ValueError:
        raise fail(2, f"--batch-sizes must be comma-separated integers, got {batch_sizes!r}") from None
    from xllm_vmm.config import ConfigError

    try:
        results = run_bench("bench engine", lambda: engine_bench.run(
            model=model, prompts=prompts, min_prompt=min_prompt, max_prompt=max_prompt,
            new_tokens=new_tokens, hf_batch=hf_batch, batch_sizes=sizes,
            equal_prompt=equal_prompt, repeats=repeats, layers=layers, hidden=hidden,
            dtype=dtype, seed=seed, elastic=elastic, block_size=block_size,
            device_memory=device_memory, threads=threads, vllm_venv=vllm_venv,
            max_tokens_per_batch=max_tokens_per_batch, residency=residency))
    except ConfigError as exc:
        raise fail(2, f"bench engine: {exc}") from None
    emit("bench engine (output tokens/s)", results, fmt)


@bench_app.command(
    "serve", short_help="xllm-vmm serve under a bounded loopback load: tok/s, TTFT/TPOT/ITL, mapped KV.",
    help=(
        'Starts `xllm-vmm serve` in a child process (or drives --url), sends --num-prompts '
        'streamed completions of random token prompts (--input-len ± --range-ratio, '
        '--output-len tokens each, ignore_eos) as a Poisson stream of --request-rate per second, '
        'and reports output tokens/s, TTFT/TPOT/ITL median and p99, failures, peak mapped KV '
        'bytes and mapped KV after the load. Default model: the 4-layer, hidden-512 bf16 Llama '
        'of `bench engine`, served with the KV cache in an elastic VMM pool (weights: serve\'s '
        'default; --serve-arg=--enable_vmm_weights=true puts them in the pool too).'))
def bench_serve(
    model: Optional[str] = typer.Option(None, help="Model directory (default: the bench Llama)."),
    url: Optional[str] = typer.Option(None, help="Drive this running server instead of starting one."),
    num_prompts: int = typer.Option(128, help="Requests (1 to 100000)."),
    request_rate: float = typer.Option(32.0, help="Requests per second (inf: all at once)."),
    input_len: int = typer.Option(256, help="Mean prompt tokens."),
    range_ratio: float = typer.Option(0.5, help="Prompt lengths in input_len × [1-r, 1+r]."),
    output_len: int = typer.Option(128, help="Output tokens per request (ignore_eos)."),
    seed: int = typer.Option(0, help="Seed of prompts and arrivals."),
    timeout: float = typer.Option(600.0, help="Seconds the load may take in all."),
    serve_arg: list[str] = typer.Option([], "--serve-arg", help="Extra flag for serve (repeatable), e.g. --serve-arg=--vmm_elastic=false."),
    vllm_venv: Optional[str] = typer.Option(None, "--vllm-venv", help="A venv with vLLM's CPU build: run `vllm serve` of the same model side by side (interleaved rounds, same load) and report vs_vllm_throughput_ratio."),
    rounds: int = typer.Option(3, help="With --vllm-venv: measured rounds, each driving every server (warmed up) one at a time with the same new prompts, alternating which goes first."),
    warmup_prompts: int = typer.Option(32, "--warmup-prompts", help="With --vllm-venv: prompts of the same-shaped warm-up load each server gets before the rounds (not counted; 0: none)."),
    vllm_env: list[str] = typer.Option([], "--vllm-env", help="With --vllm-venv: KEY=VALUE added to vllm serve's environment (repeatable), e.g. --vllm-env VLLM_CPU_OMP_THREADS_BIND=0-1."),
    vllm_kv_space: int = typer.Option(2, "--vllm-kv-space", help="With --vllm-venv: VLLM_CPU_KVCACHE_SPACE, whole GiB of KV vLLM reserves up front."),
    vmm_weights_side: bool = typer.Option(False, "--vmm-weights-side/--no-vmm-weights-side", help="With --vllm-venv: also run a server of ours with --enable_vmm_weights=true (the weights in the pool too) in every round, beside the headline (serve's default weights). Off by default (a third server's runs take time); with --residency shared its resident memory slowed the headline's page commits (docs/benchmarks.md)."),
    order: str = typer.Option("alternate", "--order", help="With --vllm-venv: alternate (ours first in even rounds, vLLM first in odd ones) or fixed (the even rounds' order every round)."),
    residency: str = typer.Option("exclusive", "--residency", help="With --vllm-venv: exclusive (one server on the machine at a time: each run starts its server, warms it up, measures it and stops it) or shared (every server up for the whole comparison, the idle ones paused; a resident vLLM's memory slowed our elastic KV cache's page commits on this machine: docs/benchmarks.md)."),
    engine_only: bool = typer.Option(False, "--engine-only", help="Replay the same load straight on the engine in this process (no HTTP, no server threads): the server's share is the difference."),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", help="table or json."),
) -> None:
    from xllm_vmm.bench import serve as serve_bench

    cfg = serve_bench.LoadConfig(num_prompts=num_prompts, request_rate=request_rate,
                                 input_len=input_len, range_ratio=range_ratio,
                                 output_len=output_len, seed=seed, timeout=timeout)
    try:
        cfg.check()
    except ValueError as exc:
        raise fail(2, str(exc)) from None
    args = None
    if url is None:
        args = serve_bench.serve_args(model, list(serve_arg), input_len, range_ratio, output_len)
    if engine_only:
        from xllm_vmm.bench import serve_replay

        if url is not None or vllm_venv is not None:
            raise fail(2, "--engine-only runs the engine in this process: drop --url and "
                           "--vllm-venv")
        emit("bench serve --engine-only", run_bench("bench serve", lambda: serve_replay.replay(
            cfg, args)), fmt)
        return
    if vllm_venv is not None:
        from xllm_vmm.bench import serve_compare

        if url is not None:
            raise fail(2, "--vllm-venv starts both servers itself: drop --url")
        try:
            env = serve_compare.parse_env(vllm_env)
        except ValueError as exc:
            raise fail(2, str(exc)) from None
        out = run_bench("bench serve", lambda: serve_compare.compare(
            cfg, args, vllm_venv, rounds=rounds, kv_space_gib=vllm_kv_space,
            warmup_prompts=warmup_prompts, vllm_env=env, vmm_weights_side=vmm_weights_side,
            order=order, residency=residency))
        emit("bench serve: xllm-vmm vs vllm serve", out if fmt is OutputFormat.json
             else serve_compare.flat(out), fmt)
        return
    emit("bench serve", run_bench("bench serve", lambda: serve_bench.run(cfg, serve_args=args, url=url)), fmt)
