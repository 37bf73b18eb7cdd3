"""How every ``xllm-vmm`` command ends: its exit code, never a traceback for a closed or full
output. A leaf module, so that the command modules and the package ``__init__`` share it
without importing each other."""

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
