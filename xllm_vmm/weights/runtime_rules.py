"""Runtime rules (``check-config --explain RULE-ID``) that the weights code enforces, as functions the engine
and the server call before acting.

- W-02 (sleep, wakeup or fork without weight VMM) is enforced by
  :class:`~xllm_vmm.weights.ModelWeights` and :class:`~xllm_vmm.weights.sleep.SleepController`
  themselves; :func:`require_weight_vmm` is the same check for callers that hold no weights
  object (an engine started without weight VMM).
- W-06 (remote weight transfer using Mooncake while the pool is elastic):
  :func:`require_resident_pool` before any remote weight transfer. xllm-vmm has no Mooncake
  transfer yet; the check is what such a path must call first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xllm_vmm.pool.budget import BudgetMode
from xllm_vmm.weights.errors import ResidentPoolRequired, WeightVmmRequired

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.pool.pool import VmmPool
    from xllm_vmm.weights.model_weights import ModelWeights

__all__ = ["require_weight_vmm", "require_resident_pool"]


def require_weight_vmm(weights: "ModelWeights | None", action: str) -> "ModelWeights":
    """W-02: ``weights`` must live in a VMM pool for ``action`` (sleep, wakeup, fork)."""
    if weights is None or not weights.vmm:
        raise WeightVmmRequired(action)
    return weights


def require_resident_pool(pool: "VmmPool | None",
                          what: str = "remote weight transfer using Mooncake") -> None:
    """W-06: ``what`` needs a fully resident pool: a fixed pool (``vmm_elastic=false``) sized
    by a positive ``max_memory_utilization``, or the physical (non-VMM) cache."""
    if pool is None:
        return
    if pool.mode is BudgetMode.ELASTIC:
        raise ResidentPoolRequired(what, "the VMM pool is elastic (vmm_elastic=true): its pages "
                                         "come and go, a remote peer cannot address them")
    if pool.budget.max_memory_utilization <= 0:
        raise ResidentPoolRequired(what, f"max_memory_utilization="
                                         f"{pool.budget.max_memory_utilization} sizes no "
                                         "resident pool")
