"""Host memory as the kernel and the cgroup see it (bytes). No torch, no native code."""

from __future__ import annotations

from pathlib import Path

from xllm_vmm.vmm.driver import MemInfo

_UNLIMITED = 1 << 62


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("max", ""):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` as a dict of bytes (``MemTotal``, ``MemAvailable``, ``Shmem``, ...)."""
    out: dict[str, int] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        out[name.strip()] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    return out


def cgroup_limit(root: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """``(limit, usage)`` in bytes of this process's memory cgroup, or None when unlimited.
    Reads cgroup v2 (``memory.max``/``memory.current``) or v1 (``memory.limit_in_bytes``/
    ``memory.usage_in_bytes``) of the cgroup named in ``/proc/self/cgroup``."""
    base = Path(root)
    rel = ""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and (parts[0] == "0" or "memory" in parts[1].split(",")):
                rel = parts[2].lstrip("/")
                if parts[0] != "0":
                    base = base / "memory"
                break
    except OSError:
        pass
    for directory in (base / rel, base):
        limit = _read_int(directory / "memory.max")
        if limit is not None:
            usage = _read_int(directory / "memory.current") or 0
            return limit, usage
        limit = _read_int(directory / "memory.limit_in_bytes")
        if limit is not None:
            usage = _read_int(directory / "memory.usage_in_bytes") or 0
            return limit, usage
    return None


def host_memory() -> MemInfo:
    """Free and total host memory in bytes: the smaller of the kernel's view (``MemAvailable``,
    ``MemTotal``) and the cgroup's (limit − usage, limit)."""
    info = meminfo()
    total = info.get("MemTotal", 0)
    free = info.get("MemAvailable", info.get("MemFree", 0))
    cg = cgroup_limit()
    if cg is not None:
        limit, usage = cg
        total = min(total, limit) if total else limit
        free = min(free, max(0, limit - usage))
    return MemInfo(free=free, total=total)
