"""The error a request the engine refuses raises. A leaf module: the sampling parameters
check their values with it and the request module re-exports it, without either importing
the other; ``xllm_vmm.engine`` exposes it as ``RequestError``."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses: ``param`` names the field, ``message`` says what to do."""

    def __init__(self, *, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


__all__ = ["RequestError"]
