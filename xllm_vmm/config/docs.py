"""Flag listings generated from the catalogue: ``xllm-vmm flags --format markdown|json`` and
``docs/cli-reference.md`` (regenerate with ``python -m xllm_vmm.cli.reference``; a test fails when
the committed file differs), which ends with the options of the commands in :data:`COMMANDS`,
read from their Typer definitions."""

from __future__ import annotations

from typing import Any
from pathlib import Path

from xllm_vmm.config.catalogue import GROUPS, FlagDef, flags_by_group

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "cli-reference.md"


def select_flags(group: str | None = None, search: str | None = None) -> dict[str, list[FlagDef]]:
    out = {}
    needle = (search or "").lower()
    for grp, flags in flags_by_group().items():
        if group is not None and grp != group:
            continue
        keep = [f for f in flags if not needle or needle in f.name or needle in f.help.lower()]
        if keep:
            out[grp] = keep
    return out


def flags_json(selected: dict[str, list[FlagDef]]) -> list[dict]:
    return [{"name": f.name, "type": f.type, "default": f.default, "group": f.group,
             "unit": f.unit, "help": f.help, "implemented": f.implemented,
             "platform_default": f.platform_default, "origin": f.origin,
             "env": f.env_var, "values": list(f.choices) or None}
            for flags in selected.values() for f in flags]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def flags_markdown(selected: dict[str, list[FlagDef]]) -> str:
    lines = []
    for grp, flags in selected.items():
        lines.append(f"## {GROUPS[grp]} (`{grp}`)\n")
        lines.append("| flag | type | default | help |")
        lines.append("|---|---|---|---|")
        for f in flags:
            note = "" if f.implemented else " *(accepted, no effect in the xllm-vmm engine)*"
            lines.append(f"| `--{f.name}` | {f.type_label} | `{_cell(f.default_text())}` | "
                         f"{_cell(f.help)}{note} |")
        lines.append("")
    return "\n".join(lines)


def reference_markdown(app: Any) -> str:
    """The full text of docs/cli-reference.md."""
    n = sum(len(v) for v in flags_by_group().values())
    head = f"""# CLI reference: every flag

<!-- Generated from xllm_vmm/config/catalogue.py (the commands at the end: from their Typer
     options) by `python -m xllm_vmm.cli.reference`.
     Do not edit by hand: tests/config/test_catalogue.py fails when this file is stale. -->

xllm-vmm accepts the {n} flags below, on the command line in the engine's gflags syntax
(`--name=value`, `--name value`, `--name` / `--noname` for bools, dashes or underscores), in TOML
files (flat keys or tables named after the group), in the engine's JSON file
(`--config_json_file`, flat keys) and as environment variables `XLLM_VMM_<NAME>`. Values are
parsed as the engine parses them: on the command line as gflags does (integers in ASCII digits
with nothing after them, gflags' bool spellings), in the JSON file as its loader reads them (a
string is never a bool or a number). Byte-sized flags (type `(bytes)`) take bytes; TOML files and
`XLLM_VMM_*` variables also take sizes such as `512MiB` or `1GiB`. String flags whose help ends
in *Values:* take only those values, spelled exactly; another value is a `CFG-TYPE` error. The
workers of a service are `nnodes` (processes, one per device) × the devices of one process
(`devices`), tensor parallel over workers / `dp_size`; `tp_size` is the DiT backend's only.
Where the engine's default differs by
build or platform, the first default is used and the help says so. Flags marked *accepted, no
effect* are type-checked but not used by the xllm-vmm engine. See `docs/configuration.md` for
sources, precedence and the rules; `xllm-vmm flags` prints the same table.

"""
    return head + flags_markdown(select_flags()) + commands_markdown(app, COMMANDS)


COMMANDS = ("top",)
"""Commands whose options the reference lists after the flags (read from their Typer
definitions, so the reference says what ``--help`` says)."""


def commands_markdown(app: Any, names: tuple[str, ...]) -> str:
    """One section per command of ``names`` in the Typer ``app`` (the command line's, passed in
    by :mod:`xllm_vmm.cli.reference`: configuration sits below the CLI): its help and a table
    of its options."""
    import typer.main

    group = typer.main.get_command(app)
    out = [""]
    for name in names:
        cmd = group.commands[name]  # type: ignore[attr-defined]
        out.append(f"## Command `xllm-vmm {name}`\n")
        out.append(" ".join((cmd.help or "").split()) + "\n")
        out.append("| option | default | help |")
        out.append("|---|---|---|")
        for p in cmd.params:
            if not getattr(p, "opts", None) or p.name == "help":
                continue
            flags = ", ".join(f"`{o}`" for o in (*p.opts, *p.secondary_opts))
            default = p.default
            if hasattr(default, "value"):
                default = default.value
            shown = "" if default in (None, False) else f"`{default}`"
            out.append(f"| {flags} | {shown} | {_cell(' '.join((p.help or '').split()))} |")
        out.append("")
    return "\n".join(out)
