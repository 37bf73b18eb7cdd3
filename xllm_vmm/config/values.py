"""Typed values of flags: text as written on a command line or in the environment, and native
TOML / JSON values, each turned into the flag's Python type or a :class:`ValueError` whose
message says what was expected.

Text is parsed as the engine's gflags parses its command line (:func:`parse_text`), the
engine's JSON file as its JSON loader reads it (:func:`coerce_native` with ``engine_json``).

Units: byte-sized flags (``FlagDef.unit == "bytes"``) hold integers of bytes. In TOML files and
``XLLM_VMM_*`` variables (this tool's own inputs) they also accept sizes: ``KiB MiB GiB TiB
PiB`` (and ``K M G T P``) are powers of 1024, ``KB MB GB TB PB`` powers of 1000, ``B`` is bytes;
``1.5GiB`` is accepted when it is a whole number of bytes. The engine's command line and JSON
file take bytes only.
"""

from __future__ import annotations

import math
import re

from xllm_vmm.config.catalogue import INT_RANGES, FlagDef


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
    "p": 1024**5, "pib": 1024**5, "pb": 1000**5,
}


#: The most memory one device, or one host, is taken to have (1 PiB): a larger figure is a typo
#: (``--device-memory 99999999999999999999GiB``), not a machine. The one home of the cap
#: (``check-config``'s and ``plan``'s memory options, :mod:`xllm_vmm.planner.devices`).
MAX_MEMORY_BYTES = 1 << 50


def parse_size(text: str) -> int:
    """``"512MiB"`` → 536870912. Raises ValueError for anything that is not a whole byte count."""
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(text)
    number, unit = match.group(1), _UNITS[match.group(2).lower()]
    if "." in number:
        whole, frac = number.split(".")
        total = int(whole) * unit + int(frac) * unit // 10 ** len(frac)
        if int(frac) * unit % 10 ** len(frac):
            raise ValueError(text)
        return total
    return int(number) * unit


def format_size(n: int) -> str:
    """Bytes as the largest exact binary unit: 1073741824 → ``1GiB``, 1000 → ``1000B``."""
    for name, unit in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % unit == 0:
            return f"{n // unit}{name}"
    return f"{n}B"


def expected(flag: FlagDef) -> str:
    """What a value of ``flag`` must look like, for error messages."""
    if flag.is_bool:
        return "a bool (true or false)"
    if flag.is_bytes:
        return "a byte count (an integer, or a size such as 512MiB or 1GiB)"
    if flag.is_int:
        lo, hi = _bounds(flag)
        return f"an integer ({flag.type}, {lo}..{hi})"
    if flag.type == "double":
        if flag.minimum is not None or flag.maximum is not None:
            return f"a number ({flag.minimum}..{flag.maximum})"
        return "a number"
    if flag.choices:
        return f"one of {flag.choices_text()}"
    return "a string"


def _check_choice(flag: FlagDef, text: str) -> str:
    """``text`` when ``flag`` takes any string or ``text`` is one of its values; else a
    ValueError listing the values, with the closest as "did you mean"."""
    if not flag.choices or flag.choice(text) is not None or (flag.default == "" and text == ""):
        return text
    import difflib

    same = [c for c in flag.choices if c.lower() == text.strip().lower()]
    if same:  # the engine compares these strings exactly
        raise ValueError(f"{text!r} is not a value of {flag.name}: the engine compares the value "
                         f"exactly (did you mean {same[0]}?)")
    lower = {c.lower(): c for c in flag.choices}
    close = [lower[c] for c in difflib.get_close_matches(text.strip().lower(), lower, n=1,
                                                         cutoff=0.5)]
    raise ValueError(f"{text!r} is not a value of {flag.name}"
                     + (f" (did you mean {close[0]}?)" if close else ""))


def _bounds(flag: FlagDef) -> tuple[int, int]:
    lo, hi = INT_RANGES[flag.type]
    if flag.minimum is not None:
        lo = max(lo, int(flag.minimum))
    if flag.maximum is not None:
        hi = min(hi, int(flag.maximum))
    return lo, hi


def _check_range(flag: FlagDef, value):
    if flag.is_int:
        lo, hi = _bounds(flag)
        if not lo <= value <= hi:
            raise ValueError(f"{value} is out of range for {flag.name}: expected {expected(flag)}")
    elif flag.type == "double":
        if not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number")
        if flag.minimum is not None and value < flag.minimum:
            raise ValueError(f"{value} is below the minimum {flag.minimum} of {flag.name}")
        if flag.maximum is not None and value > flag.maximum:
            raise ValueError(f"{value} is above the maximum {flag.maximum} of {flag.name}")
    return value


def _bad(flag: FlagDef, shown: str) -> ValueError:
    return ValueError(f"{shown} is not valid for {flag.name}: expected {expected(flag)}")


#: gflags' integer syntax (``FlagValue::ParseFrom``: ``strto64``/``strtou64`` over the whole
#: value, base 16 when it starts with ``0x``): ASCII digits only, leading blanks and a sign
#: allowed, nothing after the number (no size suffix, no underscores, no other digits).
_GFLAGS_INT = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+", re.ASCII)
_GFLAGS_HEX = re.compile(r"0[xX][0-9a-fA-F]+", re.ASCII)
#: ``strtod``'s syntax: decimal or hex floats, ``inf``/``infinity``/``nan`` (any case).
_GFLAGS_DOUBLE = re.compile(
    r"[ \t\n\v\f\r]*[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?"
    r"|(?i:inf|infinity|nan))", re.ASCII)
#: gflags' bool spellings (compared case-insensitively, the whole value).
_GFLAGS_TRUE = ("1", "t", "true", "y", "yes")
_GFLAGS_FALSE = ("0", "f", "false", "n", "no")


def _gflags_int(flag: FlagDef, text: str) -> int:
    if _GFLAGS_HEX.fullmatch(text):
        return int(text, 16)
    if flag.type.startswith("uint"):
        text = text.lstrip(" ")
        if text.startswith("-"):
            raise ValueError("negative")
    if not _GFLAGS_INT.fullmatch(text):
        raise ValueError(text)
    return int(text.strip(), 10)


def parse_text(flag: FlagDef, text: str, *, sizes: bool = False):
    """A value written as text → the flag's type, parsed as the engine's gflags parses its
    command line: integers in ASCII digits (or ``0x`` hex), nothing after them; doubles as
    ``strtod``; bools in gflags' spellings (``1 t true y yes`` / ``0 f false n no``, any case,
    nothing around them). ``sizes``: a byte-sized flag also takes a size (``512MiB``; this
    tool's own convenience for TOML and the environment: the engine's command line takes
    bytes only)."""
    if flag.type == "string":
        return _check_choice(flag, text)
    if flag.is_bool:
        low = text.lower()
        if low in _GFLAGS_TRUE:
            return True
        if low in _GFLAGS_FALSE:
            return False
        hint = " (gflags reads 1 t true y yes / 0 f false n no, nothing around them)" \
            if text.strip().lower() in _GFLAGS_TRUE + _GFLAGS_FALSE else ""
        raise ValueError(f"{text!r} is not valid for {flag.name}: expected {expected(flag)}"
                         + hint)
    if flag.is_int:
        try:
            value = _gflags_int(flag, text)
        except ValueError:
            size = None
            if flag.is_bytes:
                try:
                    size = parse_size(text)
                except ValueError:
                    pass
            if size is not None and sizes:
                value = size
            elif size is not None:
                raise ValueError(
                    f"{text!r} is not valid for {flag.name}: the engine's command line takes a "
                    f"whole number of bytes (gflags {flag.type}: no size suffix); write "
                    f"{size}") from None
            else:
                raise _bad(flag, repr(text)) from None
        return _check_range(flag, value)
    if not _GFLAGS_DOUBLE.fullmatch(text):
        raise _bad(flag, repr(text))
    raw = text.strip()
    value = float.fromhex(raw) if "x" in raw.lower() else float(raw)
    return _check_range(flag, value)


def _shown(value) -> str:
    """A TOML / JSON value as its file wrote it, for messages (never a Python repr of a date)."""
    import datetime as dt

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.datetime):
        return f"the date-time {value.isoformat().replace('+00:00', 'Z')}"
    if isinstance(value, dt.date):
        return f"the date {value.isoformat()}"
    if isinstance(value, dt.time):
        return f"the time {value.isoformat()}"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    if value is None:
        return "null"
    return repr(value)


def coerce_native(flag: FlagDef, value, *, engine_json: bool = False):
    """A TOML or JSON value → the flag's type.

    Types must match, as the engine's JSON loader reads them (nlohmann ``get<T>``: a string is
    never a bool or a number there): a bool for a bool flag, an integer for an integer flag (a
    float only when whole: the loader would truncate 1.5 to 1), an integer or a float for a
    double, a string for a string. TOML (this tool's own files, ``engine_json`` False) also
    takes a size string for a byte-sized flag (``"16GiB"``); the engine's JSON file does not.
    """
    shown = _shown(value)
    if isinstance(value, str) and flag.is_bytes and flag.type != "string" and not engine_json:
        return parse_text(flag, value, sizes=True)
    where = "the engine's JSON loader" if engine_json else "TOML"
    if flag.is_bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _GFLAGS_TRUE + _GFLAGS_FALSE:
            word = "true" if value.strip().lower() in _GFLAGS_TRUE else "false"
            raise ValueError(f"{shown} is not valid for {flag.name}: expected {expected(flag)}; "
                             f"{where} reads a bool only as true or false, not a string (write "
                             f"{word} without quotes)")
        raise _bad(flag, shown)
    if flag.type == "string":
        if isinstance(value, str):
            return _check_choice(flag, value)
        raise _bad(flag, shown)
    if isinstance(value, bool):
        raise _bad(flag, shown)
    if flag.is_int:
        if isinstance(value, int):
            return _check_range(flag, value)
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            return _check_range(flag, int(value))
        if isinstance(value, float) and math.isfinite(value) and engine_json:
            raise ValueError(f"{shown} is not valid for {flag.name}: expected {expected(flag)}; "
                             f"the engine's JSON loader would truncate it to {int(value)}")
        if isinstance(value, str) and engine_json:
            raise ValueError(f"{shown} is not valid for {flag.name}: {where} reads a number, "
                             "not a string (write it without quotes"
                             + (", in bytes" if flag.is_bytes else "") + ")")
        raise _bad(flag, shown)
    if isinstance(value, (int, float)):
        try:
            return _check_range(flag, float(value))
        except OverflowError:
            raise _bad(flag, shown) from None
    raise _bad(flag, shown)


def parse_devices(text: str) -> list[tuple[str, int | None]]:
    """``"npu:0,npu:1"`` → ``[("npu", 0), ("npu", 1)]``; ``"cpu"`` → ``[("cpu", None)]``;
    ``""`` and ``"auto"`` → ``[]`` (chosen at start-up). Raises ValueError naming the bad entry
    or a device listed twice (``npu:0,npu:0`` would count two workers on one device)."""
    text = text.strip()
    if text in ("", "auto"):
        return []
    out: list[tuple[str, int | None]] = []
    for part in text.split(","):
        part = part.strip()
        kind, sep, index = part.partition(":")
        kind = kind.strip().lower()
        if not re.fullmatch(r"[a-z][a-z0-9_]*", kind):
            raise ValueError(f"device {part!r} is not KIND or KIND:INDEX (e.g. npu:0, cuda:0, cpu)")
        if kind not in DEVICE_KINDS:
            alias = {"gpu": "cuda", "nvidia": "cuda", "ascend": "npu"}.get(kind)
            raise ValueError(f"device {part!r}: {kind!r} is not a device kind (kinds: "
                             f"{', '.join(DEVICE_KINDS)})"
                             + (f"; did you mean {alias}?" if alias else ""))
        if sep:
            if not index.strip().isdigit():
                raise ValueError(f"device {part!r}: the index after ':' must be a number")
            if len(index.strip()) > 6 or int(index) > MAX_DEVICE_INDEX:
                raise ValueError(f"device {part!r}: index {index.strip()} is out of range "
                                 f"(0..{MAX_DEVICE_INDEX})")
            out.append((kind, int(index)))
        else:
            out.append((kind, None))
        if out[-1] in out[:-1]:
            raise ValueError(f"device {part!r} is listed twice: each device serves one worker")
        if out[-1][0] != out[0][0]:
            raise ValueError(f"devices mix kinds ({out[0][0]} and {kind}): one engine serves on "
                             f"devices of one kind")
    return out


#: Device kinds ``devices`` accepts: every kind the engine's platform code names
#: (``Platform::type_str``: npu, mlu, cuda, ilu, musa, dcu) and cpu (this tool's host driver).
#: npu, cuda and cpu have a VMM driver; on the others VMM is refused (VMM-01), serving without
#: VMM is accepted.
DEVICE_KINDS = ("npu", "cuda", "cpu", "mlu", "ilu", "musa", "dcu")
#: Largest device index accepted (a host has far fewer devices).
MAX_DEVICE_INDEX = 1023
