"""Renderers for check results, shared by ``check-config`` and ``plan``.

A *result* is one checked input: its label, its :class:`~xllm_vmm.config.rules.Report` (None
when the input could not be resolved) and the findings of reading it. Formats:

- ``text``: grouped by severity (errors, warnings, implied values, rules not checked), with an
  optional compact table of the explicitly set and derived values; rich when available.
- ``json``: :data:`JSON_SCHEMA_VERSION`-versioned; findings with rule id, severity, flags,
  sources, message, hint; the resolved configuration with provenance.
- ``github``: workflow commands (``::error file=F,line=L,col=C,title=ID::message``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TextIO

from xllm_vmm.config.findings import Finding, HasFindings, Implied, Source

#: Severity of a launch-script value that cannot be known here (``sources.NOT_CHECKED``).
NOT_CHECKED = "not_checked"

JSON_SCHEMA_VERSION = 1

#: Text-output marks: an error (or a warning under ``--strict``) ✗, a warning !, an implied
#: value •, a rule not checked ?.
MARKS = {"error": "✗", "warning": "!", "implied": "•", "not_checked": "?"}


@dataclass
class Result(HasFindings):
    """One checked input."""

    label: str
    report: object | None  # rules.Report
    findings: list[Finding] = field(default_factory=list)  # input findings + report findings
    launch_command: str = ""  # the command checked in a launch script or --cmd, if any
    notes: list[str] = field(default_factory=list)  # what a launch script's check assumed

    @property
    def unreadable(self) -> bool:
        return any(f.unreadable for f in self.findings)


def exit_code(results: list[Result], strict: bool = False) -> int:
    """2 when an input was unreadable, 1 for errors (or warnings with ``strict``), else 0."""
    if any(r.unreadable for r in results):
        return 2
    if any(r.errors or (strict and r.warnings) for r in results):
        return 1
    return 0


def _location(f: Finding) -> Source | None:
    if f.where is not None and f.where.file:
        return f.where
    for src in f.sources.values():
        if src.file:
            return src
    return None


# ----------------------------------------------------------------------------- json


def to_json(results: list[Result], *, strict: bool = False, full_config: bool = True) -> dict:
    inputs = []
    for r in results:
        rep = r.report
        # The same keys for every input, whatever its status: empty when not computed.
        entry: dict = {
            "input": r.label,
            "status": "unreadable" if r.unreadable else ("errors" if r.errors else
                                                        "warnings" if r.warnings else "ok"),
            "findings": [f.to_dict() for f in r.findings],
            "launch_command": r.launch_command,
            "launch_notes": list(r.notes),
            "model": None, "implied": [], "not_checked": [], "resolved": {}, "derived": {},
        }
        entry["not_checked"] = [
            {"rule": None, "flag": next(iter(f.flags), None),
             "text": f.where.text if f.where is not None else None, "reason": f.message}
            for f in r.findings if f.severity == NOT_CHECKED]
        if rep is not None:
            entry["model"] = rep.model
            entry["implied"] = [i.to_dict() for i in rep.implied]
            entry["not_checked"] += [{"rule": k, "flag": None, "text": None, "reason": v}
                                     for k, v in rep.not_checked.items()]
            entry["resolved"] = rep.resolved.to_dict(only_set=not full_config)
            entry["derived"] = {i.key: {"value": i.value, "rule": i.rule, "text": i.text}
                                for i in rep.implied}
        inputs.append(entry)
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "tool": "xllm-vmm check-config",
        "strict": strict,
        "exit_code": exit_code(results, strict),
        "summary": {"inputs": len(results),
                    "errors": sum(len(r.errors) for r in results),
                    "warnings": sum(len(r.warnings) for r in results)},
        "inputs": inputs,
    }


def render_json(results: list[Result], out: TextIO, *, strict: bool = False) -> None:
    json.dump(to_json(results, strict=strict), out, indent=2, default=str, ensure_ascii=False)
    out.write("\n")


# ----------------------------------------------------------------------------- github


def _gh_escape(text: str, prop: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if prop:
        text = text.replace(":", "%3A").replace(",", "%2C")
    return text


def render_github(results: list[Result], out: TextIO, *, strict: bool = False) -> None:
    for r in results:
        for f in r.findings:
            level = "notice" if f.severity == NOT_CHECKED else \
                "error" if f.severity == "error" or strict else "warning"
            loc = _location(f)
            props = []
            file = loc.file if loc else (r.label if r.label and "/" in r.label or
                                         r.label.endswith((".toml", ".json", ".sh")) else None)
            if file:
                props.append(f"file={_gh_escape(file, True)}")
                if loc and loc.line:
                    props.append(f"line={loc.line}")
                    if loc.col:
                        props.append(f"col={loc.col}")
            props.append(f"title={_gh_escape(f.id, True)}")
            msg = f.message + (f" -- {f.hint}" if f.hint else "")
            out.write(f"::{level} {','.join(props)}::{_gh_escape(msg)}\n")
    code = exit_code(results, strict)
    n_err = sum(len(r.errors) for r in results)
    n_warn = sum(len(r.warnings) for r in results)
    out.write(f"check-config: {len(results)} input(s), {n_err} error(s), {n_warn} warning(s), "
              f"exit {code}\n")


# ----------------------------------------------------------------------------- text


def _finding_lines(f: Finding) -> tuple[str, str]:
    loc = f.where.location() if f.where is not None else ""
    head = f.message
    if loc and loc not in head:
        head = f"{loc}: {head}"
    if f.id.startswith("CFG-") and not head.startswith(f.id):
        head = f"{f.id}: {head}"
    return head, f.hint


def render_text(results: list[Result], out: TextIO, *, strict: bool = False,
                show_config: bool = False, color: bool | None = None) -> None:
    """Human-readable report. ``color`` None: colour when ``out`` is a terminal."""
    try:
        from rich.console import Console
        from rich.markup import escape
    except ImportError:  # pragma: no cover - rich is a dependency
        Console = None  # type: ignore[assignment]
    if Console is None:
        _render_plain(results, out, strict=strict, show_config=show_config)
        return
    console = Console(file=out, force_terminal=color, no_color=color is False,
                      highlight=False, width=max(100, 0) if not out.isatty() else None,
                      soft_wrap=not out.isatty())
    for r in results:
        status = ("[bold red]unreadable[/]" if r.unreadable else
                  "[bold red]errors[/]" if r.errors else
                  ("[bold red]warnings (strict)[/]" if strict else "[yellow]warnings[/]")
                  if r.warnings else "[green]ok[/]")
        console.print(f"[bold]{escape(r.label)}[/]: {status}")
        if r.launch_command:
            console.print(f"  [dim]launch command checked: {escape(r.launch_command)}[/]")
        for note in r.notes:
            console.print(f"  [dim]note: {escape(note)}[/]")
        # Under --strict warnings are errors: one "errors" heading lists both.
        groups = ((("error", "warning"), "error", "red"),) if strict else \
            ((("error",), "error", "red"), (("warning",), "warning", "yellow"))
        for sevs, shown_sev, style in groups:
            items = [f for f in r.findings if f.severity in sevs]
            if not items:
                continue
            mark = MARKS[shown_sev]
            console.print(f"  [{style}]{shown_sev}s ({len(items)})[/]")
            for f in items:
                head, hint = _finding_lines(f)
                console.print(f"    [{style}]{mark}[/] {escape(head)}")
                if hint:
                    console.print(f"      [dim]→ {escape(hint)}[/]")
        values = [f for f in r.findings if f.severity == NOT_CHECKED]
        if values:
            console.print(f"  [magenta]values not checked ({len(values)})[/]")
            for f in values:
                console.print(f"    [magenta]{MARKS['not_checked']}[/] {escape(f.message)}")
        rep = r.report
        if rep is not None:
            if rep.implied:
                console.print(f"  [cyan]implied ({len(rep.implied)})[/]")
                for i in rep.implied:
                    console.print(f"    [cyan]{MARKS['implied']}[/] {i.rule}: {escape(i.key)} = "
                                  f"{escape(str(i.value))} [dim]({escape(i.text)})[/]")
            if rep.not_checked:
                console.print(f"  [magenta]not checked ({len(rep.not_checked)})[/]")
                for rid, why in rep.not_checked.items():
                    console.print(f"    [magenta]{MARKS['not_checked']}[/] {rid}: {escape(why)}")
            if show_config:
                from rich.table import Table

                table = Table(title=f"resolved configuration ({escape(r.label)})",
                              show_lines=False, title_justify="left")
                table.add_column("flag")
                table.add_column("value")
                table.add_column("source")
                cfg = rep.resolved
                from xllm_vmm.config.catalogue import FLAGS, format_value

                for name in sorted(n for n, _ in cfg.items() if cfg.provenance(n).kind != "default"):
                    table.add_row(name, escape(format_value(FLAGS[name], cfg[name])),
                                  escape(str(cfg.provenance(name))))
                for i in rep.implied:
                    if i.key not in FLAGS:
                        table.add_row(i.key, escape(str(i.value)), f"derived ({i.rule})")
                console.print(table)
    code = exit_code(results, strict)
    n_err = sum(len(r.errors) for r in results)
    n_warn = sum(len(r.warnings) for r in results)
    console.print(f"{len(results)} input(s): {n_err} error(s), {n_warn} warning(s) → exit {code}")


def _render_plain(results, out, *, strict, show_config):  # pragma: no cover - rich fallback
    for r in results:
        out.write(f"{r.label}:\n")
        for f in r.findings:
            head, hint = _finding_lines(f)
            out.write(f"  {f.severity}: {head}\n")
            if hint:
                out.write(f"    -> {hint}\n")
    out.write(f"exit {exit_code(results, strict)}\n")


def implied_dicts(implied: list[Implied]) -> list[dict]:
    return [i.to_dict() for i in implied]
