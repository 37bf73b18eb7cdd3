"""Where a sleep and a wakeup spend their time: every report names its phases
(:mod:`xllm_vmm.weights.phases`), the phases add up to the report's seconds, and the ones that
ran are there (unmap/release on a sleep that frees pages, commit/map/copy on a wakeup from the
host copy, reload on a deep wakeup, tenants through the controller). No speed is asserted."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.weights.conftest import (PAGE, random_tensors, save_checkpoint)  # noqa: E402
from xllm_vmm.weights import SleepController, load_weights  # noqa: E402
from xllm_vmm.weights.phases import SLEEP_PHASES, WAKE_PHASES, PhaseClock  # noqa: E402


def _adds_up(report, names) -> None:
    assert set(report.phases) <= set(names), report.phases
    assert all(v >= 0 for v in report.phases.values()), report.phases
    assert sum(report.phases.values()) == pytest.approx(report.seconds, rel=1e-6, abs=1e-9)


def test_phase_clock_adds_up_and_clamps():
    clock = PhaseClock()
    clock.add("unmap", 0.25)
    clock.add("unmap", 0.25)
    clock.add("release", -1.0)  # a clock difference below 0 counts as 0
    out = clock.finish(2.0)
    assert out == {"unmap": 0.5, "release": 0.0, "other": 1.5}
    assert PhaseClock().finish(0.0) == {"other": 0.0}
    with clock.phase("copy"):
        pass
    assert clock.seconds["copy"] >= 0


def test_sleep_and_wakeup_report_their_phases(tmp_path, stack):
    model = save_checkpoint(tmp_path / "m", random_tensors("float32", hidden=128), shards=2)
    d, pool = stack(arena_bytes=32 * PAGE)
    w = load_weights(model, pool=pool)
    light = w.sleep(1)
    _adds_up(light, SLEEP_PHASES)
    assert {"unmap", "release", "other"} <= set(light.phases)
    assert "host_free" not in light.phases  # the host copy stays
    wake = w.wake_up()
    assert wake.source == "host_copy"
    _adds_up(wake, WAKE_PHASES)
    assert {"commit", "map", "copy"} <= set(wake.phases) and "reload" not in wake.phases
    deep = w.sleep(2)
    _adds_up(deep, SLEEP_PHASES)
    assert "host_free" in deep.phases
    reload = w.wake_up()
    assert reload.source == "checkpoint"
    _adds_up(reload, WAKE_PHASES)
    assert {"check", "commit", "map", "reload"} <= set(reload.phases)
    assert "copy" not in reload.phases
    # no-ops report only bookkeeping
    assert set(w.wake_up().phases) == {"other"}
    fork = w.fork()
    shared = w.sleep(1)  # the fork keeps the pages mapped: nothing is unmapped
    assert shared.bytes_freed == 0 and "unmap" not in shared.phases
    fork.close()
    w.close()


def test_controller_adds_the_tenants_phase(tmp_path, stack):
    model = save_checkpoint(tmp_path / "m", random_tensors("float32", hidden=64))
    d, pool = stack(arena_bytes=32 * PAGE)
    w = load_weights(model, pool=pool)

    class Tenant:
        def sleep(self) -> int:
            return 0

        def wake_up(self) -> None:
            pass

    ctl = SleepController(w, [Tenant()])
    rep = ctl.sleep(1)
    _adds_up(rep, SLEEP_PHASES)
    assert "tenants" in rep.phases and "unmap" in rep.phases
    wake = ctl.wake_up()
    _adds_up(wake, WAKE_PHASES)
    assert "tenants" in wake.phases and "copy" in wake.phases
    w.close()
