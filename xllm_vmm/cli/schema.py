"""``xllm-vmm schema``: the JSON Schema of xllm-vmm's TOML files (editors use it through a
``#:schema`` comment or their own settings). Generated from the flag catalogue via pydantic."""

from __future__ import annotations

import json
from typing import Optional

import typer

from xllm_vmm.cli.root import app


@app.command("schema")
def schema_command(
    output: Optional[str] = typer.Option(None, "--output", "-o",
                                         help="Write the schema to this file instead of stdout."),
) -> None:
    """Print the JSON Schema for xllm-vmm TOML configuration files."""
    from xllm_vmm.config.model import toml_schema

    text = json.dumps(toml_schema(), indent=2, ensure_ascii=False) + "\n"
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as err:
        typer.echo(f"error: cannot write {output}: {err.strerror or err}", err=True)
        raise typer.Exit(2)
