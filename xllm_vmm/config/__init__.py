"""The configuration layer: the flag catalogue, the sources (gflags command line, TOML, the
engine's JSON file, environment) with provenance, and the configuration rules.

Public API (stable; ``plan`` and ``serve`` build on it)::

    from xllm_vmm.config import load, ResolvedConfig, ConfigError, Finding, Source
    from xllm_vmm.config.catalogue import FLAGS, FlagDef
    from xllm_vmm.config.rules import check, Report
    from xllm_vmm.config.inputs import resolve_inputs   # the check-config inputs, for commands
    from xllm_vmm.config.render import render_text, render_json, render_github

Nothing here imports torch, typer or pydantic at import time.
"""

from xllm_vmm.config.findings import ConfigError, Finding, Implied, Source
from xllm_vmm.config.loader import ResolvedConfig, load

__all__ = ["ConfigError", "Finding", "Implied", "ResolvedConfig", "Source", "load"]
