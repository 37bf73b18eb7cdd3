"""What the schemathesis fuzzers of the API share: bounded settings, a time budget, and the
OpenAI error shape every refusal must have."""

from __future__ import annotations

import time

from hypothesis import HealthCheck, Phase, settings


def fuzz_settings(examples: int):
    """Hypothesis settings of a fuzzer: ``examples`` cases per operation, explicit and
    generated phases only, deterministic, no database, no deadline (time is bounded by
    :func:`past_budget`)."""
    return settings(max_examples=examples, deadline=None, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck), derandomize=True, database=None)


def past_budget(started: list[float], budget_s: float) -> bool:
    """True once ``budget_s`` seconds passed since the first call (``started`` keeps it)."""
    if not started:
        started.append(time.monotonic())
    return time.monotonic() - started[0] > budget_s


def assert_openai_error(resp, where: str) -> dict:
    """The ``error`` object of an OpenAI-shaped error answer (message, type, code)."""
    body = resp.json()
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], \
        f"{where}: not an OpenAI error body: {resp.text[:500]}"
    assert isinstance(err.get("type"), str) and "code" in err
    return err
