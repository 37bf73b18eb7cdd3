"""Asynchronous batched copies: one ordered worker thread per driver, like a device stream.

The worker runs the driver's blocking batched copy; native and ctypes foreign calls release the
GIL, so Python threads keep running while bytes move. Transfers complete in submission order.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
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
        self._last: Future | None = None  # the latest submitted transfer
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> FutureTransfer:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=self._name, initializer=self._init
                )
            self._last = self._pool.submit(fn)
            return FutureTransfer(self._last)

    def drain(self) -> None:
        """Waits for every transfer submitted so far (their errors stay with their Transfer).
        One worker runs them in order, so that is the latest one; when it is done already
        this returns at once (no round trip through the worker thread: a sleep's sync)."""
        with self._lock:
            last = self._last
        if last is not None and not last.done():
            wait([last])

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool, self._last = self._pool, None, None
        if pool is not None:
            pool.shutdown(wait=True)
