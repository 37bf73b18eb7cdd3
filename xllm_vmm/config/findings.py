"""What the configuration layer reports: where a value came from (:class:`Source`), what is
wrong with it (:class:`Finding`), and the error raised for input that cannot be used
(:class:`ConfigError`). Plain dataclasses; nothing here imports pydantic, typer or torch."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Provenance kinds, lowest precedence first ("derived" values are set by implied rules).
KINDS = ("default", "toml", "env", "cli", "json", "derived")

#: Finding ids for input problems (the general value checks; docs/configuration.md).
INPUT_IDS = {
    "CFG-READ": "an input file cannot be read",
    "CFG-SYNTAX": "an input file is not valid TOML / JSON / shell",
    "CFG-UNKNOWN": "an unknown flag, key or table",
    "CFG-TYPE": "a value of the wrong type or out of the type's range",
    "CFG-DUP": "a flag given twice with different values in one source",
    "CFG-ARG": "a command-line token that is not a flag",
    "CFG-CONFLICT": "flags the engine refuses together: node_rank not below nnodes, dp_size or "
                    "ep_size that does not divide the workers (nnodes x devices), a "
                    "tensor-parallel size that cannot split the model's heads",
    "CFG-IGNORED": "a flag the engine ignores here: tp_size outside the DiT backend (a warning)",
    "CFG-SERVE": "what the engine runs but xllm-vmm serve refuses across several workers: "
                 "dp_size > 1, ep_size > 1, several devices for one process of a multi-process "
                 "launch, host_blocks_factor > 0 (a warning, an error with --strict; serve "
                 "refuses it at start-up, plan lists it in serve_refuses)",
    "CFG-MODEL": "a --model that is a local path (starts with / . ~, or its parent directory "
                 "exists) but not a readable model directory",
    "CFG-JSON": "a config_json_file that does not exist here (a warning, an error with --strict: "
                "the file often lives on the serving host only)",
    "CFG-UNRESOLVED": "a value of a launch script that depends on what the script cannot know "
                      "here (an unset variable, the environment, $(command)): listed as not "
                      "checked, never an error",
    "CFG-MODEL-CONFIG": "a --model directory here whose config.json holds what cannot be (a "
                        "string for a number or a bool, KV heads that do not divide the heads, "
                        "zero, negative or absurd sizes): unreadable input",
    "CFG-SHELL": "a line of a launch script that starts with --: a continuation of the launch "
                 "command broken by a comment or blank line, which the shell runs on its own",
}

#: Input findings that make the input unreadable (exit code 2 rather than 1).
UNREADABLE_IDS = frozenset({"CFG-READ", "CFG-SYNTAX", "CFG-MODEL-CONFIG"})


@dataclass(frozen=True)
class Source:
    """Where one value came from.

    ``kind`` is one of :data:`KINDS`. ``file``/``line``/``col`` (1-based) locate it in a TOML, JSON
    or shell file; ``text`` is the token or line as written; ``env`` names the environment
    variable; ``rule`` is the rule id of a derived value.
    """

    kind: str
    file: str | None = None
    line: int | None = None
    col: int | None = None
    text: str | None = None
    env: str | None = None
    rule: str | None = None

    def location(self) -> str:
        """``file:line:col`` (or the part of it that is known), or ``""``."""
        if not self.file:
            return ""
        out = self.file
        if self.line:
            out += f":{self.line}"
            if self.col:
                out += f":{self.col}"
        return out

    def __str__(self) -> str:
        loc = self.location()
        if self.kind == "default":
            return "default"
        if self.kind == "derived":
            return f"derived ({self.rule})"
        if self.kind == "env":
            return f"environment {self.env}" + (f" ({loc})" if loc else "")
        if self.kind == "cli":
            return f"command line {loc}" if loc else "command line"
        return loc or self.kind

    def to_dict(self) -> dict:
        out: dict = {"kind": self.kind}
        for key in ("file", "line", "col", "text", "env", "rule"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


@dataclass
class Finding:
    """One problem, or one note, about a configuration.

    ``id`` is a rule id (``SD-04``; ``check-config --explain SD-04``) or an input id (:data:`INPUT_IDS`);
    ``severity`` is ``error`` or ``warning``; ``flags`` maps each flag involved to its value and
    ``sources`` to where that value came from; ``where`` locates an input problem; ``hint`` says
    what to change. ``input`` names the checked input (a file, ``--cmd #1``, ...).
    """

    id: str
    severity: str
    message: str
    flags: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    hint: str = ""
    where: Source | None = None
    input: str = ""

    @property
    def unreadable(self) -> bool:
        return self.id in UNREADABLE_IDS

    def to_dict(self) -> dict:
        out = {
            "id": self.id,
            "severity": self.severity,
            "message": self.message,
            "flags": dict(self.flags),
            "sources": {k: v.to_dict() for k, v in self.sources.items()},
            "hint": self.hint,
        }
        if self.where is not None:
            out["where"] = self.where.to_dict()
        if self.input:
            out["input"] = self.input
        return out


class HasFindings:
    """Mixin for anything with a ``findings`` list: its errors and warnings."""

    findings: list[Finding]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]


@dataclass(frozen=True)
class Implied:
    """A value set by an implied rule. ``key`` is a flag name (the value then appears in the
    resolved configuration as ``derived``) or a descriptive key such as ``vmm_pool``."""

    rule: str
    key: str
    value: object
    text: str

    def to_dict(self) -> dict:
        return {"rule": self.rule, "key": self.key, "value": self.value, "text": self.text}


class ConfigError(Exception):
    """Input that cannot be turned into a configuration. ``findings`` lists every problem found
    (not just the first); :attr:`unreadable` is true when a file could not be read or parsed."""

    def __init__(self, findings: list[Finding]):
        self.findings = list(findings)
        first = self.findings[0].message if self.findings else "invalid configuration"
        more = f" (and {len(self.findings) - 1} more)" if len(self.findings) > 1 else ""
        super().__init__(first + more)

    @property
    def unreadable(self) -> bool:
        return any(f.unreadable for f in self.findings)
