"""Safetensors checkpoints as the loader reads them: files, tensor entries, and their bytes.

A model directory holds either ``model.safetensors.index.json`` (``weight_map``: tensor name ->
shard file) with its shards, or ``model.safetensors``, or other ``*.safetensors`` files (all
read, in name order). A ``.safetensors`` file is an 8-byte little-endian header length ``N``,
``N`` bytes of JSON (``name -> {"dtype", "shape", "data_offsets": [begin, end]}``, offsets
relative to the data section that follows the header), then the data. Every entry is checked
before any tensor byte is read: a known dtype, ``end - begin == prod(shape) × item size``, the
range inside the file. Tensors are read with ``readinto`` straight into the destination memory
(no intermediate tensor): the loaded bytes are the file's bytes.

The sizing code has its own header reader (:mod:`xllm_vmm.models.safetensors_header`, totals
only); this one keeps offsets and lives below it in the layer table.

Units: bytes; offsets are absolute file offsets once :class:`TensorEntry` is built.
"""

from __future__ import annotations

import ctypes as C
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from xllm_vmm.weights.errors import CheckpointChanged, CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TensorEntry", "Checkpoint", "ShardSpec", "ITEM_BYTES", "torch_dtype",
           "read_checkpoint", "read_into"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: Largest header accepted (bytes).
MAX_HEADER_BYTES = 100 * 1024 * 1024

#: Item size of every safetensors dtype, bytes.
ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "I16": "int16", "U16": "uint16",
    "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32",
    "I64": "int64", "U64": "uint64", "F64": "float64",
}
#: dtypes a ``dtype=`` argument converts (floating point, not quantized).
CONVERTIBLE = frozenset({"F16", "BF16", "F32", "F64"})


def torch_dtype(st_dtype: str) -> "torch.dtype":
    """The torch dtype of a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``)."""
    import torch

    return getattr(torch, _TORCH_NAMES[st_dtype])


@dataclass(frozen=True)
class ShardSpec:
    """The part of a tensor one worker loads: indices ``[start, stop)`` along ``dim``.

    A shard hook ``shard(name, shape) -> ShardSpec | None`` answers per tensor; ``None`` loads
    it whole. :meth:`split` gives rank ``rank``'s equal part of ``world``; :meth:`skip` (a
    tensor this worker does not hold at all, as an expert of another expert-parallel group)
    leaves it out: it is not read, placed or returned.
    """

    dim: int
    start: int
    stop: int

    @classmethod
    def split(cls, dim: int, size: int, rank: int, world: int) -> "ShardSpec":
        """Rank ``rank`` of ``world`` equal parts of a dimension of ``size`` (must divide)."""
        if world <= 0 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, world={world})")
        if size % world:
            raise ValueError(f"dimension of {size} does not split into {world} equal parts")
        part = size // world
        return cls(dim, rank * part, (rank + 1) * part)

    @classmethod
    def skip(cls) -> "ShardSpec":
        """This worker holds none of the tensor (see the class docstring)."""
        return cls(-1, 0, 0)

    @property
    def skipped(self) -> bool:
        return self.dim == -1


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: ``nbytes`` bytes at absolute ``offset`` in ``file``."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    @property
    def item_bytes(self) -> int:
        return ITEM_BYTES[self.dtype]


@dataclass(frozen=True)
class Checkpoint:
    """The tensors of a model directory, in file order then offset order, and each file's
    ``(size, mtime_ns)`` at reading (see :meth:`check_unchanged`)."""

    model_dir: Path
    entries: tuple[TensorEntry, ...]
    files: dict[Path, tuple[int, int]]
    config: dict

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def tie_word_embeddings(self) -> bool | None:
        v = self.config.get("tie_word_embeddings")
        if v is None and isinstance(self.config.get("text_config"), dict):
            v = self.config["text_config"].get("tie_word_embeddings")
        return v if isinstance(v, bool) else None

    def check_unchanged(self) -> None:
        """Raises :class:`CheckpointChanged` when a file's size or modification time differs
        from when the checkpoint was read (a reload would read other weights)."""
        for path, (size, mtime) in self.files.items():
            try:
                st = path.stat()
            except OSError as exc:
                raise CheckpointChanged(f"cannot read the file any more: {exc.strerror or exc}",
                                        source=str(path),
                                        hint="restore the checkpoint or load the model again")
            if (st.st_size, st.st_mtime_ns) != (size, mtime):
                raise CheckpointChanged(
                    "the file changed since the weights were loaded (size or modification time)",
                    source=str(path), hint="load the model again to serve the new weights")


def _parse_header(path: Path) -> tuple[dict, int, int]:
    """``(header, data_start, file_size)`` of one safetensors file."""
    hint = "the file is not a complete safetensors file; re-download or re-save it"
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise CheckpointError("shorter than its 8-byte header length", source=str(path),
                                      hint=hint)
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointError(f"header length {n} does not fit the file ({size} bytes)",
                                      source=str(path), hint=hint)
            body = fh.read(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", source=str(path),
                              hint="check the file's permissions") from exc
    try:
        header = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"header is not valid JSON ({type(exc).__name__})",
                              source=str(path), hint=hint) from exc
    if not isinstance(header, dict):
        raise CheckpointError("header is not a JSON object", source=str(path), hint=hint)
    return header, 8 + n, size


def _entries_of(path: Path, wanted: set[str] | None) -> list[TensorEntry]:
    header, data_start, size = _parse_header(path)
    hint = "the file is damaged; re-download or re-save it"
    out = []
    for name, meta in header.items():
        if name == "__metadata__" or (wanted is not None and name not in wanted):
            continue
        try:
            dtype = meta["dtype"]
            shape = tuple(meta["shape"])
            begin, end = meta["data_offsets"]
            if dtype not in ITEM_BYTES:
                raise CheckpointError(f"tensor {name!r} has dtype {dtype!r}, which the loader "
                                      f"does not know ({', '.join(sorted(ITEM_BYTES))})",
                                      source=str(path), hint="convert the checkpoint")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) \
                    or not all(isinstance(v, int) and not isinstance(v, bool)
                               for v in (begin, end)):
                raise ValueError("shape and offsets must be non-negative integers")
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"tensor {name!r} has a malformed header entry ({exc})",
                                  source=str(path), hint=hint) from None
        nbytes = math.prod(shape) * ITEM_BYTES[dtype]
        if end - begin != nbytes or begin < 0 or data_start + end > size:
            raise CheckpointError(
                f"tensor {name!r}: data_offsets [{begin}, {end}] do not hold {shape} of {dtype} "
                f"({nbytes} bytes) inside the file's {size - data_start} data bytes",
                source=str(path), hint=hint)
        out.append(TensorEntry(name, dtype, shape, path, data_start + begin, nbytes))
    out.sort(key=lambda e: e.offset)
    return out


def read_checkpoint(model_dir: str | os.PathLike) -> Checkpoint:
    """Reads the headers (never tensor data) of a model directory's safetensors files."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError("is not a model directory", source=str(root),
                              hint="pass the directory that holds config.json and the "
                                   "*.safetensors files")
    config: dict = {}
    cfg_path = root / "config.json"
    if cfg_path.is_file():
        try:
            loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"config.json cannot be read ({exc})", source=str(cfg_path),
                                  hint="fix or re-download config.json") from None
    index = root / INDEX_FILE
    entries: list[TensorEntry] = []
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise TypeError("weight_map is not an object of names to file names")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"index cannot be read ({type(exc).__name__}: {exc})",
                                  source=str(index),
                                  hint="re-download it, or remove it to read every "
                                       "*.safetensors file of the directory") from None
        by_file: dict[str, set[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, set()).add(name)
        for fname in sorted(by_file):
            path = root / fname
            if Path(fname).is_absolute() or ".." in Path(fname).parts:
                raise CheckpointError(f"weight_map names {fname!r}, outside the directory",
                                      source=str(index), hint="fix the index")
            if not path.is_file():
                raise CheckpointError(f"weight_map names {fname!r}, which is missing",
                                      source=str(index),
                                      hint="download every shard the index lists")
            got = _entries_of(path, by_file[fname])
            missing = by_file[fname] - {e.name for e in got}
            if missing:
                raise CheckpointError(
                    f"{len(missing)} tensor(s) the index places in this file are not in it "
                    f"(first: {sorted(missing)[0]!r})", source=str(path),
                    hint="the shard and the index do not belong together; re-download both")
            entries.extend(got)
    else:
        single = root / SINGLE_FILE
        files = [single] if single.is_file() else sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError("holds no *.safetensors file", source=str(root),
                                  hint="the loader reads safetensors checkpoints; convert the "
                                       "weights (e.g. save_pretrained(safe_serialization=True))")
        seen: dict[str, Path] = {}
        for path in files:
            for e in _entries_of(path, None):
                if e.name in seen:
                    raise CheckpointError(f"tensor {e.name!r} is also in {seen[e.name].name}",
                                          source=str(path),
                                          hint="add model.safetensors.index.json to say which "
                                               "file is meant, or remove the extra file")
                seen[e.name] = path
                entries.append(e)
    files_state = {}
    for e in entries:
        if e.file not in files_state:
            st = e.file.stat()
            files_state[e.file] = (st.st_size, st.st_mtime_ns)
    return Checkpoint(root, tuple(entries), files_state, config)


def host_buffer(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` host bytes at ``addr`` (no copy)."""
    return memoryview((C.c_char * nbytes).from_address(addr)).cast("B")


def read_into(fh, offset: int, nbytes: int, dst: memoryview, source: str) -> None:
    """Reads exactly ``nbytes`` at file ``offset`` into ``dst`` (a writable buffer)."""
    done = 0
    while done < nbytes:
        try:
            got = os.preadv(fh.fileno(), [dst[done:nbytes]], offset + done)
        except OSError as exc:
            raise CheckpointError(f"read failed at byte {offset + done}: "
                                  f"{exc.strerror or exc}", source=source,
                                  hint="check the disk and the file") from exc
        if got <= 0:
            raise CheckpointError(f"file ends before byte {offset + nbytes}", source=source,
                                  hint="the file was truncated; re-download it")
        done += got


#: Signature of a shard hook: (tensor name, full shape) -> the part to load, or None (whole).
ShardHook = Callable[[str, tuple[int, ...]], "ShardSpec | None"]
