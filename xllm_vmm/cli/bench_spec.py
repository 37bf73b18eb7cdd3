"""``xllm-vmm bench spec``: MTP speculative decoding against the same engine without it
(:mod:`xllm_vmm.bench.spec_decode`); registered on ``bench`` by importing this module."""

from __future__ import annotations

from typing import Optional

import typer

from xllm_vmm.cli.bench_common import OutputFormat, bench_app, check, emit, fail, run_bench


@bench_app.command(
    "spec", short_help="MTP speculative decoding vs no speculation: speed-up and acceptance.",
    help=(
        'The engine with an MTP draft (--num-speculative-tokens K) against the same engine '
        'without it, alternating over the same greedy prompts in one run (fields spec_speedup, '
        'acceptance_rate, acceptance_per_pos_j, mean_accepted_length, target_passes_ratio, '
        'greedy_identical). The target is the test suite\'s tiny DeepSeek-V3 with its residual '
        'branches scaled by --branch-scale and the draft is distilled against it (built once, '
        'cached). Needs transformers and a source checkout.'))
def bench_spec(
    k: int = typer.Option(2, "--num-speculative-tokens", help="Draft tokens per step (1 to 8)."),
    prompts: int = typer.Option(8, help="Prompts per run (1 to 256)."),
    prompt_len: int = typer.Option(6, help="Tokens per prompt (1 to 512)."),
    new_tokens: int = typer.Option(32, help="New tokens per prompt (2 to 1024)."),
    repeats: int = typer.Option(3, help="Alternating runs of each engine (1 to 100)."),
    branch_scale: float = typer.Option(0.01, help="Residual-branch scale of the built target "
                                       "(the tests' 2-layer target uses 0.03)."),
    distill_steps: int = typer.Option(150, help="Distillation steps of the draft (1 to 5000)."),
    layers: int = typer.Option(8, help="Decoder layers of the built target (2 to 32; the tests' is 2)."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    device_memory: str = typer.Option("256MiB", help="Emulated device memory the engines size for."),
    elastic: bool = typer.Option(True, "--elastic/--fixed", help="Elastic or fixed VMM pool."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's)."),
    seed: int = typer.Option(0, help="Seed of the model, the draft and the prompts."),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", help="table or json."),
) -> None:
    from xllm_vmm.bench import spec_decode
    from xllm_vmm.config import ConfigError

    check("--num-speculative-tokens", k, 1, 8)
    check("--prompts", prompts, 1, 256)
    check("--prompt-len", prompt_len, 1, 512)
    check("--new-tokens", new_tokens, 2, 1024)
    check("--repeats", repeats, 1, 100)
    check("--distill-steps", distill_steps, 1, 5000)
    check("--layers", layers, 2, 32)
    try:
        results = run_bench("bench spec", lambda: spec_decode.run(
            k=k, prompts=prompts, prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats,
            branch_scale=branch_scale, distill_steps=distill_steps, layers=layers,
            block_size=block_size,
            device_memory=device_memory, elastic=elastic, threads=threads, seed=seed))
    except ConfigError as exc:
        raise fail(2, f"bench spec: {exc}") from None
    emit("bench spec (MTP speculative decoding vs none)", results, fmt)
