"""Writes (or, with ``--check``, checks) ``docs/cli-reference.md``: the flag catalogue's
reference (:mod:`xllm_vmm.config.docs`) with the options of the commands it lists, read from
this command line's own Typer definitions. ``python -m xllm_vmm.cli.reference``."""

from __future__ import annotations

import sys


def reference_text() -> str:
    """The full text of docs/cli-reference.md."""
    from xllm_vmm.cli.app import app
    from xllm_vmm.config.docs import reference_markdown

    return reference_markdown(app)


def main(argv: list[str] | None = None) -> int:
    from xllm_vmm.config.docs import REFERENCE_PATH

    argv = sys.argv[1:] if argv is None else argv
    text = reference_text()
    if argv and argv[0] == "--check":
        current = REFERENCE_PATH.read_text(encoding="utf-8") if REFERENCE_PATH.exists() else ""
        if current != text:
            sys.stderr.write(f"{REFERENCE_PATH} is stale: run python -m xllm_vmm.cli.reference\n")
            return 1
        return 0
    REFERENCE_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
