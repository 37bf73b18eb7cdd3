"""Typed errors of the multi-worker runtime: each names the rank and the address at fault and
says what to do."""

from __future__ import annotations


class DistributedError(RuntimeError):
    """Start-up or protocol failure of the worker set (a bad ``master_node_addr``, a rank that
    never arrived, workers whose cache geometry differs). ``rank`` is the rank at fault when
    known (else None); ``address`` the rendezvous address."""

    def __init__(self, message: str, *, rank: int | None = None, address: str = "",
                 hint: str = "") -> None:
        self.rank = rank
        self.address = address
        self.hint = hint
        super().__init__(message + (f"; {hint}" if hint else ""))


class WorkerLost(DistributedError):
    """A worker died or stopped answering: the worker set cannot compute any more. The engine
    that sees it is unhealthy for good (a tensor-parallel step needs every rank)."""
