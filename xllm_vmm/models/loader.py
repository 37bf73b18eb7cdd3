"""``load_model_spec``: a model directory or a catalogue name -> :class:`ModelSpec`.

From a directory only ``config.json`` and the headers of ``*.safetensors`` files are read (never
tensor data), so sizing works before any weight is loaded and on machines without the weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from xllm_vmm.models import catalogue
from xllm_vmm.models.config_reader import spec_from_config
from xllm_vmm.models.errors import ModelConfigError
from xllm_vmm.models.safetensors_header import totals
from xllm_vmm.models.spec import ModelSpec
from xllm_vmm.models.weights import with_estimate

_LIST_HINT = "`xllm-vmm plan --list-models` lists the catalogue"


def _looks_like_path(ref: str) -> bool:
    """True when ``ref`` can only be meant as a path (``org/name`` is taken as a name)."""
    return ref.startswith((".", "/", "~")) or ref.endswith("/") or ref.count("/") > 1 \
        or (os.sep != "/" and os.sep in ref)


def _read_config_file(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelConfigError(f"cannot read config.json: {exc.strerror or exc}", source=str(path),
                               hint="check that the file exists and is readable") from exc
    except UnicodeDecodeError as exc:
        raise ModelConfigError("config.json is not UTF-8 text", source=str(path),
                               hint="the file is damaged; re-download the model's config") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"config.json is not valid JSON: {exc.msg} at line {exc.lineno} "
                               f"column {exc.colno}", source=str(path),
                               hint="fix the JSON or re-download the model's config") from exc


def load_from_directory(directory: Path, *, name: str | None = None) -> ModelSpec:
    """Read ``directory/config.json`` and, when present, ``directory/*.safetensors`` headers."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelConfigError("no config.json in the model directory", source=str(directory),
                               hint="pass the directory that holds the model's config.json "
                                    "(Hugging Face layout), or a catalogue name; " + _LIST_HINT)
    spec = spec_from_config(_read_config_file(config_path), name=name or str(directory),
                            source=str(config_path))
    spec = with_estimate(spec)
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        t = totals(shards)
        spec = dataclasses.replace(spec, weight_bytes=t.bytes,
                                   extra={**spec.extra, "safetensors": t})
    return spec


def load_model_spec(ref: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``ref``: a local model directory (or its ``config.json``) or a
    catalogue name (``Qwen/Qwen3-8B``; case-insensitive; ``Qwen__Qwen3-8B`` also works).

    ``spec.weight_bytes`` is exact (sum of tensor bytes in the safetensors headers) when the
    directory has ``*.safetensors`` files, else None; ``spec.estimated_weight_bytes`` is always
    the architecture's estimate. Raises :class:`ModelConfigError` saying what was wrong, where,
    and what to do (for an unknown name: the closest catalogue names).
    """
    ref = str(ref).strip()
    if not ref:
        raise ModelConfigError("no model given", hint="pass a model directory or a catalogue "
                                                      "name; " + _LIST_HINT)
    path = Path(ref).expanduser()
    if path.is_dir():
        return load_from_directory(path)
    if path.is_file():
        if path.suffix == ".json":
            spec = spec_from_config(_read_config_file(path), name=str(path), source=str(path))
            return with_estimate(spec)
        raise ModelConfigError("not a model directory or a config.json file", source=str(path),
                               hint="pass the directory that holds config.json")
    name = catalogue.resolve_name(ref)
    if name is not None:
        spec = spec_from_config(catalogue.read_catalogue_config(name), name=name,
                                source=f"catalogue:{name}")
        return with_estimate(dataclasses.replace(spec, source="catalogue"))
    if _looks_like_path(ref):
        raise ModelConfigError("model directory does not exist", source=str(path),
                               hint="check the path, or use a catalogue name; " + _LIST_HINT)
    close = catalogue.closest_names(ref)
    hint = (f"did you mean {', '.join(close)}? " if close else "") + _LIST_HINT + \
        ", or pass a local model directory"
    raise ModelConfigError(f"unknown model {ref!r}: not a local directory and not in the "
                           f"catalogue", hint=hint)
