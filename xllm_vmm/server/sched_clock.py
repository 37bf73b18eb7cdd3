"""The calling thread's time on a core and waiting for one, from Linux's schedstat.

``/proc/thread-self/schedstat`` holds three numbers for the thread that opens it: nanoseconds
it ran on a CPU, nanoseconds it was runnable but waited on a run queue, and the number of
times it was scheduled. The server's engine thread reads it around every step, so that a
step's wall time splits into computing (on a core), waiting for a core (the machine's other
threads and processes had them: CPU contention) and the rest — waiting while not runnable (the
interpreter lock, its compute threads, a futex): ``xllm_vmm_engine_thread_step_cpu_seconds``,
``xllm_vmm_engine_thread_runqueue_seconds`` and ``xllm_vmm_engine_step_seconds_sum`` minus both.

Elsewhere (no schedstat: another OS, a kernel without ``CONFIG_SCHEDSTATS``) :meth:`read`
returns None and the counters are not exported.
"""

from __future__ import annotations

import os


class SchedClock:
    """The schedstat of the thread that created it; one file descriptor, read with ``pread``
    (a few microseconds a read). Not thread-safe: read it from the thread that made it."""

    PATH = "/proc/thread-self/schedstat"

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open(self.PATH, os.O_RDONLY)
        except OSError:
            self._fd = None
        if self._fd is not None and self.read() is None:
            self.close()

    def read(self) -> tuple[float, float] | None:
        """(seconds on a CPU, seconds runnable on a run queue) of the thread so far, or None
        when schedstat is not available."""
        if self._fd is None:
            return None
        try:
            fields = os.pread(self._fd, 96, 0).split()
            return int(fields[0]) * 1e-9, int(fields[1]) * 1e-9
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            finally:
                self._fd = None

    def __del__(self) -> None:  # pragma: no cover - the engine loop closes it
        self.close()
