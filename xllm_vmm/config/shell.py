"""Shell text read as bash reads it, as far as a launch script needs: words, quotes, comments,
line continuations, operators and redirections, variables the script assigns and arithmetic.

:func:`run_script` walks a script's commands in order, keeping the variables it assigns
(``NAME=value``, ``export``/``readonly``/``local``/``declare``/``typeset NAME=value``, ``unset``),
and expands each command's words as bash would: ``$NAME``, ``${NAME}``, ``${NAME:-default}``
(and ``-``, ``:=``, ``=``, ``:+``, ``+``, ``:?``, ``?``), ``$(( ... ))`` over known integers, word
splitting of unquoted expansions. A loop runs its body once: ``for (( init; cond; step ))`` with
the state after ``init`` (the first iteration), ``for NAME in WORDS`` with the first word; the
:attr:`Script.notes` say so. ``if``/``while``/``case`` bodies are read straight through.

What the script cannot know here stays *unknown* (a :class:`Word` with ``unknown`` set, its text
as written): a variable the script never sets (it would come from the environment), ``$(...)``
and backquotes, positional parameters, arithmetic over unknown values. Nothing is executed.

Redirections (``>``, ``>>``, ``<``, ``2>&1``, ``&>``, ...) and control operators (``;``, ``&``,
``|``, ``&&``, ``||``) are operators wherever they are written, also touching a word
(``--port=8000>log`` is ``--port=8000`` redirected to ``log``). A backslash before a space is an
escaped space (a word of its own when it stands alone: ``--node_rank=$i \\ > log`` passes the
program a one-space argument, as bash does). Here-documents are not read (their lines are read as
commands).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

#: Bash's limit on one arithmetic value (signed 64 bit); results wrap as in bash.
_INT64 = 1 << 64

_RESERVED = {"for", "if", "then", "elif", "else", "fi", "while", "until", "do", "done", "case",
             "esac", "{", "}", "!", "function", "select", "time", "in", "[[", "]]"}
_DECLARE = {"export", "readonly", "local", "declare", "typeset"}
_OPERATORS = ("&>>", "<<<", "&&", "||", ";;", "|&", "&>", ">>", ">&", ">|", "<<", "<&", "<>",
              ">", "<", ";", "&", "|", "(", ")")
_META = " \t\n;&|()<>"
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")


def _short(text: str, width: int = 60) -> str:
    """``text`` for a message: at most ``width`` characters (an ellipsis marks a cut)."""
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[:width - 3] + "..."


class ShellSyntaxError(ValueError):
    """Text bash itself would refuse (an unterminated quote or expansion). ``line`` is the
    physical line (1-based) where the unterminated construct starts."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


# ----------------------------------------------------------------------------- words


@dataclass(frozen=True)
class Word:
    """One word as the program receives it.

    ``text``: the expanded text, or the text as written when it is not known here (``unknown``
    says why). ``raw``: as written. ``line``/``col``: where it starts (1-based). ``via``: the
    assignments its value came through (``BS=abc (launch.sh:3)``), for messages.
    """

    text: str
    raw: str
    line: int
    col: int
    unknown: str | None = None
    via: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Lexed:
    parts: tuple  # ("lit", s, quoted) | ("var", name, op, arg_raw, quoted) | ("arith", expr, quoted)
    #               | ("cmd", text, quoted) | ("special", text, quoted)
    raw: str
    line: int
    col: int


@dataclass(frozen=True)
class _Op:
    text: str
    line: int
    col: int


@dataclass(frozen=True)
class _Arith:
    expr: str
    line: int
    col: int


class _Lexer:
    """Text → words (unexpanded parts), operators and ``(( ))`` arithmetic, with positions."""

    def __init__(self, text: str):
        self.text = text
        self.n = len(text)
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def pos(self, i: int) -> tuple[int, int]:
        line = bisect.bisect_right(self.starts, i)
        return line, i - self.starts[line - 1] + 1

    def items(self) -> list:
        out: list = []
        t, n = self.text, self.n
        i = 0
        while i < n:
            c = t[i]
            if c in " \t":
                i += 1
            elif c == "\\" and t.startswith("\n", i + 1):
                i += 2
            elif c == "\n":
                out.append(_Op("\n", *self.pos(i)))
                i += 1
            elif c == "#":
                j = t.find("\n", i)
                i = n if j < 0 else j
            elif c == "(" and t.startswith("((", i) and self._command_start(out):
                j = self._match_arith(i + 2, i)
                out.append(_Arith(t[i + 2:j], *self.pos(i)))
                i = j + 2
            elif c in ";&|()<>":
                op = next(o for o in _OPERATORS if t.startswith(o, i))
                out.append(_Op(op, *self.pos(i)))
                i += len(op)
            else:
                m = re.match(r"[0-9]+(?=[<>])", t[i:i + 12])
                if m:  # an io number: 2>&1
                    j = i + m.end()
                    op = next(o for o in _OPERATORS if t.startswith(o, j))
                    out.append(_Op(m.group(0) + op, *self.pos(i)))
                    i = j + len(op)
                    continue
                start = i
                parts, i = self._word(i)
                out.append(_Lexed(tuple(parts), t[start:i], *self.pos(start)))
        return out

    @staticmethod
    def _command_start(out: list) -> bool:
        if not out:
            return True
        last = out[-1]
        if isinstance(last, _Op):
            return last.text in ("\n", ";", "&", "|", "&&", "||", "(", "|&")
        return isinstance(last, _Lexed) and last.raw in ("for", "do", "then", "else", "!")

    def _match_arith(self, i: int, start: int) -> int:
        """Index of the ``))`` that closes ``$((``/``((`` whose body starts at ``i``."""
        t = self.text
        depth = 0
        while i < self.n:
            c = t[i]
            if c == "(":
                depth += 1
            elif c == ")":
                if depth == 0 and t.startswith("))", i):
                    return i
                depth -= 1
            i += 1
        raise ShellSyntaxError("unterminated arithmetic (( ... ))", self.pos(start)[0])

    def _match(self, i: int, open_: str, close: str, start: int, what: str) -> int:
        """Index of the ``close`` that ends a construct whose body starts at ``i`` (nesting and
        quotes inside skipped)."""
        t = self.text
        depth = 0
        while i < self.n:
            c = t[i]
            if c == "\\":
                i += 2
                continue
            if c == "'" and open_ == "(":
                j = t.find("'", i + 1)
                if j < 0:
                    break
                i = j + 1
                continue
            if c == open_:
                depth += 1
            elif c == close:
                if depth == 0:
                    return i
                depth -= 1
            i += 1
        raise ShellSyntaxError(f"unterminated {what}", self.pos(start)[0])

    def _word(self, i: int) -> tuple[list, int]:
        t = self.text
        parts: list = []
        lit: list[str] = []

        def flush(quoted=False):
            if lit:
                parts.append(("lit", "".join(lit), quoted))
                lit.clear()

        while i < self.n:
            c = t[i]
            if c in _META:
                break
            if c == "\\":
                if t.startswith("\n", i + 1):
                    i += 2
                elif i + 1 < self.n:
                    flush()
                    parts.append(("lit", t[i + 1], True))
                    i += 2
                else:
                    i += 1
            elif c == "'":
                j = t.find("'", i + 1)
                if j < 0:
                    raise ShellSyntaxError("No closing quotation (')", self.pos(i)[0])
                flush()
                parts.append(("lit", t[i + 1:j], True))
                i = j + 1
            elif c == '"':
                flush()
                i = self._dquote(i + 1, parts, i)
            elif c == "$":
                flush()
                i = self._dollar(i, parts, False, lit)
            elif c == "`":
                flush()
                j = self._backquote(i)
                parts.append(("cmd", t[i:j + 1], False))
                i = j + 1
            else:
                lit.append(c)
                i += 1
        flush()
        return parts, i

    def _word_all(self) -> tuple[list, int]:
        """The whole text as one word (quotes and expansions read; metacharacters literal)."""
        parts: list = []
        i = 0
        while i < self.n:
            got, j = self._word(i)
            parts += got
            if j < self.n:
                parts.append(("lit", self.text[j], True))
                j += 1
            i = j
        return parts, i

    def _backquote(self, i: int) -> int:
        t = self.text
        j = i + 1
        while j < self.n and t[j] != "`":
            j += 2 if t[j] == "\\" else 1
        if j >= self.n:
            raise ShellSyntaxError("No closing quotation (`)", self.pos(i)[0])
        return j

    def _dquote(self, i: int, parts: list, start: int) -> int:
        t = self.text
        lit: list[str] = []

        def flush():
            if lit:
                parts.append(("lit", "".join(lit), True))
                lit.clear()

        # an empty "" is still a word: keep a quoted empty literal
        parts.append(("lit", "", True))
        while i < self.n:
            c = t[i]
            if c == '"':
                flush()
                return i + 1
            if c == "\\" and i + 1 < self.n and t[i + 1] in '$`"\\\n':
                if t[i + 1] != "\n":
                    lit.append(t[i + 1])
                i += 2
            elif c == "$":
                flush()
                i = self._dollar(i, parts, True, lit)
            elif c == "`":
                flush()
                j = self._backquote(i)
                parts.append(("cmd", t[i:j + 1], True))
                i = j + 1
            else:
                lit.append(c)
                i += 1
        raise ShellSyntaxError('No closing quotation (")', self.pos(start)[0])

    def _dollar(self, i: int, parts: list, quoted: bool, lit: list) -> int:
        t = self.text
        if t.startswith("$((", i):
            j = self._match_arith(i + 3, i)
            parts.append(("arith", t[i + 3:j], quoted))
            return j + 2
        if t.startswith("$(", i):
            j = self._match(i + 2, "(", ")", i, "command substitution $( ... )")
            parts.append(("cmd", t[i:j + 1], quoted))
            return j + 1
        if t.startswith("${", i):
            j = self._match(i + 2, "{", "}", i, "parameter expansion ${ ... }")
            inner = t[i + 2:j]
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-=+?])(.*))?", inner, re.S)
            if m:
                parts.append(("var", m.group(1), m.group(2) or "", m.group(3) or "", quoted))
            else:
                parts.append(("special", "${" + inner + "}", quoted))
            return j + 1
        m = _NAME_RE.match(t, i + 1)
        if m:
            parts.append(("var", m.group(0), "", "", quoted))
            return m.end()
        if i + 1 < self.n and t[i + 1] in "0123456789@*#?$!-":
            parts.append(("special", t[i:i + 2], quoted))
            return i + 2
        parts.append(("lit", "$", quoted))
        return i + 1


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class Var:
    """A shell variable: its value, or why it is not known; where it was assigned."""

    value: str
    unknown: str | None
    where: str


class _Unknown(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Arith:
    """Bash arithmetic (``$(( ))``, ``(( ))``) over 64-bit integers: ``+ - * / % **``, unary
    ``+ - ! ~``, comparisons, ``&& || ?:``, bit operators, ``= += -= *= /= %=``, ``++``/``--``,
    ``,``; names are variables (a variable the script does not set is unknown, not 0: it would
    come from the environment). Raises :class:`_Unknown` for what cannot be computed here."""

    _TOKEN = re.compile(r"\s*(?:(0[xX][0-9a-fA-F]+|[0-9]+#[0-9a-zA-Z@_]+|[0-9]+)|"
                        r"([A-Za-z_][A-Za-z0-9_]*)|"
                        r"(\*\*=|<<=|>>=|\+\+|--|\*\*|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^]=|"
                        r"[-+*/%<>=!~&|^?:,()]))")
    _BINARY = {
        ",": 1, "=": 2, "+=": 2, "-=": 2, "*=": 2, "/=": 2, "%=": 2, "?": 3, "||": 4, "&&": 5,
        "|": 6, "^": 7, "&": 8, "==": 9, "!=": 9, "<": 10, ">": 10, "<=": 10, ">=": 10,
        "<<": 11, ">>": 11, "+": 12, "-": 12, "*": 13, "/": 13, "%": 13, "**": 14,
    }

    def __init__(self, vars: dict[str, Var], depth: int = 0):
        self.vars = vars
        self.depth = depth
        self.used: list[str] = []

    def eval(self, expr: str) -> int:
        self.toks = self._lex(expr)
        self.i = 0
        if not self.toks:
            return 0
        try:
            value = self._expr(0)
        except RecursionError:
            raise _Unknown("the arithmetic is nested too deeply to compute here") from None
        if self.i != len(self.toks):
            raise _Unknown(f"$(( {_short(expr.strip())} )) is not arithmetic bash can compute")
        return value

    def _lex(self, expr: str) -> list[tuple[str, str]]:
        out = []
        i = 0
        expr = expr.rstrip()
        while i < len(expr):
            m = self._TOKEN.match(expr, i)
            if not m or m.end() == i:
                raise _Unknown(f"$(( {_short(expr.strip())} )) is not arithmetic bash can compute")
            kind = "num" if m.group(1) else "name" if m.group(2) else "op"
            out.append((kind, m.group(m.lastindex)))
            i = m.end()
        return out

    def _peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def _wrap(self, v: int) -> int:
        v %= _INT64
        return v - _INT64 if v >= _INT64 // 2 else v

    def _var(self, name: str) -> int:
        var = self.vars.get(name)
        if var is None:
            raise _Unknown(f"${name} is not set in the script")
        if var.unknown:
            raise _Unknown(var.unknown)
        self.used.append(var.where)
        text = var.value.strip()
        if not text:
            return 0
        if self.depth > 8:
            raise _Unknown(f"${name} refers to itself")
        sub = Arith(self.vars, self.depth + 1)
        value = sub.eval(text)
        self.used += sub.used
        return value

    def _num(self, text: str) -> int:
        if "#" in text:
            base, digits = text.split("#", 1)
            try:
                return self._wrap(int(digits, int(base)))
            except ValueError:
                raise _Unknown(f"{text} is not a number bash reads") from None
        if text.lower().startswith("0x"):
            return self._wrap(int(text, 16))
        if len(text) > 1 and text.startswith("0"):
            try:
                return self._wrap(int(text, 8))
            except ValueError:
                raise _Unknown(f"{text}: value too great for base (bash reads a leading 0 as "
                               "octal)") from None
        return self._wrap(int(text))

    def _primary(self) -> int:
        kind, tok = self._peek()
        if kind is None:
            raise _Unknown("an arithmetic expression ends too early")
        self.i += 1
        if kind == "num":
            return self._num(tok)
        if kind == "name":
            nxt = self._peek()[1]
            if nxt in ("=", "+=", "-=", "*=", "/=", "%="):
                return 0  # the assignment in _expr reads the old value itself
            if nxt in ("++", "--"):
                self.i += 1
                old = self._var(tok)
                self._set(tok, old + (1 if nxt == "++" else -1))
                return old
            return self._var(tok)
        if tok == "(":
            value = self._expr(0)
            if self._peek()[1] != ")":
                raise _Unknown("unbalanced parentheses in arithmetic")
            self.i += 1
            return value
        if tok in ("++", "--"):
            kind2, name = self._peek()
            if kind2 != "name":
                raise _Unknown(f"{tok} needs a variable")
            self.i += 1
            value = self._var(name) + (1 if tok == "++" else -1)
            self._set(name, value)
            return value
        if tok in ("-", "+", "!", "~"):
            v = self._expr(15)
            return self._wrap({"-": -v, "+": v, "!": int(not v), "~": ~v}[tok])
        raise _Unknown(f"unexpected {tok!r} in arithmetic")

    def _set(self, name: str, value: int) -> None:
        self.vars[name] = Var(str(self._wrap(value)), None, f"{name}={value} (arithmetic)")

    def _expr(self, min_prec: int) -> int:
        start = self.i
        left = self._primary()
        while True:
            kind, op = self._peek()
            if kind != "op" or op not in self._BINARY or self._BINARY[op] < min_prec:
                return left
            prec = self._BINARY[op]
            self.i += 1
            if op in ("=", "+=", "-=", "*=", "/=", "%="):
                if self.i - 2 != start or self.toks[start][0] != "name":
                    raise _Unknown("an assignment needs a variable on its left")
                name = self.toks[start][1]
                right = self._expr(prec)
                value = right if op == "=" else self._apply(op[0], self._var(name), right)
                self._set(name, value)
                left = self._wrap(value)
                continue
            if op == "?":
                a = self._expr(0)
                if self._peek()[1] != ":":
                    raise _Unknown("?: without its :")
                self.i += 1
                b = self._expr(prec)
                left = a if left else b
                continue
            right = self._expr(prec if op == "**" else prec + 1)
            left = self._apply(op, left, right)

    def _apply(self, op: str, a: int, b: int) -> int:
        if op in ("/", "%") and b == 0:
            raise _Unknown("division by 0 in arithmetic")
        if op == "/":
            q = abs(a) // abs(b)
            return self._wrap(q if (a >= 0) == (b >= 0) else -q)
        if op == "%":
            r = abs(a) % abs(b)
            return self._wrap(r if a >= 0 else -r)
        if op == "**":
            if b < 0:
                raise _Unknown("a negative exponent in arithmetic")
            return self._wrap(pow(a, b, _INT64))
        table = {
            "+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b,
            "<<": lambda: a << (b & 63), ">>": lambda: a >> (b & 63), "&": lambda: a & b,
            "|": lambda: a | b, "^": lambda: a ^ b, "<": lambda: int(a < b),
            ">": lambda: int(a > b), "<=": lambda: int(a <= b), ">=": lambda: int(a >= b),
            "==": lambda: int(a == b), "!=": lambda: int(a != b),
            "&&": lambda: int(bool(a and b)), "||": lambda: int(bool(a or b)), ",": lambda: b,
        }
        return self._wrap(table[op]())


# ----------------------------------------------------------------------------- commands


@dataclass
class Command:
    """One simple command: its words as the program receives them (``words[0]`` the program),
    the ``NAME=value`` assignments written before it (its own environment) and its line."""

    words: list[Word]
    env: list[Word]
    line: int


@dataclass
class Script:
    """A script walked once: every simple command with a program, the variables assigned at top
    level as ``NAME=value`` words (for ``XLLM_VMM_*`` environment flags), notes on what was
    assumed (loops run once), and the variables as they are at the end."""

    commands: list[Command] = field(default_factory=list)
    assignments: list[Word] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    variables: dict[str, Var] = field(default_factory=dict)


class _Walker:
    def __init__(self, text: str, file: str | None):
        self.lexer = _Lexer(text)
        self.file = file
        self.vars: dict[str, Var] = {}
        self.script = Script(variables=self.vars)
        self.sourced: list[str] = []  # files the script sources (their variables are unknown)

    def where(self, line: int) -> str:
        return f"{self.file}:{line}" if self.file else f"line {line}"

    def _missing(self, name: str) -> str:
        """Why ``$name`` is not known: the script never sets it (the environment would, or a
        file it sources)."""
        if self.sourced:
            return (f"${name} is not set in the script (it may come from the environment or "
                    f"from {self.sourced[-1]}, which the script sources)")
        return f"${name} is not set in the script"

    # --- expansion

    def _expand_parts(self, parts, splitting: bool) -> tuple[list[str], str | None, list[str]]:
        """Parts → fields (unquoted expansions split at blanks when ``splitting``), the reason
        when the value is not known here, and the assignments it used."""
        fields: list[str] = []
        cur = ""
        started = False  # a literal or a quoted part makes a word, even an empty one
        used: list[str] = []
        for part in parts:
            kind, quoted = part[0], part[-1]
            if kind == "lit":
                cur += part[1]
                started = True
                continue
            try:
                value = self._value(part, used)
            except _Unknown as u:
                return [], u.reason, used
            if quoted or not splitting:
                cur += value
                started = True
                continue
            if not value:
                continue
            pieces = value.split()
            if value[0] in " \t\n" and started:
                fields.append(cur)
                cur, started = "", False
            for k, piece in enumerate(pieces):
                if k:
                    fields.append(cur)
                    cur = ""
                cur += piece
                started = True
            if value[-1] in " \t\n" and started:
                fields.append(cur)
                cur, started = "", False
        if started:
            fields.append(cur)
        return fields, None, used

    def _value(self, part, used: list[str]) -> str:
        kind = part[0]
        if kind == "cmd":
            raise _Unknown(f"{part[1]} runs a command")
        if kind == "special":
            raise _Unknown(f"{part[1]} is set when the script runs")
        if kind == "arith":
            expr, used_here = self._arith_text(part[1])
            a = Arith(self.vars)
            value = a.eval(expr)
            used += used_here + a.used
            return str(value)
        _, name, op, arg, _ = part
        var = self.vars.get(name)
        if var is not None and var.unknown:
            if op in ("", ":?", "?") or var.unknown:
                raise _Unknown(var.unknown)
        is_set = var is not None
        nonempty = is_set and var.value != ""
        present = nonempty if op.startswith(":") else is_set
        if op in ("", ":?", "?"):
            if not is_set:
                raise _Unknown(self._missing(name))
            used.append(var.where)
            return var.value
        if op in (":-", "-", ":=", "="):
            if present:
                used.append(var.where)
                return var.value
            value = self._expand_arg(arg, used)
            if "=" in op:
                self.vars[name] = Var(value, None, f"{name}={value} (${{{name}{op}...}})")
            return value
        # :+ / +
        return self._expand_arg(arg, used) if present else ""

    def _expand_arg(self, arg: str, used: list[str]) -> str:
        parts, _ = _Lexer(arg)._word_all()
        fields, unknown, u = self._expand_parts(parts, splitting=False)
        used += u
        if unknown:
            raise _Unknown(unknown)
        return fields[0] if fields else ""

    def _arith_text(self, expr: str) -> tuple[str, list[str]]:
        """``$NAME``/``${NAME}``/``$((..))`` inside arithmetic replaced by their values."""
        used: list[str] = []
        if "$" not in expr and "`" not in expr:
            return expr, used
        parts, _ = _Lexer(expr)._word_all()
        text = ""
        for part in parts:
            if part[0] == "lit":
                text += part[1]
            else:
                text += self._value(part, used)
        return text, used

    def expand(self, lexed: _Lexed, splitting: bool = True) -> list[Word]:
        try:
            fields, unknown, used = self._expand_parts(lexed.parts, splitting)
        except RecursionError:
            fields, unknown, used = [], "the word is nested too deeply to expand here", []
        via = tuple(dict.fromkeys(used))
        if unknown:
            return [Word(lexed.raw, lexed.raw, lexed.line, lexed.col, unknown, via)]
        return [Word(f, lexed.raw, lexed.line, lexed.col, None, via) for f in fields]

    def assign(self, lexed: _Lexed) -> Word | None:
        """``NAME=value`` (``NAME+=value``) → sets the variable; the assignment as a word."""
        m = _ASSIGN_RE.match(lexed.raw)
        if not m or not lexed.parts or lexed.parts[0][0] != "lit":
            return None
        name, plus = m.group(1), m.group(2)
        first = lexed.parts[0]
        rest = (("lit", first[1][m.end():], first[2]),) + lexed.parts[1:]
        try:
            fields, unknown, used = self._expand_parts(rest, splitting=False)
        except RecursionError:
            fields, unknown, used = [], "the value is nested too deeply to expand here", []
        value = fields[0] if fields else ""
        where = f"{_short(lexed.raw)} ({self.where(lexed.line)})"
        if plus and name in self.vars and not unknown:
            old = self.vars[name]
            unknown = old.unknown
            value = old.value + value
        self.vars[name] = Var(value if not unknown else "", unknown and
                              f"{name} is {_short(lexed.raw[m.end():])}: {unknown}", where)
        text = f"{name}={value}" if not unknown else lexed.raw
        return Word(text, lexed.raw, lexed.line, lexed.col, unknown, tuple(used))

    # --- walking

    def walk(self) -> Script:
        items = self.lexer.items()
        cmd: list = []
        for item in items + [_Op("\n", 0, 0)]:
            if isinstance(item, _Arith):
                if cmd and isinstance(cmd[-1], _Lexed) and cmd[-1].raw == "for" and len(cmd) == 1:
                    self._arith_for(item)
                    cmd = []
                else:
                    self._arith_cmd(item)
                continue
            if isinstance(item, _Op) and item.text in ("\n", ";", "&", "|", "&&", "||", "|&",
                                                       "(", ")", ";;"):
                self._simple(cmd)
                cmd = []
                continue
            cmd.append(item)
        return self.script

    def _arith_cmd(self, item: _Arith) -> None:
        try:
            expr, _ = self._arith_text(item.expr)
            Arith(self.vars).eval(expr)
        except _Unknown:
            pass

    def _arith_for(self, item: _Arith) -> None:
        parts = item.expr.split(";")
        if len(parts) != 3:
            return
        init, cond, _step = parts
        head = f"for (( {item.expr.strip()} ))"
        where = self.where(item.line)
        try:
            expr, _ = self._arith_text(init)
            Arith(self.vars).eval(expr)
        except _Unknown as u:
            self.script.notes.append(f"{where}: the loop `{head}` is read once; its start is "
                                     f"not known here ({u.reason})")
            return
        names = sorted({m.group(0) for m in _NAME_RE.finditer(init)} & set(self.vars))
        state = ", ".join(f"{n}={self.vars[n].value}" for n in names)
        for n in names:
            self.vars[n] = Var(self.vars[n].value, None,
                               f"{n}={self.vars[n].value} (first iteration of `{head}`, {where})")
        note = f"{where}: the loop `{head}` is checked for its first iteration" + (
            f" ({state})" if state else "")
        try:
            expr, _ = self._arith_text(cond)
            if not Arith(dict(self.vars)).eval(expr):
                note += "; its condition is false there, so bash would not run the body"
        except _Unknown as u:
            note += f"; its condition is not known here ({u.reason})"
        self.script.notes.append(note)

    def _simple(self, items: list) -> None:
        # drop redirections with their targets
        words: list[_Lexed] = []
        skip = False
        for it in items:
            if skip:
                skip = False
                continue
            if isinstance(it, _Op):  # a redirection operator
                skip = True
                continue
            words.append(it)
        while words and words[0].raw in _RESERVED and words[0].parts and not words[0].parts[0][-1]:
            first = words.pop(0)
            if first.raw == "for" and words:
                self._for_in(first, words)
                return
        if not words:
            return
        env: list[Word] = []
        k = 0
        pre: list[_Lexed] = []
        while k < len(words) and _ASSIGN_RE.match(words[k].raw) and words[k].parts[0][0] == "lit" \
                and not words[k].parts[0][2]:
            pre.append(words[k])
            k += 1
        if k == len(words):  # assignments only: shell variables
            for w in pre:
                word = self.assign(w)
                if word is not None:
                    self.script.assignments.append(word)
            return
        saved = dict(self.vars)
        for w in pre:  # NAME=value cmd: the command's environment only
            word = self.assign(w)
            if word is not None:
                env.append(word)
        self.vars.clear()
        self.vars.update(saved)
        program = words[k].raw
        if program in _DECLARE:
            for w in words[k + 1:]:
                if w.raw.startswith("-"):
                    continue
                word = self.assign(w)
                if word is not None:
                    self.script.assignments.append(word)
            return
        if program in ("source", ".") and k + 1 < len(words):
            self.sourced.append(words[k + 1].raw)
        if program == "unset":
            for w in words[k + 1:]:
                self.vars.pop(w.raw, None)
            return
        expanded: list[Word] = []
        for w in words[k:]:
            expanded.extend(self.expand(w))
        if expanded:
            self.script.commands.append(Command(expanded, env, expanded[0].line))

    def _for_in(self, first: _Lexed, words: list[_Lexed]) -> None:
        name = words[0].raw
        values = words[2:] if len(words) > 1 and words[1].raw == "in" else []
        if not _NAME_RE.fullmatch(name):
            return
        head = f"for {name} in {' '.join(w.raw for w in values)}"
        if not values:
            self.vars[name] = Var("", f"${name} takes the script's arguments", head)
            return
        got = self.expand(values[0])
        if not got or got[0].unknown:
            reason = got[0].unknown if got else "its word list is empty"
            self.vars[name] = Var("", f"${name} comes from `{head}` ({reason})", head)
            return
        self.vars[name] = Var(got[0].text, None, f"{name}={got[0].text} (first of `{head}`, "
                                                 f"{self.where(first.line)})")
        self.script.notes.append(f"{self.where(first.line)}: the loop `{head}` is checked for "
                                 f"its first iteration ({name}={got[0].text})")


def run_script(text: str, file: str | None = None) -> Script:
    """Walk ``text`` as bash would (see the module docstring). Raises
    :class:`ShellSyntaxError` for text bash itself cannot split into words."""
    return _Walker(text.replace("\r\n", "\n"), file).walk()
