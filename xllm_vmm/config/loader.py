"""Merge the sources into one :class:`ResolvedConfig`, keeping where every value came from.

Precedence, highest first: the engine's JSON file (``config_json_file``; the engine's own
semantics: it overrides the command line) > command line > environment (``XLLM_VMM_<FLAG>``) >
TOML files (a later ``--config`` file overrides an earlier one) > defaults.

Within one source (one command line, one TOML file, one JSON file) a flag given twice with
different values is an error (CFG-DUP); the same value twice is accepted.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping

from xllm_vmm.config.catalogue import FLAGS, format_value
from xllm_vmm.config.findings import ConfigError, Finding, Source
from xllm_vmm.config.sources import (
    Assignment,
    Token,
    parse_args,
    parse_env,
    read_json,
    read_toml,
)

_DEFAULT = Source("default")


class ResolvedConfig:
    """Every flag's typed value and its :class:`Source`.

    ``cfg["name"]`` is the value; :meth:`provenance` where it came from; :meth:`explicit` whether
    a user set it (command line, environment, TOML or JSON) rather than it being a default or
    derived by a rule. ``warnings`` holds non-fatal findings from reading the inputs.
    """

    def __init__(self, values: dict, sources: dict, warnings: list[Finding] | None = None,
                 label: str = ""):
        self._values = values
        self._sources = sources
        self.warnings: list[Finding] = list(warnings or [])
        self.label = label
        #: flags a launch script sets from what cannot be known here (``CFG-UNRESOLVED``):
        #: name → the finding. Their values stay the defaults; rules naming them are not checked.
        self.unresolved: dict[str, Finding] = {
            name: f for f in self.warnings if f.id == "CFG-UNRESOLVED" for name in f.flags}

    def __getitem__(self, name: str):
        return self._values[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def get(self, name: str, default=None):
        return self._values.get(name, default)

    def provenance(self, name: str) -> Source:
        if name not in self._values:
            raise KeyError(name)
        return self._sources.get(name, _DEFAULT)

    def explicit(self, name: str) -> bool:
        return self.provenance(name).kind not in ("default", "derived")

    def items(self):
        return self._values.items()

    def explicit_names(self) -> list[str]:
        return [n for n in self._values if self.explicit(n)]

    def with_derived(self, name: str, value, rule: str) -> "ResolvedConfig":
        """A copy with ``name`` set to ``value`` by implied rule ``rule``."""
        values = dict(self._values)
        sources = dict(self._sources)
        values[name] = value
        sources[name] = Source("derived", rule=rule)
        return ResolvedConfig(values, sources, self.warnings, self.label)

    def to_dict(self, *, only_set: bool = False) -> dict:
        """``{name: {"value": v, "source": {...}}}``; with ``only_set`` defaults are left out."""
        out = {}
        for name, value in self._values.items():
            src = self.provenance(name)
            if only_set and src.kind == "default":
                continue
            out[name] = {"value": value, "source": src.to_dict()}
        return out

    def to_toml(self, *, only_set: bool = True) -> str:
        """The configuration as TOML, flat keys grouped in tables by flag group (tomli-w)."""
        import tomli_w

        from xllm_vmm.config.catalogue import GROUPS

        doc: dict = {}
        for group in GROUPS:
            table = {n: v for n, v in self._values.items()
                     if FLAGS[n].group == group
                     and not (only_set and self.provenance(n).kind == "default")}
            if table:
                doc[group] = dict(sorted(table.items()))
        return tomli_w.dumps(doc)

    def describe(self, name: str) -> str:
        """``name=value (source)`` for messages."""
        flag = FLAGS[name]
        shown = format_value(flag, self[name])
        if flag.is_bytes and isinstance(self[name], int) and self[name] >= 1024:
            from xllm_vmm.config.values import format_size

            shown += f" [{format_size(self[name])}]"
        return f"{name}={shown} ({self.provenance(name)})"


def _place(src: Source) -> str:
    """Where a value was written, precise enough to tell two places apart: ``file:line:col``,
    else the source with the text as written (``command line: --port=1``)."""
    if src.location() and src.col:
        return str(src)
    return f"{src}: {src.text}" if src.text else str(src)


def _layer(assignments: list[Assignment], findings: list[Finding]) -> dict[str, Assignment]:
    """One source's assignments → {name: assignment}, reporting conflicting repeats."""
    out: dict[str, Assignment] = {}
    for a in assignments:
        prev = out.get(a.name)
        if prev is not None and prev.value != a.value:
            flag = FLAGS[a.name]
            findings.append(Finding(
                "CFG-DUP", "error",
                f"{a.name} is given twice with different values: "
                f"{format_value(flag, prev.value)} ({_place(prev.source)}) and "
                f"{format_value(flag, a.value)} ({_place(a.source)})",
                flags={a.name: a.value}, sources={a.name: a.source, f"{a.name} (first)": prev.source},
                hint=f"keep one {a.name}", where=a.source))
        out[a.name] = a
    return out


def load(
    args: Iterable[str | Token] = (),
    config_files: Iterable[str | os.PathLike] = (),
    json_file: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    *,
    env_tokens: Iterable[Token] = (),
    overrides: Iterable[str | Token] = (),
    label: str = "",
) -> ResolvedConfig:
    """Resolve a configuration from its sources.

    ``args``: gflags-style tokens (``["--enable_vmm_kvcache=true", "--port", "9000"]``).
    ``config_files``: TOML files, later ones override earlier ones. ``json_file``: the engine's
    JSON file (as if given with ``--config_json_file``; a ``config_json_file`` flag in any
    source is honoured too). ``env``: the environment to read ``XLLM_VMM_*`` from (``None``:
    none — pass ``os.environ`` explicitly). ``env_tokens``: ``NAME=value`` assignments from a
    shell script (they override ``env``). ``overrides``: more command-line tokens applied
    after ``args`` as a separate layer (they win over ``args`` instead of conflicting).

    Raises :class:`ConfigError` with every problem found when any input is unreadable or holds
    an error (unknown flag, wrong type, conflicting repeat). Warnings are kept in
    ``ResolvedConfig.warnings``.
    """
    findings: list[Finding] = []
    values = {name: flag.default for name, flag in FLAGS.items()}
    sources: dict[str, Source] = {}

    def apply(layer: dict[str, Assignment]):
        for name, a in layer.items():
            values[name] = a.value
            sources[name] = a.source

    for path in config_files:
        got, errs = read_toml(os.fspath(path))
        findings.extend(errs)
        apply(_layer(got, findings))

    env_assign: list[Assignment] = []
    if env is not None:
        got, errs = parse_env(env)
        env_assign.extend(got)
        findings.extend(errs)
    env_tokens = list(env_tokens)
    if env_tokens:
        got, errs = parse_env(env_tokens)
        findings.extend(errs)
        env_assign.extend(got)
    env_layer: dict[str, Assignment] = {}
    for a in env_assign:  # script assignments override the process environment
        env_layer[a.name] = a
    apply(env_layer)

    got, errs = parse_args(list(args))
    findings.extend(errs)
    apply(_layer(got, findings))
    overrides = list(overrides)
    if overrides:
        got, errs = parse_args(overrides)
        findings.extend(errs)
        apply(_layer(got, findings))

    if json_file is not None:
        path = os.fspath(json_file)
        values["config_json_file"] = path
        sources["config_json_file"] = Source("cli", text=f"--config_json_file={path}")
    if values["config_json_file"] and not os.path.exists(values["config_json_file"]):
        src = sources.get("config_json_file", _DEFAULT)
        findings.append(Finding(
            "CFG-JSON", "warning",
            f"config_json_file {values['config_json_file']!r} ({src}) does not exist here: its "
            f"values are not checked", flags={"config_json_file": values["config_json_file"]},
            sources={"config_json_file": src},
            hint="the file often lives on the serving host only; give a copy with "
                 "--config_json_file to check it (--strict makes this an error)", where=src))
    elif values["config_json_file"]:
        got, errs = read_json(values["config_json_file"])
        findings.extend(errs)
        apply(_layer(got, findings))

    errors = [f for f in findings if f.severity == "error"]
    for f in findings:
        f.input = f.input or label
    if errors:
        raise ConfigError(findings)
    return ResolvedConfig(values, sources, findings, label)
