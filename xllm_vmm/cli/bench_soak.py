"""``xllm-vmm bench soak``: ``serve`` on the demo model under a bounded mixed load of good and
bad requests, disconnects and sleep/wake cycles (:mod:`xllm_vmm.bench.soak`); registered on
``bench`` by importing this module."""

from __future__ import annotations

import typer

from xllm_vmm.cli.bench_common import OutputFormat, bench_app, emit, fail, run_bench


@bench_app.command(
    "soak", short_help="serve on the demo model under mixed good/bad load, disconnects and "
                       "sleep/wake: 5xx, pool idle, RSS drift.",
    help=(
        'Starts `xllm-vmm serve --model demo --enable-admin` in a child process and drives it '
        'for --seconds with --concurrency workers: good completions and chats (streamed or '
        'not), bad requests that must be 4xx, clients that leave mid-stream, and a sleep/wake '
        'cycle through the admin routes every --sleep-every seconds. Reports counts by status '
        'and kind, every 5xx but the documented 503 with its body, the pool at the end '
        '(pool_idle: no live block, mapped KV at its floor, /metrics agreeing with /vmm/status), '
        'the server\'s RSS after the warm-up and at the end (both idle) and their ratio, and '
        'its exit status after SIGTERM; healthy says whether all of it holds (exit 1 if not).'))
def bench_soak(
    seconds: float = typer.Option(600.0, help="Seconds of load (5 to 86400)."),
    concurrency: int = typer.Option(8, help="Workers, one request out each (1 to 256)."),
    sleep_every: float = typer.Option(15.0, "--sleep-every", help="Seconds between sleep/wake "
                                      "cycles (light and deep in turn)."),
    seed: int = typer.Option(0, help="Seed of the load."),
    serve_arg: list[str] = typer.Option([], "--serve-arg", help="Extra flag for serve "
                                        "(repeatable)."),
    fmt: OutputFormat = typer.Option(OutputFormat.table, "--format", help="table or json."),
) -> None:
    from xllm_vmm.bench import soak

    cfg = soak.SoakConfig(duration_s=seconds, concurrency=concurrency, seed=seed,
                          sleep_every_s=sleep_every)
    try:
        cfg.check()
    except ValueError as exc:
        raise fail(2, str(exc)) from None
    out = run_bench("bench soak", lambda: soak.run(cfg, serve_args=list(serve_arg)))
    emit("bench soak", out if fmt is OutputFormat.json else soak.flat(out), fmt)
    if not out["healthy"]:
        raise typer.Exit(1)
