"""``xllm-vmm check-config``: check serving configurations before anything is launched.

Its own command line is parsed here, not by Typer: every flag of the catalogue is accepted in
the engine's gflags syntax beside the command's options, and ``xllm_vmm.cli.main`` calls
:func:`run` directly so that a check does not import Typer (start-up time; see
docs/benchmarks.md). Nothing here imports torch. Exit codes: 0 valid, 1 findings (errors, or
warnings with ``--strict``), 2 usage error or unreadable input.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

USAGE = "xllm-vmm check-config [OPTIONS] [FILES]... [--FLAG=VALUE]..."

OPTIONS = [
    ("FILES", "TOML files (.toml), engine JSON files (.json) or launch scripts to check; each "
              "is one configuration."),
    ("--config FILE", "TOML file layered under every input (repeatable; later files win)."),
    ("--config_json_file FILE", "The engine's JSON config file; its values override the command line."),
    ("--cmd 'COMMAND'", "Check an existing launch command line (repeatable)."),
    ("--cmd-file FILE", "Check the launch command of a shell script (repeatable)."),
    ("-f, --format text|json|github", "Output format (default text)."),
    ("--strict", "Treat warnings as errors."),
    ("--show-config", "Also print the explicitly set and derived values with their sources."),
    ("--write-resolved FILE", "Write the resolved configuration (set and derived values) as TOML."),
    ("--explain ID", "Print a rule and the specification sentence it comes from, then exit."),
    ("--device PROFILE", "Device profile for the device memory: ascend-910b-64g, "
                         "ascend-910b-32g, h200, h100-80g, a100-80g, a100-40g, host."),
    ("--device-memory SIZE", "Total memory of one device (e.g. 64GiB; wins over --device). "
                             "With it (or --device), EL-08 and HK-07 are decided."),
    ("--host-memory SIZE", "Host RAM available for the host KV pools (e.g. 512GiB) for HK-07; "
                           "default: this host's available memory."),
    ("--no-env", "Ignore XLLM_VMM_* environment variables."),
    ("-h, --help", "Show this help (flags grouped as in `xllm-vmm flags`)."),
]

_VALUE_OPTS = {"--config", "--cmd", "--cmd-file", "--cmd_file", "--format", "-f", "--write-resolved",
               "--write_resolved", "--explain", "--device-memory", "--device_memory",
               "--host-memory", "--host_memory", "--device"}
_BOOL_OPTS = {"--strict", "--show-config", "--show_config", "--no-env", "--no_env",
              "-h", "--help"}


class UsageError(Exception):
    pass


def parse_argv(argv: list[str]) -> dict:
    """Split check-config's argv into its own options, positional files and catalogue flags.

    Catalogue flags keep their order. A token that follows a non-bool catalogue flag written
    without ``=`` is that flag's value, not a file.
    """
    from xllm_vmm.config.inputs import split_argv

    opts: dict = {"config": [], "cmd": [], "cmd_file": [], "files": [], "flags": [],
                  "format": "text", "strict": False, "show_config": False,
                  "write_resolved": None, "explain": None, "device_memory": None,
                  "host_memory": None, "device": None, "no_env": False, "help": False}
    try:
        split = split_argv(argv, value_options=_VALUE_OPTS, switches=_BOOL_OPTS)
    except ValueError as err:
        raise UsageError(str(err)) from None
    for name, value in split.options:
        if name in _BOOL_OPTS:
            key = "help" if name in ("-h", "--help") else name.lstrip("-").replace("-", "_")
            opts[key] = True
            continue
        key = "format" if name == "-f" else name.lstrip("-").replace("-", "_")
        if key in ("config", "cmd", "cmd_file"):
            opts[key].append(value)
        else:
            opts[key] = value
    opts["flags"], opts["files"] = split.flags, split.files
    if opts["format"] not in ("text", "json", "github"):
        raise UsageError(f"--format must be text, json or github, not {opts['format']!r}")
    for key in ("device_memory", "host_memory"):
        if opts[key] is not None:
            from xllm_vmm.config.values import MAX_MEMORY_BYTES, parse_size

            try:
                text, opts[key] = opts[key], parse_size(opts[key])
            except ValueError:
                raise UsageError(f"--{key.replace('_', '-')} must be a size such as 64GiB, "
                                 f"not {opts[key]!r}") from None
            if opts[key] > MAX_MEMORY_BYTES:
                raise UsageError(f"--{key.replace('_', '-')} {text} is more than 1 PiB: no "
                                 "machine has that")
    return opts


def help_text(out: TextIO) -> None:
    """The command's help: options, then every flag in panels by group."""
    from rich.console import Console
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    from xllm_vmm.config.catalogue import GROUPS, flags_by_group

    console = Console(file=out, highlight=False)
    console.print(f"Usage: {escape(USAGE)}\n")
    console.print("Check serving configurations against every rule of the VMM specification. "
                  "Exit codes: 0 valid, 1 findings, 2 usage or unreadable input.\n")
    t = Table.grid(padding=(0, 2))
    for a, b in OPTIONS:
        t.add_row(f"[bold cyan]{escape(a)}[/]", escape(b))
    console.print(Panel(t, title="Options", title_align="left", border_style="dim"))
    for group, flags in flags_by_group().items():
        if not flags:
            continue
        g = Table.grid(padding=(0, 2))
        for f in flags:
            g.add_row(f"[bold cyan]--{f.name}[/]", f"[dim]{f.type_label}={escape(f.default_text())}[/]",
                      escape(f.help))
        console.print(Panel(g, title=escape(f"{GROUPS[group]} [{group}]"), title_align="left",
                            border_style="dim"))


def explain(rule_id: str, out: TextIO, err: TextIO | None = None) -> int:
    from xllm_vmm.config.findings import INPUT_IDS, UNREADABLE_IDS
    from xllm_vmm.config.rules import RULES

    key = rule_id.strip().upper()
    rule = RULES.get(key)
    if rule is None:
        if key in INPUT_IDS:
            severity = ("warning, an error with --strict"
                        if key in ("CFG-MODEL", "CFG-JSON", "CFG-IGNORED") else
                        "not checked, never an error" if key == "CFG-UNRESOLVED" else
                        "error, unreadable input: exit 2" if key in UNREADABLE_IDS else "error")
            out.write(f"{key} (input check, {severity}): {INPUT_IDS[key]}\n"
                      "source: docs/configuration.md \"Input findings\"\n")
            return 0
        import difflib

        ids = list(RULES) + list(INPUT_IDS)
        close = difflib.get_close_matches(key, ids, n=3, cutoff=0.5)
        if not close:  # the same family (XX-NN: the XX rules), else the same number
            prefix = key.split("-", 1)[0]
            close = [i for i in ids if i.split("-", 1)[0] == prefix][:3]
        (err or sys.stderr).write(
            f"error: no rule {rule_id!r}"
            + (f"; did you mean {', '.join(close)}?" if close else "") + "\nRule ids: "
            f"{', '.join(sorted(RULES))}; input checks: {', '.join(INPUT_IDS)} "
            "(docs/configuration.md \"The rules\")\n")
        return 2
    kind = {"model": " (model rule: needs the model's config.json)",
            "sizing": " (needs memory sizes)", "runtime": " (runtime rule: enforced while serving)",
            "config": ""}[rule.kind]
    out.write(f"{rule.id} ({rule.severity}){kind}\n"
              f"  when:    {rule.condition}\n"
              f"  outcome: {rule.outcome}\n"
              f"  source:  {rule.source}\n")
    return 0


def run(argv: list[str], out: TextIO | None = None, err: TextIO | None = None,
        env: dict | None = None) -> int:
    """Run check-config on ``argv`` (the tokens after ``check-config``); returns the exit code.
    ``env`` defaults to ``os.environ``."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        opts = parse_argv(list(argv))
    except UsageError as e:
        err.write(f"error: {e}\nusage: {USAGE}  (see --help)\n")
        return 2
    if opts["help"]:
        help_text(out)
        return 0
    if opts["explain"] is not None:
        return explain(opts["explain"], out, err)

    from xllm_vmm.config.inputs import resolve_inputs
    from xllm_vmm.config.render import Result, exit_code, render_github, render_json, render_text
    from xllm_vmm.planner.checks import check_sizing, host_memory

    device = None
    if opts["device"] is not None or opts["device_memory"] is not None:
        from xllm_vmm.planner.checks import device_memory
        from xllm_vmm.planner.devices import DeviceError

        try:
            device = device_memory(opts["device_memory"], opts["device"])
        except DeviceError as e:
            err.write(f"error: {e}\nusage: {USAGE}  (see --help)\n")
            return 2
    environ = {} if opts["no_env"] else (os.environ if env is None else env)
    resolved = resolve_inputs(opts["flags"], config=opts["config"], cmd=opts["cmd"],
                              cmd_file=opts["cmd_file"], files=opts["files"], env=environ)
    if opts["write_resolved"] and len(resolved) != 1:
        err.write("error: --write-resolved needs exactly one input\n")
        return 2
    results = []
    for r in resolved:
        if r.config is None:
            results.append(Result(r.label, None, list(r.findings),
                                  launch_command=r.launch_command, notes=r.notes))
            continue
        # Every rule, with HK-07 decided by the planner when it applies (the one home of that
        # sizing: planner.checks.check_sizing; the host's memory is read only then).
        report = check_sizing(r.config, device=device,
                              host=lambda: host_memory(opts["host_memory"])).report
        results.append(Result(r.label, report, list(r.findings) + report.findings,
                              launch_command=r.launch_command, notes=r.notes))
    if opts["write_resolved"] and results[0].report is not None:
        # Written before the report, so that the exit code the report prints is the real one:
        # a file that cannot be written ends the run here (exit 2) with no report.
        path = opts["write_resolved"]
        try:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(results[0].report.resolved.to_toml())
        except OSError as e:
            err.write(f"error: cannot write --write-resolved {path}: {e.strerror or e} "
                      f"(no report printed; give a path in a writable directory)\n")
            return 2
    fmt = opts["format"]
    if fmt == "json":
        render_json(results, out, strict=opts["strict"])
    elif fmt == "github":
        render_github(results, out, strict=opts["strict"])
    else:
        render_text(results, out, strict=opts["strict"], show_config=opts["show_config"])
    return exit_code(results, opts["strict"])


def main(argv: list[str] | None = None) -> None:
    """Entry point of the fast path (``xllm-vmm check-config ...`` without Typer)."""
    from xllm_vmm.cli.guard import output_guard

    def _run() -> None:
        raise SystemExit(run(sys.argv[2:] if argv is None else argv))

    output_guard(_run)
