"""The VMM pool: one per worker. A stable virtual arena, tenants (KV cache from the low end,
weights from the high end), the live budget and map/unmap with rollback.

Public API: :class:`VmmPool`, :class:`Region`, :class:`PoolStats`, :class:`PoolCapacityError`,
:class:`BudgetConfig`, :class:`BudgetMode`, :class:`BudgetConfigError`,
:class:`ExecutionPeak`, :func:`static_capacity_bytes`.
"""

from xllm_vmm.pool.budget import (
    DEFAULT_EXECUTION_HEADROOM_FRACTION,
    BudgetConfig,
    BudgetConfigError,
    BudgetMode,
    ExecutionPeak,
    static_capacity_bytes,
)
from xllm_vmm.pool.pool import PoolCapacityError, PoolStats, Region, VmmPool

__all__ = [
    "DEFAULT_EXECUTION_HEADROOM_FRACTION",
    "BudgetConfig",
    "BudgetConfigError",
    "BudgetMode",
    "ExecutionPeak",
    "PoolCapacityError",
    "PoolStats",
    "Region",
    "VmmPool",
    "static_capacity_bytes",
]
