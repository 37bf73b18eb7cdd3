"""Pydantic models generated from the flag catalogue, built once per process on first use.

- :func:`config_model`: ``XllmConfig``, one optional field per flag (type and default from the
  catalogue; integer ranges and ``minimum``/``maximum`` as constraints). ``serve`` and library
  users can validate a resolved configuration with it.
- :func:`toml_schema`: the JSON Schema of xllm-vmm's TOML files (flat flag keys, or tables named
  after flag groups), generated from those models; ``xllm-vmm schema`` prints it.

pydantic is imported here only, never by ``check-config``'s start-up path.
"""

from __future__ import annotations

from functools import lru_cache

from xllm_vmm.config.catalogue import FLAGS, GROUPS, INT_RANGES, FlagDef

SCHEMA_ID = "https://xllm-vmm.dev/schema/config.json"


def _field(flag: FlagDef):
    from typing import Annotated, Union

    from pydantic import Field

    kw: dict = {"default": flag.default, "description": flag.help}
    if flag.is_bool:
        tp = bool
    elif flag.is_int:
        lo, hi = INT_RANGES[flag.type]
        if flag.minimum is not None:
            lo = max(lo, int(flag.minimum))
        if flag.maximum is not None:
            hi = min(hi, int(flag.maximum))
        tp = Annotated[int, Field(ge=lo, le=hi)]
        if flag.is_bytes:
            tp = Union[tp, Annotated[str, Field(pattern=r"^\s*[0-9]+(\.[0-9]+)?\s*([KMGTkmgt](i?[Bb])?|[Bb])?\s*$")]]
    elif flag.type == "double":
        tp = Annotated[float, Field(ge=flag.minimum, le=flag.maximum, allow_inf_nan=False)]
    elif flag.choices:
        from typing import Literal

        # The editor schema lists the values as the engine spells them (an `enum`); the
        # checker also accepts them in any case.
        tp = Literal[tuple(flag.choices) + (("",) if flag.default == "" else ())]  # type: ignore[misc]
    else:
        tp = str
    return tp, Field(**kw)


@lru_cache(maxsize=None)
def config_model():
    """``XllmConfig``: every flag as a field (extra keys forbidden)."""
    from pydantic import ConfigDict, create_model

    fields = {name: _field(flag) for name, flag in FLAGS.items()}
    return create_model("XllmConfig",
                        __config__=ConfigDict(extra="forbid", protected_namespaces=(),
                                              strict=True),
                        **fields)


@lru_cache(maxsize=None)
def group_models() -> dict:
    """One model per flag group (the TOML tables)."""
    from pydantic import ConfigDict, create_model

    out = {}
    for group in GROUPS:
        fields = {n: _field(f) for n, f in FLAGS.items() if f.group == group}
        out[group] = create_model(f"Group_{group}", __config__=ConfigDict(
            extra="forbid", protected_namespaces=(), strict=True,
            title=f"[{group}] {GROUPS[group]}"), **fields)
    return out


def toml_schema() -> dict:
    """JSON Schema (draft 2020-12) for xllm-vmm TOML files."""
    flat = config_model().model_json_schema()
    props: dict = {}
    for name, schema in flat["properties"].items():
        props[name] = schema
    defs = dict(flat.get("$defs", {}))
    for group, model in group_models().items():
        gs = model.model_json_schema()
        defs.update(gs.pop("$defs", {}))
        table = {"type": "object", "title": gs.get("title", group),
                 "properties": gs["properties"], "additionalProperties": False}
        if group in props:  # the flag `model` and the table [model]
            props[group] = {"anyOf": [props[group], table]}
        else:
            props[group] = table
    out = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "xllm-vmm configuration",
        "description": "Flags of xllm-vmm as TOML keys, at the top level or in tables named "
                       "after flag groups. Generated from the flag catalogue.",
        "type": "object",
        "properties": props,
        "additionalProperties": False,
    }
    if defs:
        out["$defs"] = defs
    return out
