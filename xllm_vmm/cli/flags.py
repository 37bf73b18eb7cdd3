"""``xllm-vmm flags``: every flag of the catalogue as a table (panels by group), markdown (the
body of docs/cli-reference.md) or JSON. Exit codes: 0 listed, 1 nothing matched ``--search``,
2 unknown group."""

from __future__ import annotations

import json
from enum import Enum
from typing import Optional

import typer

from xllm_vmm.cli.root import app


class FlagsFormat(str, Enum):
    table = "table"
    markdown = "markdown"
    json = "json"


@app.command("flags")
def flags_command(
    fmt: FlagsFormat = typer.Option(FlagsFormat.table, "--format", "-f", help="Output format."),
    group: Optional[str] = typer.Option(None, "--group", "-g", help="Only this flag group."),
    search: Optional[str] = typer.Option(None, "--search", "-s",
                                         help="Only flags whose name or help contains this text."),
) -> None:
    """List every flag: name, type, default, group and help."""
    from xllm_vmm.config.catalogue import GROUPS
    from xllm_vmm.config.docs import flags_json, flags_markdown, select_flags

    if group is not None and group not in GROUPS:
        import difflib

        close = difflib.get_close_matches(group, list(GROUPS), n=3)
        typer.echo(f"error: no flag group {group!r}"
                   + (f"; did you mean {', '.join(close)}?" if close else
                      f"; groups: {', '.join(GROUPS)}"), err=True)
        raise typer.Exit(2)
    selected = select_flags(group, search)
    if not selected:
        where = f" in group {group!r}" if group else ""
        typer.echo(f"no flag{where} has {search!r} in its name or help; `xllm-vmm flags` lists "
                   "them all", err=True)
        raise typer.Exit(1)
    if fmt is FlagsFormat.json:
        typer.echo(json.dumps(flags_json(selected), indent=2))
        return
    if fmt is FlagsFormat.markdown:
        typer.echo(flags_markdown(selected), nl=False)
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    for grp, flags in selected.items():
        table = Table(title=escape(f"{GROUPS[grp]} [{grp}]"), title_justify="left", expand=False)
        table.add_column("flag", style="bold cyan", no_wrap=True)
        table.add_column("type", overflow="fold")
        table.add_column("default", overflow="fold")
        table.add_column("help", overflow="fold")  # long words wrap, never cut to "…"
        for f in flags:
            table.add_row(f"--{f.name}", f.type_label, escape(f.default_text()), escape(f.help))
        console.print(table)
