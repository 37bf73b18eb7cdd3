"""The root Typer application, ``app``, with ``--version`` and ``check-config``. Each other
command lives in its own module, imports ``app`` from here and registers itself on it;
:mod:`xllm_vmm.cli.app` imports them all. Command modules import heavy libraries (torch, the
native code) inside the command function only, so that ``check-config``, ``flags`` and
``schema`` never import torch."""

from __future__ import annotations

from typing import Optional

import typer

from xllm_vmm import __version__

app = typer.Typer(
    name="xllm-vmm",
    help="Launch, check, size and run an LLM server whose KV cache and weights live in a VMM pool.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"xllm-vmm {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, metavar="",
        help="Print the version and exit."
    ),
) -> None:
    """xllm-vmm: KV cache and weights in a virtual-memory pool."""


@app.command(
    "check-config",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                      "help_option_names": []},
    add_help_option=False,
    short_help="Check configurations (TOML, engine JSON, launch commands, --FLAG=VALUE) against "
               "every rule of the VMM specification.",
)
def _check_config(ctx: typer.Context) -> None:
    """Check serving configurations (TOML, engine JSON, launch commands, --FLAG=VALUE) against
    every rule of the VMM specification. Exit codes: 0 valid, 1 findings, 2 usage or unreadable
    input. Run `xllm-vmm check-config --help` for its options and every flag."""
    from xllm_vmm.cli.check_config import run

    raise typer.Exit(run(list(ctx.args)))
