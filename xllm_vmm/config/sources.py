"""Readers for every configuration source. Each turns its input into :class:`Assignment` s (flag,
typed value, :class:`Source`) plus :class:`Finding` s for what it could not use; none raises for
bad input. Precedence and merging are :mod:`xllm_vmm.config.loader`'s job.

- gflags command line: ``--name=value``, ``--name value``, ``--name`` (true bool), ``--noname``
  (false bool), ``-name`` as well; dashes and underscores are the same.
- shell commands (``--cmd`` text, ``--cmd-file`` scripts): line continuations, comments,
  ``NAME=value`` assignments before the binary and ``export NAME=value`` lines (only
  ``XLLM_VMM_*`` matter), wrappers such as ``exec``/``nohup``; the binary name is ignored.
- TOML: flat flag keys, optionally inside tables named after flag groups (``[kv_cache]``).
- the engine's JSON file: flat flag keys, values typed as the engine's JSON loader reads them
  (a string is never a bool or a number).
- environment variables ``XLLM_VMM_<FLAG>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from xllm_vmm.config.catalogue import FLAGS, GROUPS, FlagDef, suggest
from xllm_vmm.config.findings import Finding, Source
from xllm_vmm.config.values import coerce_native, parse_text

ENV_PREFIX = "XLLM_VMM_"


@dataclass(frozen=True)
class Assignment:
    """One flag set to one typed value by one source."""

    name: str
    value: object
    source: Source


@dataclass(frozen=True)
class Token:
    """A command-line token and where it was written (``line``/``col`` only for files).

    From a launch script: ``unknown`` says why its value is not known here (it depends on an
    unset variable, the environment, ``$(command)``; ``text`` is then the word as written) and
    ``via`` names the assignments its value came through (``BS=abc (launch.sh:3)``)."""

    text: str
    file: str | None = None
    line: int | None = None
    col: int | None = None
    unknown: str | None = None
    via: tuple[str, ...] = ()


def _did_you_mean(name: str, extra: Iterable[str] = ()) -> str:
    import difflib

    close = suggest(name)
    extra = list(extra)
    if extra:
        close += [g for g in difflib.get_close_matches(name, extra, n=2, cutoff=0.7)]
    return f"did you mean {', '.join(close)}?" if close else "run `xllm-vmm flags` for the list"


def unknown_flag(name: str, where: Source, *, what: str = "flag") -> Finding:
    return Finding(
        "CFG-UNKNOWN", "error", f"unknown {what} {name!r} ({where})",
        hint=_did_you_mean(name), where=where,
    )


def type_error(flag: FlagDef, err: ValueError, where: Source,
               via: tuple[str, ...] = ()) -> Finding:
    came = f"; the value comes from {', '.join(via)}" if via else ""
    return Finding(
        "CFG-TYPE", "error", f"{err} ({where}){came}", flags={flag.name: where.text},
        sources={flag.name: where}, hint=f"set {flag.name} to {_example(flag)}", where=where,
    )


def _example(flag: FlagDef) -> str:
    from xllm_vmm.config.values import expected

    return expected(flag)


# ----------------------------------------------------------------------------- gflags argv


def _norm(name: str) -> str:
    return name.replace("-", "_")


def parse_args(tokens: Iterable[Token | str]) -> tuple[list[Assignment], list[Finding]]:
    """gflags-style tokens → assignments (kind ``cli``) and findings."""
    toks = [t if isinstance(t, Token) else Token(t) for t in tokens]
    out: list[Assignment] = []
    findings: list[Finding] = []
    i = 0
    while i < len(toks):
        tok = toks[i]
        i += 1
        text = tok.text
        src = Source("cli", tok.file, tok.line, tok.col, text=text)
        if text == "--":
            continue
        if tok.unknown and not text.startswith("-"):
            findings.append(not_checked(None, tok, "an argument"))
            continue
        if not text.startswith("-") or text == "-":
            findings.append(Finding(
                "CFG-ARG", "error", f"unexpected argument {text!r} ({src}): not a flag",
                hint="flags are written --name=value", where=src))
            continue
        body = text.lstrip("-")
        name, has_eq, value = body.partition("=")
        name = _norm(name)
        if tok.unknown and (not has_eq or not re.fullmatch(r"[A-Za-z0-9_]+", name)):
            findings.append(not_checked(None, tok, "a flag whose name"))
            continue
        flag = FLAGS.get(name)
        negated = False
        if flag is None and name.startswith("no") and FLAGS.get(name[2:]) is not None \
                and FLAGS[name[2:]].is_bool:
            flag, negated = FLAGS[name[2:]], True
        if flag is None:
            findings.append(unknown_flag(name, src))
            # a following non-flag token most likely was this flag's value
            if not has_eq and i < len(toks) and not toks[i].text.startswith("-"):
                i += 1
            continue
        if negated:
            if has_eq:
                findings.append(Finding(
                    "CFG-TYPE", "error",
                    f"--no{flag.name} takes no value ({src})",
                    hint=f"write --no{flag.name} or --{flag.name}=false", where=src))
                continue
            out.append(Assignment(flag.name, False, src))
            continue
        if not has_eq:
            if flag.is_bool:
                out.append(Assignment(flag.name, True, src))
                continue
            if i >= len(toks):
                findings.append(Finding(
                    "CFG-TYPE", "error", f"--{flag.name} needs a value ({src})",
                    hint=f"write --{flag.name}=VALUE: {_example(flag)}", where=src))
                continue
            nxt = toks[i]
            i += 1
            value = nxt.text
            src = Source("cli", tok.file, tok.line, tok.col, text=f"{text} {value}")
            if nxt.unknown:
                findings.append(not_checked(flag, nxt, f"--{flag.name}", src))
                continue
            tok = nxt if nxt.via else tok
        elif tok.unknown:
            shown = Token(value, tok.file, tok.line, tok.col, tok.unknown, tok.via)
            findings.append(not_checked(flag, shown, f"--{flag.name}", src))
            continue
        try:
            out.append(Assignment(flag.name, parse_text(flag, value), src))
        except ValueError as err:
            findings.append(type_error(flag, err, src, tok.via))
    return out, findings


#: Severity of a value a launch script sets from what cannot be known here (not an error).
NOT_CHECKED = "not_checked"


def not_checked(flag: FlagDef | None, tok: Token, what: str, src: Source | None = None) -> Finding:
    """``CFG-UNRESOLVED`` (severity :data:`NOT_CHECKED`, never an error): a value that depends
    on what the script cannot know here; the flag keeps its default and the rules that
    involve it are not checked."""
    where = src or Source("cli", tok.file, tok.line, tok.col, text=tok.text)
    return Finding(
        "CFG-UNRESOLVED", NOT_CHECKED,
        f"{what} {tok.text} is not checked: {tok.unknown}" + (f" ({where})" if where.file else ""),
        flags={flag.name: tok.text} if flag is not None else {},
        sources={flag.name: where} if flag is not None else {},
        hint="it is known only when the script runs on the serving host", where=where)


# ----------------------------------------------------------------------------- shell commands

_WRAPPERS = {"exec", "nohup", "env", "time", "sudo", "command", "stdbuf", "taskset", "numactl"}
_ASSIGN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
#: Programs whose file name contains ``xllm`` but which are not the engine (xllm-service's
#: scheduler in the PD guides).
_NOT_ENGINE = {"xllm_master_serving", "xllm_service", "xllm-service"}


@dataclass
class ShellCommand:
    """The launch command found in shell text: its flag tokens, its environment, and which
    command of the text it is (``line``: the physical line of its program; ``why``: how it
    was chosen). ``notes``: what the check assumed (a loop checked for its first iteration,
    an escaped-space argument the engine ignores)."""

    tokens: list[Token]
    env: list[Token]  # NAME=value tokens (assignments before the binary, export lines)
    binary: str | None
    line: int | None = None
    why: str = ""
    notes: list[str] = field(default_factory=list)
    binary_unknown: str | None = None

    def describe(self, file: str | None = None) -> str:
        """``launch.sh:3 (/opt/xllm/bin/xllm: the engine)``, for reports."""
        where = f"{file}:{self.line}" if file and self.line else \
            f"line {self.line}" if self.line else "the command"
        return f"{where} ({self.binary or '?'}: {self.why})" if self.why else where


def _token(word, file: str | None) -> Token:
    return Token(word.text, file, word.line if file is not None else None,
                 word.col if file is not None else None, word.unknown, word.via)


def _known_flags(tokens: list[Token]) -> int:
    """How many of ``tokens`` are flags of the catalogue (``--noNAME`` for a bool included)."""
    count = 0
    for t in tokens:
        if not t.text.startswith("-"):
            continue
        name = _norm(t.text.lstrip("-").split("=", 1)[0])
        if name in FLAGS or (name.startswith("no") and name[2:] in FLAGS
                             and FLAGS[name[2:]].is_bool):
            count += 1
    return count

def _is_engine(binary: str | None) -> bool:
    """True when ``binary`` is the serving engine: its file name contains ``xllm``."""
    base = binary.replace("\\", "/").rsplit("/", 1)[-1] if binary else ""
    return "xllm" in base.lower() and base not in _NOT_ENGINE


def _engine_word(seg: list[Token], start: int) -> int:
    """Index of the engine's program in a command whose program (after wrappers) is at ``start``.

    Wrappers whose options take separate values (``numactl -N 0``, ``taskset -c 0-7``,
    ``sudo -u svc``, ``timeout 3600``, ``docker run ... image``) leave a non-engine word at
    ``start``; the program is then the first later word whose file name contains ``xllm`` and
    which is not an option, an assignment or an option's separate value (the word before it
    does not start with ``-``: ``docker run --name xllm-1 img xllm`` picks the second). When no
    word qualifies, ``start`` (the command is checked as it is, as before).
    """
    if start >= len(seg) or _is_engine(seg[start].text) and not seg[start].unknown:
        return start
    for j in range(start + 1, len(seg)):
        word = seg[j].text
        if word.startswith("-") or _ASSIGN_RE.match(word) or not _is_engine(word) \
                or seg[j].unknown:
            continue
        if seg[j - 1].text.startswith("-") and "=" not in seg[j - 1].text:
            continue  # the value of a separate-value option: --name xllm-server
        return j
    for j in range(start, len(seg)):  # a program the script cannot name here: $XLLM_PATH
        word = seg[j]
        if word.unknown and not word.text.startswith("-") and (
                j == start or not seg[j - 1].text.startswith("-") or "=" in seg[j - 1].text):
            return j
    return start


def _broken_continuation(file: str | None, line: int, raw_lines: list[str],
                         tok: Token) -> Finding:
    """A command that starts with ``--``: a flag line cut off from its command."""
    before = line - 1
    prev = raw_lines[before - 1].rstrip("\r") if before >= 1 else ""
    where = f"{file}:{before}" if file else f"line {before}"
    if not prev.strip():
        cause, fix = f"the blank line at {where}", "remove the blank line"
    elif prev.lstrip().startswith("#"):
        cause, fix = f"the comment line at {where}", "move the comment out of the command"
    elif re.search(r"\\[ \t]+$", prev):
        cause, fix = (f"whitespace after the backslash at the end of {where}",
                      "remove the whitespace after the backslash")
    else:
        cause, fix = (f"the missing backslash at the end of {where}",
                      "end the line with a backslash")
    src = Source("cli", file, line if file else None, tok.col, text=tok.text)
    return Finding(
        "CFG-SHELL", "error",
        f"line {line} starts with {tok.text!r}: it looks like a continuation of the launch "
        f"command broken by {cause}; the shell runs it as a separate command, so its flags "
        f"never reach the engine", hint=f"{fix}: every line of a command but the last ends with a "
        "backslash, with nothing after it",
        where=src)


def parse_shell(text: str, file: str | None = None) -> tuple[ShellCommand | None, list[Finding]]:
    """Find the launch command in shell text (a ``--cmd`` string or a script).

    The text is walked as bash would (:mod:`xllm_vmm.config.shell`: words, quotes, operators,
    redirections, the script's variables and arithmetic expanded; a loop checked for its first
    iteration). The launch command is the last command whose program is the engine (its file
    name contains ``xllm``, xllm-service's ``xllm_master_serving`` excepted); else the last
    command whose program is not known here (``$XLLM_PATH`` set elsewhere) with catalogue
    flags; else the command with the most catalogue flags (the last of equals). A command that
    starts with ``--`` is a flag line cut off from its command: a ``CFG-SHELL`` error.

    Returns ``(None, findings)`` when the text cannot be split into words (``CFG-SYNTAX``) or
    holds no launch command (``CFG-SYNTAX`` naming the commands it did see): both make the
    input unreadable (exit 2).
    """
    from xllm_vmm.config.shell import ShellSyntaxError, run_script

    raw_lines = text.replace("\r\n", "\n").split("\n")
    try:
        script = run_script(text, file)
    except ShellSyntaxError as err:
        line_text = raw_lines[err.line - 1].strip()[:80] if 0 < err.line <= len(raw_lines) else ""
        where = Source("cli", file, err.line if file else None, text=line_text)
        return None, [Finding("CFG-SYNTAX", "error",
                              f"cannot split the command into words: {err} ({where})",
                              hint="check the quotes", where=where)]
    env = [_token(w, file) for w in script.assignments]
    findings: list[Finding] = []
    commands: list[ShellCommand] = []
    seen: list[str] = []
    for cmd in script.commands:
        seg = [_token(w, file) for w in cmd.words]
        phys = [w.line for w in cmd.words]
        pre_env = [_token(w, file) for w in cmd.env]
        i = 0
        while i < len(seg) and seg[i].text in _WRAPPERS:
            i += 1
            while i < len(seg) and (seg[i].text.startswith("-") or _ASSIGN_RE.match(seg[i].text)):
                if _ASSIGN_RE.match(seg[i].text):
                    pre_env.append(seg[i])
                i += 1
        if i < len(seg) and seg[i].text.startswith("--"):
            findings.append(_broken_continuation(file, phys[i], raw_lines, seg[i]))
            seen.append(f"{seg[i].text} (line {phys[i]})")
            continue
        i = _engine_word(seg, i)
        if i >= len(seg):
            continue
        binary = seg[i].text
        line = phys[i]
        rest = seg[i + 1:]
        rest_lines = phys[i + 1:]
        seen.append(f"{binary.rsplit('/', 1)[-1] if not seg[i].unknown else binary} (line {line})")
        if _is_engine(binary) and rest and rest[0].text == "serve" \
                and "xllm-vmm" in binary.lower():
            rest, rest_lines = rest[1:], rest_lines[1:]  # xllm-vmm serve --flags
        args: list[Token] = []
        notes: list[str] = []
        for t, ln in zip(rest, rest_lines):
            if not t.unknown and t.text and not t.text.strip():
                where = f"{file}:{ln}" if file else f"line {ln}"
                notes.append(f"{where}: the escaped blank ('\\ ') passes the program an argument "
                             f"of {len(t.text)} blank(s); gflags leaves it with the positional "
                             "arguments, which the engine ignores")
                continue
            args.append(t)
        if any(t.text.startswith("--") for t in args):
            commands.append(ShellCommand(args, pre_env, binary, line, notes=notes,
                                         binary_unknown=seg[i].unknown))
    def _candidate(c: ShellCommand) -> bool:
        return _known_flags(c.tokens) > 0 and not _not_engine(c.binary)

    engines = [c for c in commands if _is_engine(c.binary) and not c.binary_unknown]
    unknown = [c for c in commands if c.binary_unknown and _known_flags(c.tokens)]
    others = [c for c in commands if _candidate(c)]
    if engines:
        chosen = engines[-1]
        chosen.why = "the engine" if len(engines) == 1 else \
            f"the last of {len(engines)} engine commands"
    elif unknown:
        chosen = unknown[-1]
        chosen.why = f"the program is not known here ({chosen.binary_unknown}); its flags are " \
                     "the engine's"
    elif others:
        best = max(_known_flags(c.tokens) for c in others)
        chosen = [c for c in others if _known_flags(c.tokens) == best][-1]
        chosen.why = (f"no program named like the engine (xllm); the command with the most "
                      f"known flags ({best})")
    else:
        if findings:
            return None, findings
        first = (text.strip().splitlines() or [""])[0][:80]
        where = Source("cli", file, text=first)
        shown = ", ".join(seen[:8]) + (f" and {len(seen) - 8} more" if len(seen) > 8 else "")
        return None, [Finding(
            "CFG-SYNTAX", "error",
            f"no launch command in {file or 'the command'}: no command runs the engine (xllm) "
            f"with its flags; " + (f"commands seen: {shown}" if seen else "it holds no command"),
            hint="give the engine's launch command, e.g. xllm --model=/m "
                 "--enable_vmm_kvcache=true",
            where=where)]
    chosen.env = env + chosen.env
    chosen.notes = script.notes + chosen.notes
    return chosen, findings


def _not_engine(binary: str | None) -> bool:
    """True for a program known not to be the engine (see :data:`_NOT_ENGINE`)."""
    return bool(binary) and binary.replace("\\", "/").rsplit("/", 1)[-1] in _NOT_ENGINE


# ----------------------------------------------------------------------------- environment


def parse_env(env: Mapping[str, str] | Iterable[Token]) -> tuple[list[Assignment], list[Finding]]:
    """``XLLM_VMM_<FLAG>`` variables → assignments (kind ``env``). Other variables are ignored;
    an ``XLLM_VMM_`` variable that is not a flag but is close to one gets a warning."""
    import difflib

    items: list[tuple[str, str, Token | None]] = []
    if isinstance(env, Mapping):
        items = [(k, v, None) for k, v in env.items()]
    else:
        for t in env:
            k, _, v = t.text.partition("=")
            items.append((k, v, t))
    out: list[Assignment] = []
    findings: list[Finding] = []
    for key, value, tok in items:
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        src = Source("env", tok.file if tok else None, tok.line if tok else None,
                     tok.col if tok else None, text=f"{key}={value}", env=key)
        flag = FLAGS.get(name)
        if flag is None:
            close = difflib.get_close_matches(name, FLAGS, n=1, cutoff=0.85)
            if close:
                findings.append(Finding(
                    "CFG-UNKNOWN", "warning", f"environment variable {key} is not a flag ({src})",
                    hint=f"did you mean {ENV_PREFIX}{close[0].upper()}?", where=src))
            continue
        if tok is not None and tok.unknown:
            shown = Token(value, tok.file, tok.line, tok.col, tok.unknown, tok.via)
            findings.append(not_checked(flag, shown, key, src))
            continue
        try:
            out.append(Assignment(flag.name, parse_text(flag, value, sizes=True), src))
        except ValueError as err:
            findings.append(type_error(flag, err, src, tok.via if tok is not None else ()))
    return out, findings


# ----------------------------------------------------------------------------- TOML

_TABLE_RE = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\s*(#.*)?$")
_KEY_RE = re.compile(r"^\s*((?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*'))*)\s*=")


def _key_parts(text: str) -> tuple[str, ...]:
    parts = re.findall(r"\"([^\"]*)\"|'([^']*)'|([A-Za-z0-9_\-]+)", text)
    return tuple(a or b or c for a, b, c in parts)


def toml_positions(text: str) -> dict[tuple[str, ...], tuple[int, int, str]]:
    """Best-effort (line, col, line text) of every ``key = value`` of a TOML document, by dotted
    path. Multi-line strings are skipped. (``tomllib`` reports no positions for keys.)"""
    positions: dict[tuple[str, ...], tuple[int, int, str]] = {}
    table: tuple[str, ...] = ()
    in_ml: str | None = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if in_ml:
            if line.count(in_ml) % 2 == 1:
                in_ml = None
            continue
        m = _TABLE_RE.match(line)
        if m and not line.lstrip().startswith("[["):
            table = _key_parts(m.group(1))
            positions.setdefault(table, (lineno, line.index("[") + 1, line.strip()))
            continue
        m = _KEY_RE.match(line)
        if m:
            key = table + _key_parts(m.group(1))
            col = len(line) - len(line.lstrip()) + 1
            positions.setdefault(key, (lineno, col, line.strip()))
            rest = line[m.end():]
            for quote in ('"""', "'''"):
                if rest.count(quote) % 2 == 1:
                    in_ml = quote
    return positions


def _toml_error(err: Exception, file: str, text: str) -> Finding:
    msg = str(err)
    m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
    line = int(m.group(1)) if m else None
    col = int(m.group(2)) if m else None
    lines = text.splitlines()
    offending = lines[line - 1].strip() if line and 0 < line <= len(lines) else None
    where = Source("toml", file, line, col, text=offending)
    reason = re.sub(r"\s*\(at line \d+, column \d+\)", "", msg)
    shown = f": {offending}" if offending else ""
    return Finding("CFG-SYNTAX", "error", f"{where.location()}: invalid TOML: {reason}{shown}",
                   hint="fix the TOML syntax at that position", where=where)


def read_toml(path: str, text: str | None = None) -> tuple[list[Assignment], list[Finding]]:
    """A TOML file → assignments (kind ``toml``, with file:line:col) and findings."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    if text is None:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            # A UTF-8 byte-order mark (as some Windows editors write) is not part of the TOML.
            text = data.decode("utf-8-sig")
        except (OSError, UnicodeDecodeError, ValueError) as err:
            where = Source("toml", path)
            return [], [Finding("CFG-READ", "error", f"cannot read {path}: {_oserr(err)}",
                                hint="check the path", where=where)]
    text = text[1:] if text.startswith("\ufeff") else text
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        return [], [_toml_error(err, path, text)]
    except Exception as err:  # pragma: no cover - tomllib raises only TOMLDecodeError
        return [], [Finding("CFG-SYNTAX", "error", f"{path}: invalid TOML: {err}",
                            where=Source("toml", path))]
    pos = toml_positions(text)

    def src(keypath: tuple[str, ...]) -> Source:
        line, col, line_text = pos.get(keypath, (None, None, None))
        return Source("toml", path, line, col, text=line_text)

    out: list[Assignment] = []
    findings: list[Finding] = []

    def take(name: str, value, keypath):
        flag = FLAGS.get(name)
        where = src(keypath)
        if flag is None:
            f = unknown_flag(".".join(keypath), where, what="key")
            f.message = f"{where.location()}: unknown key {'.'.join(keypath)!r}" + (
                f": {where.text}" if where.text else "")
            f.hint = _did_you_mean(name, GROUPS)
            findings.append(f)
            return
        if isinstance(value, (dict, list)):
            findings.append(type_error(flag, ValueError(
                f"a {'table' if isinstance(value, dict) else 'list'} is not valid for {name}: "
                f"expected {_example(flag)}"), where))
            return
        try:
            out.append(Assignment(name, coerce_native(flag, value), where))
        except ValueError as err:
            f = type_error(flag, err, where)
            f.message = f"{where.location()}: {err}" + (f": {where.text}" if where.text else "")
            findings.append(f)

    for key, value in doc.items():
        if isinstance(value, dict) and key in GROUPS:
            for inner, v in value.items():
                take(inner, v, (key, inner))
        else:
            take(key, value, (key,))
    return out, findings


def _oserr(err: Exception) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err)


# ----------------------------------------------------------------------------- JSON


def json_position(text: str, key: str) -> tuple[int | None, int | None, str | None]:
    m = re.search(r'"' + re.escape(key) + r'"\s*:', text)
    if not m:
        return None, None, None
    line = text.count("\n", 0, m.start()) + 1
    col = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
    return line, col, text.splitlines()[line - 1].strip()


def json_positions(text: str, key: str) -> list[tuple[int, int, str]]:
    """(line, col, line text) of every ``"key":`` in a JSON text, in order."""
    out = []
    lines = text.splitlines()
    for m in re.finditer(r'"' + re.escape(key) + r'"\s*:', text):
        line = text.count("\n", 0, m.start()) + 1
        col = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
        out.append((line, col, lines[line - 1].strip() if line <= len(lines) else ""))
    return out


def read_json(path: str, text: str | None = None) -> tuple[list[Assignment], list[Finding]]:
    """The engine's JSON config file → assignments (kind ``json``), read as the engine's loader
    reads it: flag names as top-level keys (an object named after a group is an error: the
    engine would ignore its keys), values typed as nlohmann ``get<T>`` takes them
    (:func:`~xllm_vmm.config.values.coerce_native`), a UTF-8 byte-order mark skipped; a key given
    twice is reported as CFG-DUP."""
    if text is None:
        try:
            with open(path, "rb") as fh:
                # the engine's JSON parser (nlohmann) skips a UTF-8 byte-order mark too
                text = fh.read().decode("utf-8-sig")
        except (OSError, UnicodeDecodeError, ValueError) as err:
            return [], [Finding("CFG-READ", "error", f"cannot read {path}: {_oserr(err)}",
                                hint="check the path given to --config_json_file",
                                where=Source("json", path))]
    text = text[1:] if text.startswith("\ufeff") else text
    dups: list[str] = []

    def pairs(items):
        seen: dict = {}
        for k, v in items:
            if k in seen and seen[k] != v:
                dups.append(k)
            seen[k] = v
        return seen

    try:
        doc = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as err:
        lines = text.splitlines()
        offending = lines[err.lineno - 1].strip() if 0 < err.lineno <= len(lines) else None
        where = Source("json", path, err.lineno, err.colno, text=offending)
        return [], [Finding("CFG-SYNTAX", "error",
                            f"{where.location()}: invalid JSON: {err.msg}"
                            + (f": {offending}" if offending else ""),
                            hint="fix the JSON syntax at that position", where=where)]
    except (RecursionError, ValueError) as err:
        return [], [Finding("CFG-SYNTAX", "error", f"{path}: invalid JSON: {err}",
                            where=Source("json", path))]
    if not isinstance(doc, dict):
        return [], [Finding("CFG-SYNTAX", "error",
                            f"{path}: the JSON config must be an object of flag names to values",
                            where=Source("json", path, 1, 1))]

    def src(key: str) -> Source:
        line, col, line_text = json_position(text, key)
        return Source("json", path, line, col, text=line_text)

    out: list[Assignment] = []
    findings: list[Finding] = []
    for name in dups:
        places = json_positions(text, name)
        where = Source("json", path, *places[0]) if places else src(name)
        later = Source("json", path, *places[-1]) if len(places) > 1 else where
        findings.append(Finding("CFG-DUP", "error",
                                f"{where.location()}: {name!r} is given twice with different "
                                f"values: at {where.location()} and at {later.location()}",
                                flags={name: None},
                                sources={name: later, f"{name} (first)": where},
                                hint="keep one of them", where=where))

    def take(name: str, value):
        where = src(name)
        flag = FLAGS.get(name)
        if flag is None:
            f = unknown_flag(name, where, what="key")
            f.message = f"{where.location()}: unknown key {name!r}"
            findings.append(f)
            return
        if value is None or isinstance(value, (dict, list)):
            findings.append(type_error(flag, ValueError(
                f"{json.dumps(value)[:40]} is not valid for {name}: expected {_example(flag)}"), where))
            return
        try:
            out.append(Assignment(name, coerce_native(flag, value, engine_json=True), where))
        except ValueError as err:
            findings.append(type_error(flag, err, where))

    for key, value in doc.items():
        if isinstance(value, dict) and key in GROUPS and key not in FLAGS:
            # The engine reads each flag as a top-level key (JsonReader::value_or("name")): the
            # keys of a group object never reach it.
            where = src(key)
            findings.append(Finding(
                "CFG-UNKNOWN", "error",
                f"{where.location()}: {key!r} is an object of {len(value)} key(s); the engine's "
                f"JSON loader reads every flag as a top-level key, so it would ignore them",
                hint=f"move the keys of {key!r} ({', '.join(list(value)[:4])}) to the top level",
                where=where))
        else:
            take(key, value)
    return out, findings
