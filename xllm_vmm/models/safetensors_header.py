"""Exact weight bytes from safetensors headers, without reading tensor data.

A ``.safetensors`` file starts with an 8-byte little-endian length ``N`` followed by ``N`` bytes
of JSON that map each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``. Only
those ``8 + N`` bytes are read. A tensor's bytes are ``end - begin``; its parameter count is the
product of its shape.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from xllm_vmm.models.errors import ModelConfigError

#: Largest header accepted (bytes); real headers are well under a few MiB.
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class SafetensorsTotals:
    files: int
    tensors: int
    params: int
    bytes: int  # tensor data bytes over every file


def read_header(path: Path) -> dict:
    """The JSON header of one safetensors file (``__metadata__`` included)."""
    return _read(path)[0]


def _read(path: Path) -> tuple[dict, int]:
    """The JSON header of one safetensors file and the size of its data section (bytes after
    the header), which every tensor's ``data_offsets`` must lie within."""
    hint = "the file is not a complete safetensors file; re-download it or remove it"
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ModelConfigError("safetensors file is shorter than its 8-byte header "
                                       "length", source=str(path), hint=hint)
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise ModelConfigError(f"safetensors header length {n} does not fit the file "
                                       f"({size} bytes)", source=str(path), hint=hint)
            body = fh.read(n)
    except OSError as exc:
        raise ModelConfigError(f"cannot read safetensors file: {exc.strerror or exc}",
                               source=str(path), hint="check the file's permissions") from exc
    try:
        header = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"safetensors header is not valid JSON ({exc})",
                               source=str(path), hint=hint) from exc
    except RecursionError as exc:
        raise ModelConfigError("safetensors header is nested too deeply to read (a real header "
                               "is one object of tensor entries)", source=str(path),
                               hint=hint) from exc
    if not isinstance(header, dict):
        raise ModelConfigError("safetensors header is not a JSON object", source=str(path),
                               hint=hint)
    return header, size - 8 - n


def _whole(value: object) -> int:
    """``value`` as a non-negative integer; ValueError for anything else (floats such as
    ``1e400``, booleans, negatives, strings)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def totals(paths: list[Path]) -> SafetensorsTotals:
    """Sum of tensor bytes and parameters over ``paths``."""
    tensors = params = nbytes = 0
    for path in paths:
        header, data_size = _read(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                begin, end = entry["data_offsets"]
                shape = entry["shape"]
                count = math.prod(_whole(d) for d in shape)
                begin, end = _whole(begin), _whole(end)
            except (KeyError, TypeError, ValueError) as exc:
                raise ModelConfigError(f"safetensors header entry {name!r} has no valid "
                                       f"data_offsets/shape (non-negative integers expected)",
                                       source=str(path),
                                       hint="the file is damaged; re-download it") from exc
            if end < begin:
                raise ModelConfigError(f"safetensors entry {name!r} ends before it begins",
                                       source=str(path), hint="the file is damaged")
            if end > data_size:
                raise ModelConfigError(
                    f"safetensors entry {name!r} has data_offsets [{begin}, {end}] beyond the "
                    f"file's data section ({data_size} bytes after the header)",
                    source=str(path),
                    hint="the file is truncated or damaged; re-download it")
            tensors += 1
            params += count
            nbytes += end - begin
    return SafetensorsTotals(files=len(paths), tensors=tensors, params=params, bytes=nbytes)
