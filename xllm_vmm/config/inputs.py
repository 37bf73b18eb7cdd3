"""The inputs of ``check-config`` (and of any command that takes a configuration the same way,
such as ``plan``): direct gflags-style flags, ``--config`` TOML files, ``--config_json_file``,
``--cmd`` command lines, ``--cmd-file`` shell scripts, positional files, the environment.

Each *target* becomes one configuration, checked on its own; the shared layers (``--config``
files, the direct flags, the environment) apply to every target:

- a positional ``.toml`` file: that TOML file on top of the ``--config`` files;
- a positional ``.json`` file: the engine's JSON file (as ``--config_json_file``);
- a positional file with any other name, or ``--cmd-file``: a launch script (its flags are the
  command line, its ``XLLM_VMM_*`` assignments the environment);
- ``--cmd 'TEXT'``: a launch command line;
- no target: one configuration from the shared layers alone.

Flags given directly are applied after a target's own command line (they win; a repeat with a
different value inside one command line is CFG-DUP).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from xllm_vmm.config.findings import ConfigError, Finding, Source
from xllm_vmm.config.loader import ResolvedConfig, load
from xllm_vmm.config.sources import parse_shell


@dataclass
class Resolved:
    """One target's outcome: the configuration (None when it could not be built) and the
    findings of reading it (input errors, or warnings such as a mistyped environment name)."""

    label: str
    config: ResolvedConfig | None
    findings: list[Finding] = field(default_factory=list)
    #: for a launch script or ``--cmd``: which command was checked (``launch.sh:3 (xllm: the
    #: engine)``); "" otherwise.
    launch_command: str = ""
    #: what the check of a launch script assumed (a loop checked for its first iteration, ...)
    notes: list[str] = field(default_factory=list)

    @property
    def unreadable(self) -> bool:
        return any(f.unreadable for f in self.findings)


def takes_value(token: str) -> bool:
    """True when ``token`` is a non-bool catalogue flag written without ``=`` (``--tp_size``),
    so that the next token is its value, not a file."""
    from xllm_vmm.config.catalogue import FLAGS

    name, eq, _ = token.partition("=")
    flag = FLAGS.get(name.lstrip("-").replace("-", "_"))
    return not eq and flag is not None and not flag.is_bool


@dataclass
class Argv:
    """A command line split by :func:`split_argv`: the command's own ``options`` in order as
    ``(name, value)`` (``None`` for a switch), the catalogue ``flags`` in gflags syntax (each
    with its value where the value is the next token) and the positional ``files``."""

    options: list[tuple[str, str | None]] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def split_argv(tokens: Iterable[str], *, value_options: Iterable[str] = (),
               switches: Iterable[str] = ()) -> Argv:
    """The one argv splitter of the commands that take catalogue flags beside their own options
    (``check-config``, ``plan``, ``serve``).

    ``value_options``: own options that take a value (``--format json`` or ``--format=json``);
    ``switches``: own options without one. Any other token starting with ``-`` is a catalogue
    flag; a non-bool one written without ``=`` takes the next token as its value
    (:func:`takes_value`), so that value is never read as a file. Raises ValueError naming the
    option for a value option at the end without its value, or a switch given ``=value``."""
    tokens = list(tokens)
    value_options, switches = set(value_options), set(switches)
    out = Argv()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        name, eq, value = tok.partition("=")
        if name in value_options:
            if not eq:
                if i >= len(tokens):
                    raise ValueError(f"{name} needs a value")
                value = tokens[i]
                i += 1
            out.options.append((name, value))
        elif name in switches:
            if eq:
                raise ValueError(f"{name} takes no value")
            out.options.append((name, None))
        elif tok.startswith("-") and tok != "-":
            out.flags.append(tok)
            if takes_value(tok) and i < len(tokens):
                out.flags.append(tokens[i])
                i += 1
        else:
            out.files.append(tok)
    return out


def split_args(tokens: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split command-line ``tokens`` into catalogue flags in gflags syntax and positional files
    (:func:`split_argv` for a command without options of its own)."""
    argv = split_argv(tokens)
    return argv.flags, argv.files


def _resolve(label: str, *, cli: list, config_files: list, json_file, env, env_tokens=(),
             overrides=()) -> Resolved:
    try:
        cfg = load(cli, config_files, json_file, env, env_tokens=env_tokens,
                   overrides=overrides, label=label)
    except ConfigError as err:
        for f in err.findings:
            f.input = f.input or label
        return Resolved(label, None, err.findings)
    return Resolved(label, cfg, list(cfg.warnings))


def resolve_inputs(
    args: Iterable[str] = (),
    *,
    config: Iterable[str | os.PathLike] = (),
    config_json_file: str | os.PathLike | None = None,
    cmd: Iterable[str] = (),
    cmd_file: Iterable[str | os.PathLike] = (),
    files: Iterable[str | os.PathLike] = (),
    env: Mapping[str, str] | None = None,
) -> list[Resolved]:
    """Resolve every target (see the module docstring). Never raises for bad input: problems
    are findings of the :class:`Resolved` they belong to. ``env`` defaults to no environment;
    commands pass ``os.environ``."""
    args = list(args)
    shared_files = [os.fspath(p) for p in config]
    out: list[Resolved] = []
    targets: list[tuple[str, str]] = []
    for p in files:
        p = os.fspath(p)
        low = p.lower()
        kind = "toml" if low.endswith(".toml") else "json" if low.endswith(".json") else "script"
        targets.append((kind, p))
    targets += [("cmd", c) for c in cmd]
    cmd_file_set = {os.fspath(p) for p in cmd_file}
    targets += [("script", os.fspath(p)) for p in cmd_file]
    if not targets:
        label = shared_files[-1] if len(shared_files) == 1 and not args else "command line"
        return [_resolve(label, cli=args, config_files=shared_files,
                         json_file=config_json_file, env=env)]
    n_cmd = 0
    for kind, value in targets:
        if kind == "toml":
            out.append(_resolve(value, cli=args, config_files=shared_files + [value],
                                json_file=config_json_file, env=env))
        elif kind == "json":
            out.append(_resolve(value, cli=args, config_files=shared_files, json_file=value,
                                env=env))
        else:
            if kind == "cmd":
                n_cmd += 1
                label, text, file = f"--cmd #{n_cmd}", value, None
            else:
                label, file = value, value
                try:
                    with open(value, "rb") as fh:
                        text = fh.read().decode("utf-8")
                except (OSError, UnicodeDecodeError, ValueError) as err:
                    msg = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
                    out.append(Resolved(label, None, [Finding(
                        "CFG-READ", "error", f"cannot read {value}: {msg}",
                        hint="check the path (a positional input is a .toml file, an engine "
                             ".json file or a launch script)" if kind == "script" and
                             value not in cmd_file_set else "check the path given to --cmd-file",
                        where=Source("cli", value),
                        input=label)]))
                    continue
            if file is not None and is_markdown(file, text):
                out.extend(_markdown_blocks(label, text, file, shared_files, config_json_file,
                                            env, args))
                continue
            shell, errs = parse_shell(text, file)
            if shell is None:
                for f in errs:
                    f.input = label
                out.append(Resolved(label, None, errs))
                continue
            res = _resolve(label, cli=list(shell.tokens), config_files=shared_files,
                           json_file=config_json_file, env=env, env_tokens=shell.env,
                           overrides=args)
            for f in errs:
                f.input = label
            res.findings = errs + res.findings
            res.launch_command = shell.describe(file)
            res.notes = list(shell.notes)
            out.append(res)
    return out


_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})[ \t]*([^\s`]*)[^\n]*$")
SHELL_LANGS = frozenset({"", "sh", "bash", "shell", "console", "zsh", "shell-session",
                         "shellsession"})
"""Fence info strings read as shell (no info string included: a bare fence in a README is
usually a command)."""


def is_markdown(path: str, text: str) -> bool:
    """A Markdown document: a ``.md``/``.markdown`` name, or a first line that is a Markdown
    heading beside at least one fenced block."""
    low = path.lower()
    if low.endswith((".md", ".markdown", ".mdown")):
        return True
    first = text.lstrip("\ufeff").split("\n", 1)[0]
    return first.startswith("# ") and any(_FENCE.match(ln) for ln in text.splitlines())


def markdown_shell_blocks(text: str) -> list[tuple[int, str]]:
    """The fenced shell blocks of a Markdown document: ``(first line number, text)``, the
    text padded with blank lines so that line numbers stay the document's; ``console`` blocks
    keep only their ``$ ``-prompted lines (the prompt blanked, so columns stay) and what
    continues them."""
    lines = text.splitlines()
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(2), m.group(3).lower()
        start = i + 1
        j = start
        while j < len(lines) and not lines[j].lstrip().startswith(fence[0] * len(fence)):
            j += 1
        body = lines[start:j]
        if lang in SHELL_LANGS:
            if lang in ("console", "shell-session", "shellsession") or any(
                    ln.startswith("$ ") for ln in body):
                kept, cont = [], False
                for ln in body:
                    if ln.startswith("$ ") or cont:
                        kept.append("  " + ln[2:] if ln.startswith("$ ") else ln)
                        cont = ln.rstrip().endswith("\\")
                    else:
                        kept.append("")
                body = kept
            out.append((start + 1, "\n" * start + "\n".join(body) + "\n"))
        i = j + 1
    return out


def _markdown_blocks(label: str, text: str, file: str, shared_files, config_json_file, env,
                     args) -> list[Resolved]:
    """Each fenced shell block of a Markdown document checked as its own script; blocks that
    run no engine are skipped. None runs one: one finding saying the file is not a script."""
    out: list[Resolved] = []
    blocks = markdown_shell_blocks(text)
    for line, block in blocks:
        shell, errs = parse_shell(block, file)
        if shell is None:
            continue
        blabel = f"{label} (block at line {line})"
        res = _resolve(blabel, cli=list(shell.tokens), config_files=shared_files,
                       json_file=config_json_file, env=env, env_tokens=shell.env,
                       overrides=args)
        for f in errs:
            f.input = blabel
        res.findings = errs + res.findings
        res.launch_command = shell.describe(file)
        res.notes = list(shell.notes)
        out.append(res)
    if not out:
        what = (f"its {len(blocks)} fenced shell block(s) run no engine command" if blocks
                else "it has no fenced shell block (```sh ... ```)")
        out.append(Resolved(label, None, [Finding(
            "CFG-SYNTAX", "error", f"{file} is a Markdown document, not a script: {what}",
            hint="give --cmd-file a shell script, or put the launch command in a ```sh block",
            where=Source("cli", file), input=label)]))
    return out
