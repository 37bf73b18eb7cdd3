"""Sizes a benchmark may ask for: checked before anything is allocated, so that a size that
does not fit is a clear refusal naming the option and the numbers, never the kernel's OOM
killer or a driver traceback halfway through."""

from __future__ import annotations

import math

_GiB = 1024 ** 3


class BenchTooLarge(ValueError):
    """A benchmark option asks for more memory than the driver or the host can give now."""


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def _gib(n: float) -> str:
    return f"{n / _GiB:.2f} GiB"


def check_fits(need: int, free: int, *, option: str, value: float, what: str,
               most: float | None = None, where: str = "the driver") -> None:
    """Raises :class:`BenchTooLarge` when ``need`` bytes exceed ``free`` (what ``where`` can
    commit now). ``most``: the largest value of ``option`` that would fit, when known."""
    if need <= free:
        return
    hint = (f"use {option} {_num(most)} or less" if most is not None and most > 0
            else "free memory first")
    raise BenchTooLarge(f"{option} {_num(value)} needs {need} bytes ({_gib(need)}: {what}) but "
                        f"{where} can commit {max(0, free)} bytes ({_gib(max(0, free))}) now; "
                        f"{hint}")


def host_headroom() -> int:
    """Host bytes a benchmark may commit outside a driver: available host memory (cgroup or
    MemAvailable) less the host driver's safety margin."""
    from xllm_vmm.vmm.host import default_host_margin
    from xllm_vmm.vmm.sysmem import host_memory

    info = host_memory()
    return info.free - default_host_margin(info.total)


def check_range(option: str, value: float, low: float, high: float) -> None:
    """Raises ValueError unless ``low <= value <= high`` and ``value`` is a finite number."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
        kind = "an integer" if isinstance(value, int) else "a finite number"
        raise ValueError(f"{option} must be {kind} in [{_num(low)}, {_num(high)}], got {value}")
