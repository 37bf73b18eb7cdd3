"""``xllm-vmm bench ...``: benchmarks that print ratios against a baseline run in the same
process. Each subcommand calls a function in :mod:`xllm_vmm.bench` that returns a flat dict of
results; this module only formats it (``--format table`` or ``json``)."""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import typer

from xllm_vmm.cli.app import app

bench_app = typer.Typer(help="Benchmarks (ratios against a baseline measured in the same run).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


def emit(title: str, results: dict[str, Any], fmt: OutputFormat) -> None:
    """Print one benchmark's results as a rich table or as JSON on stdout."""
    if fmt is OutputFormat.json:
        typer.echo(json.dumps(results, indent=2, sort_keys=True, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in results.items():
        if isinstance(value, float):
            text = f"{value:.4g}"
        else:
            text = str(value)
        table.add_row(key, text)
    Console().print(table)


# Subcommands: map/copy (device layer), kvcache (virtual KV cache), prefix (prefix cache).
