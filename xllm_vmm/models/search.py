"""The one monotone search of the project: the largest integer for which a predicate holds.

Capacity questions (how many sequences, blocks or tokens fit a budget; the longest context one
request can have) are all "the largest x with pred(x)" for a predicate that is true up to some
point and false after it. The planner (:mod:`xllm_vmm.planner.capacity`) and the KV cache
(:mod:`xllm_vmm.kvcache`: token capacity of a budget, admission) answer them with this one
function. It lives in :mod:`xllm_vmm.models`, the lowest package both may import.
"""

from __future__ import annotations


def largest(pred, lo: int, hi: int | None = None, limit: int = 1 << 62) -> int | None:
    """The largest integer ``x >= lo`` with ``pred(x)`` true, for a ``pred`` that is true up to
    some point and false after it; ``lo - 1`` when ``pred(lo)`` is false; None when ``pred``
    still holds at ``limit``. Exponential search for an upper bound, then bisection."""
    if not pred(lo):
        return lo - 1
    good = lo
    bad = hi
    if bad is None or pred(bad):
        step = max(1, lo)
        while True:
            probe = good + step
            if probe >= limit:
                return None if pred(limit) else largest(pred, good, limit, limit)
            if not pred(probe):
                bad = probe
                break
            good, step = probe, step * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if pred(mid):
            good = mid
        else:
            bad = mid
    return good
