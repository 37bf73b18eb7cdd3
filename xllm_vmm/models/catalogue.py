"""The built-in model catalogue: published ``config.json`` sizing fields of well-known models.

Files live in ``xllm_vmm/models/catalogue/<org>__<name>.json`` (package data); the name
``<org>/<name>`` addresses one. Lookup is case-insensitive and also accepts ``<org>__<name>``
and a bare ``<name>`` when only one organisation has it.
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from importlib import resources
from typing import Any


def _files() -> dict[str, str]:
    """Catalogue name -> file name."""
    out = {}
    root = resources.files("xllm_vmm.models") / "catalogue"
    for entry in root.iterdir():
        if entry.name.endswith(".json") and "__" in entry.name:
            stem = entry.name[: -len(".json")]
            out[stem.replace("__", "/", 1)] = entry.name
    return out


@lru_cache(maxsize=1)
def _index() -> dict[str, str]:
    return _files()


def catalogue_names() -> list[str]:
    """Every catalogue name (``org/name``), sorted case-insensitively."""
    return sorted(_index(), key=str.lower)


def resolve_name(ref: str) -> str | None:
    """The catalogue name ``ref`` refers to, or None."""
    key = ref.strip().replace("__", "/", 1).lower()
    by_lower = {name.lower(): name for name in _index()}
    if key in by_lower:
        return by_lower[key]
    bare = [name for name in _index() if name.split("/", 1)[1].lower() == key]
    return bare[0] if len(bare) == 1 else None


def closest_names(ref: str, n: int = 3) -> list[str]:
    """Up to ``n`` catalogue names closest to ``ref`` (case-insensitive)."""
    key = ref.strip().replace("__", "/", 1).lower()
    names = catalogue_names()
    lowered = {name.lower(): name for name in names}
    hits = difflib.get_close_matches(key, list(lowered), n=n, cutoff=0.5)
    if not hits:  # compare without the organisation
        short = {name.split("/", 1)[1].lower(): name for name in names}
        hits = [short[h].lower() for h in
                difflib.get_close_matches(key.split("/")[-1], list(short), n=n, cutoff=0.5)]
    return [lowered[h] for h in hits]


def read_catalogue_config(name: str) -> dict[str, Any]:
    """The stored config of catalogue name ``name`` (exact, as :func:`resolve_name` gives)."""
    root = resources.files("xllm_vmm.models") / "catalogue"
    return json.loads((root / _index()[name]).read_text(encoding="utf-8"))
