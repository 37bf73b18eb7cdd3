"""Admission: may a request start (or a running one grow) now?

- AD-01: token demand becomes blocks per cache group with the model's real layout
  (:meth:`VirtualKVCache.demand`: target, draft, full-attention groups of a hybrid model).
- AD-02 / invariant 5: a request is admitted only if it fits on *every* worker; the capacity
  used is the minimum across workers (:meth:`Admission.available_tokens`).
- AD-03: a new sequence also needs one free slot of every :class:`SequenceSlots` kind (MTP
  embedding slots, hybrid recurrent/conv state).
- AD-04: a fresh (chunked-prefill) request is checked against its whole prompt
  (:meth:`Admission.check_prefill`); decode is checked for the blocks the next tokens add
  (:meth:`Admission.check_growth`); nothing reserves a request's maximum output.
- Available on a worker = free blocks in active slots + evictable cached blocks + the slots the
  live budget can still map (one budget for every group: the bytes of all new slots a request
  needs must fit together).

A positive decision is advice, not a reservation: memory can go between the check and the
allocation, and the allocation then answers ``None`` — a normal "wait" for the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from xllm_vmm.kvcache.cache import CacheCapacity, largest_tokens
from xllm_vmm.kvcache.resident import SequenceSlots

__all__ = ["Admission", "AdmissionDecision", "CapacitySource"]


class CapacitySource(Protocol):
    """One worker's cache as admission sees it (:class:`VirtualKVCache` is one)."""

    def capacity(self) -> CacheCapacity: ...

    def demand(self, tokens: int) -> dict[str, int]: ...


@dataclass(frozen=True)
class AdmissionDecision:
    """``admit``: the request fits now. ``demand``: blocks per group it needs (after what it
    already holds). ``reason``: empty when admitted, else what is short. ``worker``: the first
    worker that could not take it (``None`` when admitted or when a sequence slot is short)."""

    admit: bool
    demand: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    worker: int | None = None

    def __bool__(self) -> bool:
        return self.admit


class Admission:
    """Admission over ``workers`` (one :class:`CapacitySource` per worker of the model) and the
    per-sequence slot kinds in ``sequence_slots``."""

    def __init__(self, workers: Sequence[CapacitySource],
                 sequence_slots: Sequence[SequenceSlots] = ()) -> None:
        if not workers:
            raise ValueError("admission needs at least one worker")
        self.workers = list(workers)
        self.sequence_slots = list(sequence_slots)

    @staticmethod
    def _minus(demand: Mapping[str, int], held: Mapping[str, int] | None) -> dict[str, int]:
        if not held:
            return dict(demand)
        return {g: max(0, n - held.get(g, 0)) for g, n in demand.items()}

    def _check(self, demand_of, new_sequence: bool) -> AdmissionDecision:
        first: dict[str, int] | None = None
        for i, w in enumerate(self.workers):
            demand = demand_of(w)
            if first is None:
                first = demand
            cap = w.capacity()
            need = cap.new_bytes_for(demand)
            if need is None:
                return AdmissionDecision(False, demand, "kv blocks: a cache group has too few "
                                         "slots left in its virtual range", i)
            if need > cap.mappable_bytes:
                return AdmissionDecision(False, demand, f"kv blocks: needs {need} bytes of new "
                                         f"slots, the live budget allows {cap.mappable_bytes}", i)
        if new_sequence:
            for s in self.sequence_slots:
                if s.available < 1:
                    return AdmissionDecision(False, first or {},
                                             f"sequence slots: no free {s.name} slot")
        return AdmissionDecision(True, first or {})

    def check_prefill(self, prompt_tokens: int,
                      held: Mapping[str, int] | None = None) -> AdmissionDecision:
        """A fresh request of ``prompt_tokens`` tokens (its whole prompt, also when prefill is
        chunked). ``held``: blocks per group it already has (prefix-cache hits)."""
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        return self._check(lambda w: self._minus(w.demand(prompt_tokens), held), True)

    def check_growth(self, current_tokens: int, new_tokens: int) -> AdmissionDecision:
        """A running sequence of ``current_tokens`` tokens that will hold ``new_tokens`` more
        (decode, speculative tokens): only the blocks those tokens add."""
        if current_tokens < 0 or new_tokens < 0:
            raise ValueError("token counts must be >= 0, got "
                             f"current={current_tokens} new={new_tokens}")

        def growth(w: CapacitySource) -> dict[str, int]:
            before = w.demand(current_tokens)
            after = w.demand(current_tokens + new_tokens)
            return {g: max(0, after[g] - before[g]) for g in after}
        return self._check(growth, False)

    def available_tokens(self) -> int:
        """The longest single new sequence (tokens) every worker could take now: the minimum
        across workers (AD-02). 0 when a sequence slot kind is exhausted."""
        if any(s.available < 1 for s in self.sequence_slots):
            return 0
        best = None
        for w in self.workers:
            cap = w.capacity()
            n = largest_tokens(lambda t: cap.fits(w.demand(t)))  # noqa: B023 (used at once)
            best = n if best is None else min(best, n)
        return best or 0
