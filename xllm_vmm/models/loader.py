"""``load_model_spec``: a model directory or a catalogue name -> :class:`ModelSpec`.

From a directory only ``config.json`` and (for sizing, ``read_weights=True``) the headers of
``*.safetensors`` files are read, never tensor data, so sizing works before any weight is loaded
and on machines without the weights. ``check-config`` reads ``config.json`` alone
(``read_weights=False``): its model rules need the architecture, not the weight bytes. A shard
whose header cannot be read never makes the model unreadable: the spec keeps the architecture's
estimate and says what was wrong (:attr:`ModelSpec.weights_warning`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from xllm_vmm.models import catalogue
from xllm_vmm.models.config_reader import spec_from_config
from xllm_vmm.models.errors import ModelConfigError
from xllm_vmm.models.spec import ModelSpec
from xllm_vmm.models.weight_estimates import with_estimate

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
    except RecursionError as exc:
        raise ModelConfigError("config.json is nested too deeply to read (a model config is a "
                               "few levels of objects)", source=str(path),
                               hint="fix the JSON or re-download the model's config") from exc


def load_from_directory(directory: Path, *, name: str | None = None,
                        read_weights: bool = True) -> ModelSpec:
    """Read ``directory/config.json`` and, with ``read_weights`` and when present,
    ``directory/*.safetensors`` headers (a bad header: the estimate stays, with the error in
    ``spec.extra["safetensors_error"]``)."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelConfigError("no config.json in the model directory", source=str(directory),
                               hint="pass the directory that holds the model's config.json "
                                    "(Hugging Face layout), or a catalogue name; " + _LIST_HINT)
    spec = spec_from_config(_read_config_file(config_path), name=name or str(directory),
                            source=str(config_path))
    spec = with_estimate(spec)
    shards = sorted(directory.glob("*.safetensors")) if read_weights else []
    if shards:
        from xllm_vmm.models.safetensors_header import totals  # only when shards are read

        try:
            t = totals(shards)
        except ModelConfigError as err:
            return dataclasses.replace(spec, extra={**spec.extra, "safetensors_error": err})
        spec = dataclasses.replace(spec, weight_bytes=t.bytes,
                                   extra={**spec.extra, "safetensors": t})
    return spec


def load_from_gguf(path: Path) -> ModelSpec:
    """The spec of a GGUF file (or a directory holding one) from its metadata: the header is
    parsed, no tensor is read; the weights are the architecture's estimate in the dtype the
    file is served in by default."""
    from xllm_vmm.models.gguf import gguf_file, read_config

    f = gguf_file(path)
    spec = spec_from_config(read_config(f), name=str(f), source=str(f))
    return with_estimate(spec)


def load_model_spec(ref: str, *, read_weights: bool = True) -> ModelSpec:
    """The :class:`ModelSpec` of ``ref``: a local model directory (or its ``config.json``), a
    GGUF file (or a directory holding one: sized from its metadata) or a catalogue name (``Qwen/Qwen3-8B``; case-insensitive; ``Qwen__Qwen3-8B`` also works).

    ``spec.weight_bytes`` is exact (sum of tensor bytes in the safetensors headers) when
    ``read_weights`` is true and the directory has readable ``*.safetensors`` files, else None;
    ``spec.estimated_weight_bytes`` is always the architecture's estimate. With
    ``read_weights=False`` nothing but ``config.json`` is read (``check-config``). A damaged
    shard does not raise: :attr:`ModelSpec.weights_warning` names the file and the problem. Raises :class:`ModelConfigError` saying what was wrong, where,
    and what to do (for an unknown name: the closest catalogue names).
    """
    ref = str(ref).strip()
    if not ref:
        raise ModelConfigError("no model given", hint="pass a model directory or a catalogue "
                                                      "name; " + _LIST_HINT)
    path = Path(ref).expanduser()
    from xllm_vmm.models.gguf import is_gguf_path

    if is_gguf_path(path):
        return load_from_gguf(path)
    if path.is_dir():
        return load_from_directory(path, read_weights=read_weights)
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
