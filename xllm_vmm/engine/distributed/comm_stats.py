"""Time and bytes spent in collectives by this process (the fields ``bench serve`` reports per rank).

``COMM.add(kind, seconds, nbytes)`` is called around every collective of the model
(``TensorParallel.all_reduce``, the vocabulary gather); :meth:`CommStats.snapshot` is what
the runtime differences per step. World size 1 never calls it. Units: seconds, bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CommStats:
    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
            self.nbytes[kind] = self.nbytes.get(kind, 0) + nbytes

    def snapshot(self) -> dict[str, float]:
        """``{kind_calls, kind_seconds, kind_bytes}`` for every kind seen."""
        with self._lock:
            out: dict[str, float] = {}
            for k in self.calls:
                out[f"{k}_calls"] = self.calls[k]
                out[f"{k}_seconds"] = self.seconds[k]
                out[f"{k}_bytes"] = self.nbytes[k]
            return out


COMM = CommStats()
"""This process's collectives."""
