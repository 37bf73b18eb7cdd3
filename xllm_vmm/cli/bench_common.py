"""What every ``xllm-vmm bench ...`` subcommand shares: the ``bench`` Typer group, the output
formats and the results table (units, targets, plain numbers), the one-line option checks and
exits, and opening the driver for ``--device``. The subcommands live in
:mod:`xllm_vmm.cli.bench`, :mod:`xllm_vmm.cli.bench_spec` and
:mod:`xllm_vmm.cli.bench_attention`, each importing this module."""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Callable, Optional, TypeVar

import typer

from xllm_vmm.cli.root import app

bench_app = typer.Typer(help="Benchmarks (ratios against a baseline measured in the same run).",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


#: The targets of docs/benchmarks.md, by result field: (comparison, value). The table says
#: whether each holds; JSON output is the bare results.
TARGETS: dict[str, tuple[str, float]] = {
    "batched_vs_raw_ratio": ("<=", 1.2), "python_overhead_us_per_page": ("<=", 1.0),
    "copy_vs_memcpy_ratio": (">=", 0.8), "alloc_vs_freelist_ratio": (">=", 0.6),
    "manager_cycle_vs_freelist_ratio": (">=", 0.6), "cost_growth_4096_vs_64": ("<=", 1.1),
    "batched_vs_coalesced_ratio": ("<=", 1.5), "restore_vs_memcpy_ratio": (">=", 0.8),
    "peak_footprint_ratio": ("<=", 1.1), "idle_footprint_ratio": ("<=", 1.15),
    "hash_vs_sha256_ratio": (">=", 2.0), "host_hit_rate_gain": (">", 0.0),
    "bytes_freed_per_eviction_ratio": (">", 1.0), "wakeup_vs_reload_ratio": ("<=", 0.5),
    "sleep_released_fraction": (">=", 0.99), "fork_extra_weight_bytes": ("<=", 0),
    "cycle_growth_bytes": ("<=", 0), "light_sleep_ms_per_gib": ("<=", 10.0),
    "vs_vllm_throughput_ratio": (">=", 1.0), "vs_vllm_ttft_ratio": ("<=", 1.0),
    "vs_vllm_tpot_ratio": ("<=", 1.0),
}

#: Units by field-name ending (the longest ending that matches wins).
_UNITS = (("_us_per_page", "µs/page"), ("_us_1k", "µs"), ("_us_1m", "µs"), ("_us", "µs"),
          ("_ms", "ms"), ("_seconds", "s"), ("_s", "s"), ("_bytes", "bytes"), ("_gbps", "GB/s"),
          ("_per_s", "/s"), ("_ratio", "×"), ("_fraction", "fraction"), ("_rate", "fraction"),
          ("_gain", "fraction"), ("_pct", "%"), ("_blocks", "blocks"), ("_pages", "pages"),
          ("_tokens", "tokens"))


def unit_of(field: str) -> str:
    """The unit of a result field from its name (``batched_us_per_page`` → ``µs/page``)."""
    for end, unit in _UNITS:
        if field.endswith(end):
            return unit
    return ""


def plain(value: Any) -> str:
    """A number as plain digits, never in exponent notation: integers with thousands
    separators, floats with four significant digits (``1,976,000``, ``0.0001234``)."""
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    digits = max(0, 3 - math.floor(math.log10(abs(value))))
    text = f"{value:,.{min(digits, 12)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def target_text(field: str, value: Any) -> tuple[str, str]:
    """(the target, whether it holds: ``yes``/``no``) of ``field``, or ``("", "")``."""
    if field not in TARGETS or isinstance(value, bool) or not isinstance(value, (int, float)):
        return "", ""
    op, goal = TARGETS[field]
    holds = {"<=": value <= goal, ">=": value >= goal, ">": value > goal, "<": value < goal}[op]
    shown = {"<=": "≤", ">=": "≥", ">": ">", "<": "<"}[op]
    return f"{shown} {goal:g}", "yes" if holds else "no"


def emit(title: str, results: dict[str, Any], fmt: OutputFormat) -> None:
    """Print one benchmark's results as a rich table (metric, value in plain numbers, unit,
    target and whether it holds) or as JSON on stdout."""
    if fmt is OutputFormat.json:
        typer.echo(json.dumps(results, indent=2, sort_keys=True, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("unit")
    table.add_column("target", no_wrap=True)
    table.add_column("holds")
    for key, value in results.items():
        goal, holds = target_text(key, value)
        table.add_row(key, plain(value), unit_of(key) if isinstance(value, (int, float))
                      and not isinstance(value, bool) else "", goal, holds)
    Console().print(table)


# Every option is range-checked by a subcommand (``check``) or by the benchmark before anything
# is allocated; a size that does not fit in memory, a driver error or a failed run is a
# one-line error, never a traceback: exit code 2 for a bad option (or a size that does not
# fit), 1 for a failed run.

_T = TypeVar("_T")


def fail(code: int, message: str) -> typer.Exit:
    """Prints ``error: message`` on stderr; returns the exit to raise with ``code``."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def check(option: str, value: float, low: float, high: float) -> None:
    """Exit 2 unless ``low <= value <= high`` and finite (typer's own ranges let NaN pass)."""
    from xllm_vmm.bench.limits import check_range

    try:
        check_range(option, value, low, high)
    except ValueError as exc:
        raise fail(2, str(exc)) from None


def run_bench(label: str, fn: Callable[[], _T]) -> _T:
    """Runs a benchmark: an option the benchmark refuses (ValueError, incl. a size that does
    not fit) exits 2; a driver error or a failed run exits 1; both with one line."""
    from xllm_vmm.vmm import VmmError

    try:
        return fn()
    except ValueError as exc:
        raise fail(2, f"{label}: {exc}") from None
    except (VmmError, RuntimeError, MemoryError, OSError, ImportError) as exc:
        raise fail(1, f"{label} failed: {exc}") from None


def open_bench_driver(device: str, device_index: int, acl_library: Optional[str]):
    """Opens the driver for ``--device``, turning an unavailable device into a clear exit."""
    from xllm_vmm.vmm import DRIVER_KINDS, VmmError, open_driver

    if device.lower() not in DRIVER_KINDS:
        raise fail(2, f"--device {device!r} is not one of {', '.join(sorted(DRIVER_KINDS))}")
    try:
        return open_driver(device, device_index=device_index, library=acl_library)
    except VmmError as exc:
        raise fail(1, f"--device {device}: {exc}") from None


DEVICE_HELP = "Driver: cpu/host (memfd+mmap), npu/acl, cuda."
ACL_HELP = "ACL library for --device npu ('emulation' = the bundled emulation); default $XLLM_VMM_ACL_LIBRARY or libascendcl.so."
MAX_REPEATS = 100


def run_on_driver(label: str, title: str, fmt: OutputFormat, device: str, device_index: int,
                  acl_library: Optional[str], bench: Callable[[Any], dict[str, Any]]) -> None:
    """Opens the driver for ``--device``, runs ``bench(driver)`` as :func:`run_bench` does,
    closes the driver whatever happened and prints the results under ``title``."""
    driver = open_bench_driver(device, device_index, acl_library)
    try:
        results = run_bench(label, lambda: bench(driver))
    finally:
        driver.close()
    emit(title, results, fmt)
