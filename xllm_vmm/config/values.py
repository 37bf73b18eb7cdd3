"""Typed values of flags: text as written on a command line or in the environment, and native
TOML / JSON values, each turned into the flag's Python type or a :class:`ValueError` whose
message says what was expected.

Units: byte-sized flags (``FlagDef.unit == "bytes"``) hold integers of bytes; they also accept
sizes: ``KiB MiB GiB TiB PiB`` (and ``K M G T P``) are powers of 1024, ``KB MB GB TB PB`` powers
of 1000, ``B`` is bytes. ``1.5GiB`` is accepted when it is a whole number of bytes.
"""

from __future__ import annotations

import math
import re

from xllm_vmm.config.catalogue import INT_RANGES, FlagDef

_TRUE = {"true", "t", "yes", "y", "1"}
_FALSE = {"false", "f", "no", "n", "0"}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
    "p": 1024**5, "pib": 1024**5, "pb": 1000**5,
}


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


def parse_text(flag: FlagDef, text: str):
    """A value written as text (command line, environment, shell script) → the flag's type."""
    if flag.type == "string":
        return _check_choice(flag, text)
    raw = text.strip()
    if flag.is_bool:
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise _bad(flag, repr(text))
    if flag.is_int:
        try:
            value = int(raw, 10)
        except ValueError:
            try:
                value = int(raw, 0)
            except ValueError:
                if not flag.is_bytes:
                    raise _bad(flag, repr(text)) from None
                try:
                    value = parse_size(raw)
                except ValueError:
                    raise _bad(flag, repr(text)) from None
        return _check_range(flag, value)
    try:
        value = float(raw)
    except ValueError:
        raise _bad(flag, repr(text)) from None
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


def coerce_native(flag: FlagDef, value, *, lenient_text: bool = False):
    """A TOML or JSON value → the flag's type.

    Types must match (a TOML bool for a bool flag, an integer for an integer flag, an integer or
    a float for a double, a string for a string); byte-sized flags also take a size string. With
    ``lenient_text`` (the engine's JSON file) a string is parsed as command-line text.
    """
    shown = _shown(value)
    if isinstance(value, str) and (lenient_text or (flag.is_bytes and flag.type != "string")):
        return parse_text(flag, value)
    if flag.is_bool:
        if isinstance(value, bool):
            return value
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
