"""The whole ``xllm-vmm`` Typer application: the root ``app`` (:mod:`xllm_vmm.cli.root`) with
every command module imported, each registering its commands on it. Import ``app`` from here
to run the command line; a command module imports it from :mod:`xllm_vmm.cli.root`."""

from __future__ import annotations

from xllm_vmm.cli.root import app

# Command modules register themselves on `app` (sorted; the bench subcommands in the order
# `bench --help` lists them).
from xllm_vmm.cli import bench  # noqa: E402,F401
from xllm_vmm.cli import bench_spec  # noqa: E402,F401
from xllm_vmm.cli import bench_attention  # noqa: E402,F401
from xllm_vmm.cli import bench_soak  # noqa: E402,F401
from xllm_vmm.cli import flags  # noqa: E402,F401
from xllm_vmm.cli import generate  # noqa: E402,F401
from xllm_vmm.cli import models  # noqa: E402,F401
from xllm_vmm.cli import plan  # noqa: E402,F401
from xllm_vmm.cli import schema  # noqa: E402,F401
from xllm_vmm.cli import serve  # noqa: E402,F401
from xllm_vmm.cli import top  # noqa: E402,F401

__all__ = ["app"]
