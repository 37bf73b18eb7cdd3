"""The engine thread's schedstat clock (:mod:`xllm_vmm.server.sched_clock`): it reads the
thread that made it, its CPU seconds follow ``time.thread_time`` and grow while that thread
computes and not while another thread does, and it is None (not an error) without schedstat."""

from __future__ import annotations

import os
import threading
import time

import pytest

from xllm_vmm.server.sched_clock import SchedClock

needs_schedstat = pytest.mark.skipif(not os.path.exists(SchedClock.PATH),
                                     reason="no /proc/thread-self/schedstat on this system")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@needs_schedstat
def test_it_measures_its_own_thread():
    clock = SchedClock()
    try:
        a = clock.read()
        t0 = time.thread_time()
        _spin(0.05)
        b = clock.read()
        cpu = time.thread_time() - t0
        assert a is not None and b is not None
        assert b[0] - a[0] == pytest.approx(cpu, abs=0.01)  # on a core: this thread's CPU
        assert b[1] >= a[1] >= 0  # run-queue waits only grow
        # another thread computing does not move this thread's figures
        th = threading.Thread(target=_spin, args=(0.05,))
        th.start()
        th.join()
        c = clock.read()
        assert c[0] - b[0] < 0.01
    finally:
        clock.close()
    assert clock.read() is None  # closed: no figures, no error


def test_without_schedstat_it_reads_none(monkeypatch):
    monkeypatch.setattr(SchedClock, "PATH", "/proc/thread-self/no-such-file")
    clock = SchedClock()
    assert clock.read() is None
    clock.close()
