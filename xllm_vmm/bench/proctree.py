"""The process tree of a benchmarked server, from ``/proc``: its live processes, their CPU
seconds and resident bytes, signalling all of them at once (pause and resume a server between
measurements), and the machine's own CPU and memory counters. Every bench that starts a server
process (``bench serve``, its vLLM comparison, ``bench engine``'s vLLM runner) measures it
through these. Linux only: where ``/proc`` cannot be read the figures are None (or ``[]``).
Nothing here imports torch."""

from __future__ import annotations

import os
from typing import Optional


def process_children() -> Optional[dict[int, list[int]]]:
    """parent pid -> child pids of every process (``/proc``); None when it cannot be read."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rpartition(b")")[2].split()[1])  # after "(comm)": state ppid ...
        children.setdefault(ppid, []).append(int(name))
    return children


def tree_pids(pid: int) -> list[int]:
    """Process ``pid`` and its live descendants (``/proc``), parents first; ``[]`` when
    ``/proc`` cannot be read."""
    children = process_children()
    if children is None:
        return []
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if os.path.exists(f"/proc/{p}"):
            out.append(p)
        todo.extend(children.get(p, []))
    return out


def signal_tree(pid: int, sig: int) -> int:
    """Sends ``sig`` to ``pid`` and every live descendant; returns how many received it
    (a process that has gone meanwhile is skipped)."""
    n = 0
    for p in tree_pids(pid):
        try:
            os.kill(p, sig)
            n += 1
        except OSError:
            pass
    return n


def tree_cpu_seconds(pid: int) -> Optional[float]:
    """CPU seconds (user + system, every thread) used so far by process ``pid`` and its live
    descendants (``/proc/PID/stat`` utime + stime); None when ``pid`` is gone or ``/proc``
    cannot be read. The difference over an interval is what the tree ran meanwhile."""
    children = process_children()
    if children is None:
        return None
    tick = float(os.sysconf("SC_CLK_TCK"))
    total, found, todo = 0.0, False, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat", "rb") as fh:
                fields = fh.read().rpartition(b")")[2].split()
        except OSError:
            continue
        found = True
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
        todo.extend(children.get(p, []))
    return total if found else None


def tree_rss_bytes(pid: int) -> Optional[int]:
    """Resident bytes of process ``pid`` and all its descendants (``VmRSS`` of each, from
    ``/proc``, summed); None when ``pid`` is gone or ``/proc`` cannot be read (not Linux)."""
    children = process_children()
    if children is None:
        return None
    total, found, todo = 0, False, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
            found = True
        except OSError:
            continue
        todo.extend(children.get(p, []))
    return total if found else None


def rss_of(pids: list[int]) -> Optional[int]:
    """Resident bytes of the processes ``pids`` (``VmRSS`` of each that is still alive,
    summed); None when none is."""
    total, found = 0, False
    for p in pids:
        try:
            with open(f"/proc/{p}/status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        found = True
                        break
        except OSError:
            continue
    return total if found else None


def machine_cpu_seconds() -> Optional[tuple[float, float]]:
    """``(busy, steal)`` CPU seconds of every CPU since boot from ``/proc/stat`` (busy: user,
    nice, system, irq, softirq; steal: time the hypervisor ran something else); None when it
    cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    tick = float(os.sysconf("SC_CLK_TCK"))
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / tick, f[7] / tick


def host_memory_used_bytes() -> Optional[int]:
    """The machine's memory in use (``MemTotal - MemAvailable`` of ``/proc/meminfo``), None
    where it cannot be read (not Linux)."""
    from xllm_vmm.vmm.sysmem import meminfo

    info = meminfo()
    if "MemTotal" not in info or "MemAvailable" not in info:
        return None
    return info["MemTotal"] - info["MemAvailable"]
