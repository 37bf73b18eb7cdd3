"""Named device profiles: total memory per device and the VMM page size.

Totals are what the device reports as its total memory (the figure the engine sizes from), not
the marketing capacity:

| profile | total bytes | where the number comes from |
|---|---|---|
| ``ascend-910b-64g`` | 68,719,476,736 (64 GiB) | Ascend 910B, 64 GiB HBM (``npu-smi``: 65,536 MB) |
| ``ascend-910b-32g`` | 34,359,738,368 (32 GiB) | Ascend 910B, 32 GiB HBM |
| ``h200`` | 150,109,945,856 (143,156 MiB = 139.80 GiB) | torch on an H200 prints ``total_memory=143156MB`` (MiB); OOM messages say "total capacity of 139.80 GiB". ``nvidia-smi`` shows 143,771 MiB; the card is sold as 141 GB |
| ``h100-80g`` | 85,027,979,264 (81,089 MiB = 79.19 GiB) | torch on an H100 80GB HBM3 prints ``total_memory=81089MB`` |
| ``a100-80g`` | 84,987,084,800 (81,050 MiB = 79.15 GiB) | OOM messages on A100 80GB: "total capacity of 79.15 GiB" |
| ``a100-40g`` | 42,505,076,736 (40,536 MiB = 39.59 GiB) | ``total_memory=40536MB`` on A100-SXM4-40GB |
| ``host`` | this machine's ``MemAvailable`` | ``/proc/meminfo`` at the time of the call |

Totals vary by a few MiB between driver versions; pass ``--device-memory`` for your device's
exact figure. Every profile uses 2 MiB pages (the VMM granularity of ACL, CUDA and the host
driver).
"""

from __future__ import annotations

from dataclasses import dataclass

from xllm_vmm.config.values import MAX_MEMORY_BYTES  # noqa: F401  (1 PiB: its one home)
from xllm_vmm.models.errors import ModelConfigError

MiB = 1024 * 1024
GiB = 1024 * MiB
PAGE_BYTES = 2 * MiB


class DeviceError(ModelConfigError):
    """An unknown device profile or an impossible memory size."""


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    total_bytes: int  # per device
    page_bytes: int = PAGE_BYTES
    description: str = ""


PROFILES: dict[str, DeviceProfile] = {
    p.name: p for p in (
        DeviceProfile("ascend-910b-64g", 64 * GiB, description="Ascend 910B, 64 GiB HBM"),
        DeviceProfile("ascend-910b-32g", 32 * GiB, description="Ascend 910B, 32 GiB HBM"),
        DeviceProfile("h200", 143_156 * MiB,
                      description="NVIDIA H200 141 GB (torch total_memory 143,156 MiB)"),
        DeviceProfile("h100-80g", 81_089 * MiB,
                      description="NVIDIA H100 80GB HBM3 (torch total_memory 81,089 MiB)"),
        DeviceProfile("a100-80g", 81_050 * MiB,
                      description="NVIDIA A100 80GB (torch total capacity 79.15 GiB)"),
        DeviceProfile("a100-40g", 40_536 * MiB,
                      description="NVIDIA A100-SXM4-40GB (torch total_memory 40,536 MiB)"),
    )
}


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """``MemAvailable`` of this machine in bytes."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as exc:
        raise DeviceError(f"cannot read {meminfo}: {exc.strerror or exc}",
                          hint="pass --device-memory / --host-memory explicitly") from exc
    raise DeviceError(f"{meminfo} has no MemAvailable line",
                      hint="pass --device-memory / --host-memory explicitly")


def profile_names() -> list[str]:
    return [*PROFILES, "host"]


def get_profile(name: str) -> DeviceProfile:
    """The profile called ``name`` (case-insensitive); ``host`` reads ``MemAvailable`` now."""
    key = name.strip().lower()
    if key == "host":
        return DeviceProfile("host", mem_available(), description="this machine's MemAvailable")
    if key in PROFILES:
        return PROFILES[key]
    import difflib

    close = difflib.get_close_matches(key, profile_names(), n=3, cutoff=0.4)
    hint = (f"did you mean {', '.join(close)}? " if close else "") + \
        f"known profiles: {', '.join(profile_names())}; or give --device-memory in bytes"
    raise DeviceError(f"unknown device profile {name!r}", hint=hint)


def parse_bytes(text: str | int, *, what: str) -> int:
    """``"64GiB"``, ``"80GB"``, ``"1073741824"``, ``"1.5GiB"`` -> bytes (an int >= 0).

    The same parser as byte-sized flags (:func:`xllm_vmm.config.values.parse_size`), so a size
    means the same in ``plan``'s options and in the flags: binary units (``GiB``, and the bare
    letters ``K``/``M``/``G``/``T``/``P`` as in gflags sizes) are powers of 1024, decimal units
    (``GB``) powers of 1000."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        from xllm_vmm.config.values import parse_size

        try:
            value = parse_size(str(text).replace("_", ""))
        except ValueError:
            raise DeviceError(f"{what} {text!r} is not a size",
                              hint="give bytes, or a number with a unit: 64GiB, 80GB, "
                                   "512MiB") from None
    if value < 0:
        raise DeviceError(f"{what} must not be negative, got {value}", hint="give a size >= 0")
    return value
