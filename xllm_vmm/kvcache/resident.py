"""Per-sequence slots kept outside the page pool: hybrid models' conv and recurrent state
(HY-01) and MTP embedding slots (AD-03).

Their memory is reserved once, ``capacity × bytes_per_seq`` bytes, separately from the
physical KV page pool's budget; a running sequence holds one slot of each kind its model needs.
Admission (AD-03) refuses a new sequence when any kind has no slot left.
"""

from __future__ import annotations

import heapq

from xllm_vmm.models.spec import ResidentState

__all__ = ["SequenceSlots"]


class SequenceSlots:
    """``capacity`` numbered slots of ``bytes_per_seq`` bytes each; the lowest free slot is
    handed out first."""

    def __init__(self, name: str, capacity: int, bytes_per_seq: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"{name}: capacity must be >= 0 sequence slots, got {capacity}")
        if bytes_per_seq < 0:
            raise ValueError(f"{name}: bytes_per_seq must be >= 0, got {bytes_per_seq}")
        self.name = name
        self.capacity = capacity
        self.bytes_per_seq = bytes_per_seq
        self._free = list(range(capacity))
        self._used: set[int] = set()

    @classmethod
    def for_resident(cls, state: ResidentState, max_seqs: int) -> "SequenceSlots":
        """Slots for a hybrid model's conv + recurrent state (HY-01)."""
        return cls("linear_state", max_seqs, state.bytes_per_seq)

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved outside the page pool for every slot."""
        return self.capacity * self.bytes_per_seq

    @property
    def available(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        """The lowest free slot, or ``None`` when all are held ("not now")."""
        if not self._free:
            return None
        s = heapq.heappop(self._free)
        self._used.add(s)
        return s

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"{self.name}: slot {slot} is not held")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)
