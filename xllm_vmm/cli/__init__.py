"""The ``xllm-vmm`` command line. Thin: every command calls library code."""

from __future__ import annotations


def main() -> None:
    from xllm_vmm.cli.app import app

    app()
