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
    if not isinstance(header, dict):
        raise ModelConfigError("safetensors header is not a JSON object", source=str(path),
                               hint=hint)
    return header


def totals(paths: list[Path]) -> SafetensorsTotals:
    """Sum of tensor bytes and parameters over ``paths``."""
    tensors = params = nbytes = 0
    for path in paths:
        for name, entry in read_header(path).items():
            if name == "__metadata__":
                continue
            try:
                begin, end = entry["data_offsets"]
                shape = entry["shape"]
                count = math.prod(int(d) for d in shape)
                begin, end = int(begin), int(end)
            except (KeyError, TypeError, ValueError) as exc:
                raise ModelConfigError(f"safetensors header entry {name!r} has no valid "
                                       f"data_offsets/shape", source=str(path),
                                       hint="the file is damaged; re-download it") from exc
            if end < begin:
                raise ModelConfigError(f"safetensors entry {name!r} ends before it begins",
                                       source=str(path), hint="the file is damaged")
            tensors += 1
            params += count
            nbytes += end - begin
    return SafetensorsTotals(files=len(paths), tensors=tensors, params=params, bytes=nbytes)
