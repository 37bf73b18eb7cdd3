"""Huge-page backing of the host driver's memfd: what the machine allows, and which one to use.

The host driver's handles are 2 MiB; what backs them is a kernel setting:

* ``"hugetlb"``: a ``MFD_HUGETLB|MFD_HUGE_2MB`` memfd. Needs preallocated 2 MiB huge pages
  (``sysctl vm.nr_hugepages=N``); its memory is *not* in ``MemAvailable`` or ``Shmem`` but in
  ``HugePages_Free`` (the driver counts its handles against the free huge pages).
* ``"thp"``: shmem transparent huge pages on an ordinary memfd (handles are committed through a
  ``MADV_HUGEPAGE`` mapping). Needs ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` =
  ``advise`` (or ``always``/``within_size``/``force``); a 2 MiB page the kernel cannot find is
  4 KiB pages instead (``ShmemHugePages`` in ``/proc/meminfo`` shows what it got).
* ``"off"``: 4 KiB shmem pages (the fresh-machine default).
* ``"auto"``: hugetlb when the free huge pages hold what the driver may take, else thp when
  shmem THP is allowed, else off.

Huge pages matter for releasing memory (a light sleep): the kernel frees one 2 MiB page instead
of 512 4 KiB pages per handle (measured by ``bench map``'s ``release_ms_per_gib_*``).
The choice is :func:`resolve`; the environment variable :data:`ENV` selects it where the caller
passes none. No torch, no native code.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path
from typing import Callable

from xllm_vmm.vmm.driver import MemInfo

#: environment variable choosing the backing when the caller passes none
ENV = "XLLM_VMM_HOST_HUGEPAGES"
MODES = ("auto", "hugetlb", "thp", "off")
HUGE_PAGE = 2 * 1024 * 1024
HUGETLB_DIR = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
#: shmem_enabled values under which a MADV_HUGEPAGE mapping gets huge pages
THP_SHMEM_ALLOWING = ("always", "within_size", "advise", "force")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _selected(text: str | None) -> str | None:
    """The bracketed choice of a sysfs selector (``always [advise] never`` → ``advise``)."""
    if text is None:
        return None
    if "[" in text:
        return text.split("[", 1)[1].split("]", 1)[0]
    return text


def hugetlb_memory(directory: Path = HUGETLB_DIR) -> MemInfo:
    """2 MiB hugetlb pages in bytes: ``free`` = free − reserved pages (what a new memfd may
    fallocate), ``total`` = the pool (``vm.nr_hugepages`` for the default size). Zero where
    the kernel has no 2 MiB hugetlb pages."""
    def pages(name: str) -> int:
        text = _read(directory / name)
        try:
            return int(text) if text is not None else 0
        except ValueError:
            return 0

    free = max(0, pages("free_hugepages") - pages("resv_hugepages"))
    return MemInfo(free=free * HUGE_PAGE, total=pages("nr_hugepages") * HUGE_PAGE)


def thp_shmem_setting(directory: Path = THP_DIR) -> str:
    """The shmem THP policy for 2 MiB pages: the per-size knob
    (``hugepages-2048kB/shmem_enabled``) unless it says ``inherit``, else the global
    ``shmem_enabled``; ``"never"`` where the kernel has no THP."""
    per_size = _selected(_read(directory / "hugepages-2048kB" / "shmem_enabled"))
    if per_size and per_size != "inherit":
        return per_size
    return _selected(_read(directory / "shmem_enabled")) or "never"


def thp_shmem_allowed(directory: Path = THP_DIR) -> bool:
    """True when a ``MADV_HUGEPAGE`` shmem mapping gets 2 MiB pages (see the module)."""
    return thp_shmem_setting(directory) in THP_SHMEM_ALLOWING


def check_mode(mode: str, where: str = "hugepages") -> str:
    """``mode`` lower-cased, or ValueError naming ``where`` and the choices."""
    value = str(mode).strip().lower()
    if value not in MODES:
        raise ValueError(f"{where}={mode!r} is not a huge-page backing; choose one of "
                         f"{', '.join(MODES)}")
    return value


def requested_mode(mode: str | None) -> tuple[str, str]:
    """``(mode, where)``: ``mode`` when given, else ``$XLLM_VMM_HOST_HUGEPAGES``, else auto;
    ``where`` names where it came from (for error messages)."""
    if mode is not None:
        return check_mode(mode, "hugepages"), "hugepages"
    env = os.environ.get(ENV)
    if env is not None and env.strip():
        return check_mode(env, ENV), ENV
    return "auto", "default"


def resolve(mode: str, need_bytes: int, *, hugetlb: MemInfo | None = None,
            thp_allowed: bool | None = None) -> tuple[str, str]:
    """The backing to open — ``"hugetlb"``, ``"thp"`` or ``"off"`` — and why.

    ``need_bytes``: what the driver may take (its ``device_memory``, else its host capacity);
    ``auto`` picks hugetlb only when the free huge pages hold all of it (so auto never makes a
    driver smaller than 4 KiB pages would), else thp when allowed, else off. An explicit
    ``"hugetlb"`` / ``"thp"`` that the machine forbids raises ValueError saying which setting
    to change (``"hugetlb"`` needs at least one free huge page)."""
    mode = check_mode(mode)
    huge = hugetlb_memory() if hugetlb is None else hugetlb
    thp = thp_shmem_allowed() if thp_allowed is None else thp_allowed
    mib = 1024 * 1024
    if mode == "off":
        return "off", "4 KiB pages (hugepages=off)"
    if mode == "hugetlb":
        if huge.free < HUGE_PAGE:
            raise ValueError(
                "hugepages=hugetlb needs free 2 MiB huge pages, and this machine has "
                f"{huge.free // HUGE_PAGE} free of {huge.total // HUGE_PAGE}: set "
                "`sysctl vm.nr_hugepages=N` (N x 2 MiB for the pool), or choose hugepages=thp/off")
        return "hugetlb", f"hugetlb: {huge.free // mib} MiB of 2 MiB huge pages free"
    if mode == "thp":
        if not thp:
            raise ValueError(
                "hugepages=thp needs shmem transparent huge pages, and "
                f"{THP_DIR / 'shmem_enabled'} is {thp_shmem_setting()!r}: "
                "`echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled`, "
                "or choose hugepages=hugetlb/off")
        return "thp", f"thp: shmem_enabled={thp_shmem_setting()}"
    if need_bytes > 0 and huge.free >= need_bytes:
        return "hugetlb", (f"auto: hugetlb ({huge.free // mib} MiB of huge pages free, "
                           f"{need_bytes // mib} MiB needed)")
    if thp:
        return "thp", f"auto: thp (shmem_enabled={thp_shmem_setting()}; " \
                      f"{huge.free // mib} MiB of hugetlb pages free, {need_bytes // mib} MiB needed)"
    return "off", ("auto: 4 KiB pages (no free hugetlb pages for "
                   f"{need_bytes // mib} MiB, shmem_enabled={thp_shmem_setting()})")


#: the kernel settings that enable each huge-page backing
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
SHMEM_ENABLED = THP_DIR / "shmem_enabled"
#: one lock file for every process of this machine that changes those settings for a while
SETTINGS_LOCK = "/tmp/xllm-vmm-hugepage-settings.lock"


class SettingUnavailable(RuntimeError):
    """A kernel setting that cannot be changed here (not root, no such file, refused)."""


@contextlib.contextmanager
def machine_setting(path: Path, value: str | Callable[[str], str],
                    restore: Callable[[str, str], str] | None = None):
    """Sets the kernel setting ``path`` (``vm.nr_hugepages``, ``shmem_enabled``) to ``value``
    (or ``value(old)``) for the ``with`` block and restores the previous value after it, under
    an exclusive lock shared by every process using this function (benchmarks and tests that
    change huge-page settings do not undo each other). Raises :class:`SettingUnavailable` when
    the setting cannot be changed here (needs root). ``restore(old, current)``: the value to
    put back (default: ``old``), for a setting another program may change meanwhile."""
    if os.geteuid() != 0 or not path.exists():
        raise SettingUnavailable(f"{path} cannot be changed here (needs root and the kernel setting)")
    with _settings_lock():
        old = _selected(path.read_text().strip()) or ""
        new = value(old) if callable(value) else value
        try:
            path.write_text(new)
        except OSError as exc:
            raise SettingUnavailable(f"cannot write {new!r} to {path}: {exc}") from None
        try:
            yield old
        finally:
            path.write_text(restore(old, path.read_text().strip()) if restore else old)


_LOCAL = threading.RLock()
_depth = [0, None]  # nesting depth in this process, the locked file


@contextlib.contextmanager
def _settings_lock():
    """The machine-wide settings lock (``flock`` of :data:`SETTINGS_LOCK`), re-entrant within
    a process (one ``with`` may change several settings)."""
    with _LOCAL:
        if _depth[0] == 0:
            f = open(SETTINGS_LOCK, "a")
            fcntl.flock(f, fcntl.LOCK_EX)
            _depth[1] = f
        _depth[0] += 1
        try:
            yield
        finally:
            _depth[0] -= 1
            if _depth[0] == 0:
                f, _depth[1] = _depth[1], None
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()


def extra_hugetlb_pages(count: int):
    """``vm.nr_hugepages`` raised by ``count`` for the ``with`` block (see
    :func:`machine_setting`); yields the free 2 MiB pages then (the kernel may find fewer)."""
    @contextlib.contextmanager
    def ctx():
        # restored relatively: lowered by ``count`` again, whatever another program set meanwhile
        with machine_setting(NR_HUGEPAGES, lambda old: str(int(old or 0) + count),
                             lambda old, cur: str(max(int(old or 0), int(cur or 0) - count))):
            yield hugetlb_memory().free // HUGE_PAGE
    return ctx()


def shmem_thp_advise():
    """``shmem_enabled`` = ``advise`` for the ``with`` block (see :func:`machine_setting`)."""
    return machine_setting(SHMEM_ENABLED, "advise")
