"""Configuration checks that need the sizing plan, shared by ``check-config`` and ``plan``.

:func:`check_sizing` runs every rule of :mod:`xllm_vmm.config.rules` and then decides the sizing
rules with the planner:

- HK-07 (warning in ``check-config`` and ``plan``): every worker preallocates its own host KV
  pool (HK-06, sized from the device KV capacity the plan computes for the device's memory);
  together they must fit the host's available memory. Decided when the model is reachable, the
  device memory is known (``--device-memory`` or a device profile) and the host memory is known
  (``--host-memory``, else this host's available memory); otherwise listed as not checked, with
  the reason. The finding's message says where the host memory figure came from.
- EL-08: ``vmm_memory_reserve_bytes`` against the device memory, wherever that came from.

The HK-07 finding and the plan's HK-07 reason are one: the same text, from
:func:`xllm_vmm.planner.sizing.host_pool_reason`. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from xllm_vmm.config.findings import Finding
from xllm_vmm.config.rules import Report, check, find_model
from xllm_vmm.models import ModelConfigError
from xllm_vmm.planner.devices import DeviceError, get_profile

if TYPE_CHECKING:  # pragma: no cover
    from xllm_vmm.planner.sizing import Plan

#: The flags an HK-07 finding names.
HK07_FLAGS = ("max_cache_size", "host_blocks_factor", "nnodes", "devices")


@dataclass(frozen=True)
class Memory:
    """A memory size in bytes and how it is known (``--device-memory``, ``device profile h200``,
    ``this host's available memory``), for messages."""

    bytes: int
    source: str


def device_memory(option: int | None = None, profile: str | None = None) -> Memory | None:
    """One device's total memory: ``option`` (``--device-memory``) wins over ``profile``
    (``--device``); None when neither is given. Raises :class:`DeviceError` for an unknown
    profile, a non-positive size or one above 1 PiB."""
    if option is not None:
        if option <= 0:
            raise DeviceError(f"--device-memory must be positive, got {option}",
                              hint="give the total memory of one device, e.g. 64GiB")
        _at_most(option, "--device-memory", "the total memory of one device, e.g. 64GiB")
        return Memory(option, "--device-memory")
    if profile:
        p = get_profile(profile)
        return Memory(p.total_bytes, f"device profile {p.name}")
    return None


def _at_most(value: int, what: str, give: str) -> None:
    from xllm_vmm.planner.devices import MAX_MEMORY_BYTES

    if value > MAX_MEMORY_BYTES:
        raise DeviceError(f"{what} {value:,} bytes is more than 1 PiB: no machine has that",
                          hint=f"give {give}")


def host_memory(option: int | None = None) -> Memory | None:
    """Host memory available for the host KV pools: ``option`` (``--host-memory``), else this
    host's available memory (``MemAvailable``, capped by the cgroup limit; the figure serving
    checks HK-07 against); None when it cannot be read. Raises :class:`DeviceError` for an
    ``option`` above 1 PiB."""
    if option is not None:
        _at_most(option, "--host-memory", "the host RAM available for the host KV pools, "
                 "e.g. 512GiB")
        return Memory(option, "--host-memory")
    from xllm_vmm.vmm.sysmem import host_memory as read_host_memory

    free = read_host_memory().free
    if free <= 0:
        return None
    return Memory(free, "this host's available memory (MemAvailable, cgroup limit); "
                        "--host-memory overrides it")


@dataclass
class Checked:
    """One configuration after :func:`check_sizing`: the rule report, the model (None when
    unreachable), the separate draft model (if read) and the plan (when one was made)."""

    report: Report
    spec: Any = None
    draft: Any = None
    plan: "Plan | None" = None


HostMemory = "Memory | Callable[[], Memory | None] | None"


def check_sizing(cfg: Any, *, device: Memory | None = None, host: HostMemory = None,
                 spec: Any = None, model_reason: str | None = None, always_plan: bool = False,
                 **plan_options: Any) -> Checked:
    """Every rule on ``cfg`` (a resolved configuration), with HK-07 decided by the planner
    (:func:`decide_sizing`).

    ``spec``: the model when the caller already has it (else it is looked up from
    ``cfg["model"]``). ``always_plan``: make the plan even when no sizing rule needs it (``plan``
    does; it then raises :class:`ModelConfigError` for a draft model that cannot be read or
    inputs that cannot be planned). ``plan_options`` go to
    :func:`~xllm_vmm.planner.from_config.inputs_from_config` (``context_len``, ``workers``,
    ``device_name``, ``execution_peak_bytes``, ...).
    """
    if spec is None:
        spec, model_reason = find_model(cfg)
    report = check(cfg, spec, model_reason=model_reason,
                   device_memory=device.bytes if device else None)
    return decide_sizing(report, cfg, spec, model_reason, device=device, host=host,
                         always_plan=always_plan, **plan_options)


def decide_sizing(report: Report, cfg: Any, spec: Any, model_reason: str | None, *,
                  device: Memory | None, host: HostMemory, always_plan: bool = False,
                  **plan_options: Any) -> Checked:
    """Decide HK-07 in ``report`` (made by :func:`xllm_vmm.config.rules.check` on ``cfg`` with
    ``spec``): replace its not-checked entry by the finding (when the host pools do not fit),
    by nothing (when they fit), or by the reason it cannot be decided."""
    out = Checked(report, spec)
    hk07 = "HK-07" in report.not_checked
    if not (hk07 or always_plan):
        return out
    if callable(host):  # read the host's memory only when a plan needs it
        host = host()
    why = None
    if spec is None:
        why = model_reason or "the model was not read"
    elif device is None:
        why = ("the device memory is not known: pass --device-memory or --device PROFILE (the "
               "device KV capacity, and so each worker's host pool, depends on it)")
    elif host is None:
        why = "this host's available memory could not be read: pass --host-memory"
    if spec is not None and (why is None or always_plan):
        from xllm_vmm.planner.from_config import draft_from_config, inputs_from_config
        from xllm_vmm.planner.sizing import make_plan

        try:
            out.draft = draft_from_config(report.resolved)
            out.plan = make_plan(spec, inputs_from_config(
                report.resolved, device_memory_bytes=device.bytes if device else None,
                host_memory_bytes=host.bytes if host else None,
                host_memory_source=host.source if host else None, **plan_options),
                draft=out.draft)
        except ModelConfigError as err:
            if always_plan:
                raise
            why = f"the configuration cannot be sized: {err}"
    if not hk07:
        return out
    plan = out.plan
    if why is None and plan is not None and not plan.workers:
        errs = [r.message for r in plan.reasons if r.severity == "error"]
        why = "the configuration cannot be sized: " + ("; ".join(errs) or "no plan")
    if why is not None:
        report.not_checked["HK-07"] = why
        return out
    del report.not_checked["HK-07"]
    reason = next((r for r in plan.reasons if r.code == "HK-07"), None)
    if reason is not None:
        report.findings.append(Finding(
            "HK-07", "warning", f"HK-07: {reason.message}",
            flags={n: cfg[n] for n in HK07_FLAGS},
            sources={n: cfg.provenance(n) for n in HK07_FLAGS}, hint=reason.hint,
            input=getattr(cfg, "label", "")))
    return out
