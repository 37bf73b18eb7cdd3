"""The ``xllm-vmm`` command line. Thin: every command calls library code."""

from __future__ import annotations

from typing import Callable, NoReturn


def output_guard(fn: Callable[[], object]) -> NoReturn:
    """Run a command; exit with its code, and never with a traceback for a closed or full output.

    A reader that went away (``xllm-vmm ... | head -1``: EPIPE) ends the command quietly with
    exit 1, as Click does for the Typer commands; any other unhandled ``OSError`` (``>
    /dev/full``: no space left) is one line on stderr and exit 2. stdout is then pointed at
    ``/dev/null`` so that the interpreter's final flush cannot fail again.
    """
    import errno
    import os
    import sys

    try:
        fn()
    except OSError as exc:
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, sys.stdout.fileno())
            os.close(fd)
        except (OSError, ValueError):
            pass
        if exc.errno == errno.EPIPE:
            raise SystemExit(1) from None
        what = f"cannot use {exc.filename}" if exc.filename else "cannot write the output"
        try:
            sys.stderr.write(f"error: {what}: {exc.strerror or exc}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        raise SystemExit(2) from None
    raise SystemExit(0)


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
