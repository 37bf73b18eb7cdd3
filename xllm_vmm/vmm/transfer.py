"""Asynchronous batched copies: one ordered worker thread per driver, like a device stream.

The worker runs the driver's blocking batched copy; native and ctypes foreign calls release the
GIL, so Python threads keep running while bytes move. Transfers complete in submission order.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class FutureTransfer:
    """A :class:`~xllm_vmm.vmm.driver.Transfer` backed by a future of the copy worker."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the copy finished; re-raises its error. ``timeout`` in seconds raises
        ``TimeoutError`` when exceeded (the copy keeps running)."""
        self._future.result(timeout)


class CopyWorker:
    """One lazily started worker thread; ``thread_init`` runs first in that thread (device
    binding for ACL/CUDA)."""

    def __init__(self, name: str, thread_init: Callable[[], None] | None = None) -> None:
        self._name = name
        self._init = thread_init
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> FutureTransfer:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=self._name, initializer=self._init
                )
            return FutureTransfer(self._pool.submit(fn))

    def drain(self) -> None:
        """Waits for every transfer submitted so far (their errors stay with their Transfer)."""
        with self._lock:
            pool = self._pool
        if pool is not None:
            pool.submit(lambda: None).result()

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
