"""Errors of the model reader.

A :class:`ModelConfigError` is a value a user can act on: its message says what was wrong, where
it came from (a path, a field of ``config.json``, a flag) and what to do. The CLI prints the
message and exits; it never shows a traceback for one.
"""

from __future__ import annotations

import errno


class ModelConfigError(ValueError):
    """A model could not be read, or its configuration cannot be cached as asked.

    ``source`` is the path or catalogue name the problem came from ("" when none); ``hint`` is
    what to do. ``str(err)`` holds all three.
    """

    def __init__(self, message: str, *, source: str = "", hint: str = "") -> None:
        self.message = message
        self.source = source
        self.hint = hint
        text = message
        if source:
            text = f"{text} ({source})"
        if hint:
            text = f"{text}: {hint}"
        super().__init__(text)


class LayoutError(ModelConfigError):
    """The model cannot be laid out as asked (e.g. a worker count that does not divide the
    KV heads, or an unknown ``kv_cache_dtype``)."""


class CacheWriteError(ModelConfigError):
    """A model cache directory (the demo model's, a GGUF conversion's) cannot be written: the
    disk is full, the directory is read-only or not ours. Nothing was loaded."""

    ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
    """The write errors reported this way (any other ``OSError`` passes through)."""

    @classmethod
    def of(cls, exc: OSError, root: object) -> "CacheWriteError":
        return cls(f"cannot write the model cache: {exc.strerror or exc}", source=str(root),
                   hint="free space there, or point XDG_CACHE_HOME at another directory")
