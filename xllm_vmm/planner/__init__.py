"""Dry-run sizing: what a configuration does with device and host memory, before a device or a
weight file is touched. Pure functions, no torch.

    from xllm_vmm.planner import PlanInputs, make_plan, plan_to_dict
    plan = make_plan(load_model_spec("Qwen/Qwen3-8B"), PlanInputs(workers=1))
"""

from xllm_vmm.planner.devices import PROFILES, DeviceError, DeviceProfile, get_profile, parse_bytes
from xllm_vmm.planner.inputs import DEFAULT_RUNTIME_OVERHEAD_BYTES, MODES, PlanInputs

_SIZING = ("SCHEMA_VERSION", "Plan", "WorkerPlan", "execution_peak", "make_plan")


def __getattr__(name: str):
    # The sizing module is imported on first use: check-config imports planner.checks to decide
    # HK-07 only when a configuration needs it (start-up time).
    if name in _SIZING:
        from xllm_vmm.planner import sizing

        return getattr(sizing, name)
    raise AttributeError(f"module 'xllm_vmm.planner' has no attribute {name!r}")

__all__ = [
    "DEFAULT_RUNTIME_OVERHEAD_BYTES", "DeviceError", "DeviceProfile", "MODES", "PROFILES",
    "Plan", "PlanInputs", "SCHEMA_VERSION", "WorkerPlan", "execution_peak", "get_profile",
    "make_plan", "parse_bytes",
]
