"""Hypothesis example budgets: small for a developer's loop, larger in CI.

``examples(n)`` is ``n`` locally and ``n × 20`` when ``CI=true`` (CI has minutes to spare and the
suite runs in seconds); ``XLLM_VMM_TEST_EXAMPLES_SCALE`` overrides the factor either way.
"""

from __future__ import annotations

import os


def _scale() -> int:
    raw = os.environ.get("XLLM_VMM_TEST_EXAMPLES_SCALE", "").strip()
    if raw:
        return max(1, int(raw))
    return 20 if os.environ.get("CI", "").lower() == "true" else 1


SCALE = _scale()


def examples(n: int) -> int:
    """The number of hypothesis examples for a test whose local budget is ``n``."""
    return max(1, n * SCALE)
