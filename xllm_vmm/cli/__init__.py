"""The ``xllm-vmm`` command line. Thin: every command calls library code."""

from __future__ import annotations

from xllm_vmm.cli.guard import output_guard

__all__ = ["main", "output_guard"]


def main() -> None:
    output_guard(_main)


def _main() -> None:
    import os
    import sys

    # Fast path: `check-config` parses its own command line (gflags-style flags beside its
    # options) and must start quickly in CI, so it runs without importing Typer. Shell
    # completion still goes through Typer.
    if len(sys.argv) > 1 and sys.argv[1] == "check-config" and not any(
            k.endswith("_COMPLETE") for k in os.environ):
        from xllm_vmm.cli.check_config import main as check_config_main

        check_config_main(sys.argv[2:])

    from xllm_vmm.cli.app import app

    app()
