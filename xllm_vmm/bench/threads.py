"""Torch's OpenMP wait policy for the benches that run the engine in their own process.

On a shared machine OpenMP's spinning workers (the default wait policy) slowed the engine's
steps 5-13x (``docs/benchmarks.md``); the benches therefore ask for ``OMP_WAIT_POLICY=PASSIVE``
unless the user set it. OpenMP reads its environment once, when torch loads, so this must run
before torch is imported."""

from __future__ import annotations

import os
import sys


def passive_omp_wait() -> str:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless it is set; returns the policy in effect, or
    ``"unknown"`` when torch is already loaded (its OpenMP runtime read the environment then)."""
    if "torch" in sys.modules:
        return "unknown"
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
