"""Driver side of a hybrid (linear-attention) model's resident state: slots (HY-01, AD-03) and
prefix-cache checkpoints (PC-02), without changes to the scheduler.

:func:`attach_linear_state` wraps the KV cache manager and the worker the scheduler and the
engine use:

- **Slots.** The conv/recurrent state of a running sequence lives in one of ``max_seqs``
  :class:`~xllm_vmm.kvcache.resident.SequenceSlots` (reserved once, outside the page pool,
  ``max_seqs × ResidentState.bytes_per_seq`` bytes). A fresh request's ``allocate`` first takes
  a slot; with none left it is "not now" (``None``, nothing changed) — admission counts the
  slots. ``free`` (finish, abort, preemption) gives the slot back.
- **Chunks.** Before the worker runs a step, every chunk gets its ``state_slot``; a chunk at
  ``start_pos == 0`` starts from zero state (the worker zeroes the slot), the first chunk of a
  request admitted on a prefix hit carries the hit's checkpoint (``state_restore``), every
  other chunk continues its slot's state — chunked prefill carries the state across chunks.
- **Checkpoints.** With prefix caching on, each chunk asks the worker to snapshot the state at
  the block boundaries it crosses (every ``checkpoint_interval`` blocks); ``commit`` publishes
  the snapshots with their blocks (``KVCacheManager.commit(checkpoints=...)``), and the prefix
  cache cuts a hit back to the last block with a checkpoint (PC-02), so a hit always resumes
  from a state that equals the one computing the prefix would give. A checkpoint is owned by
  its prefix-cache entry (dropped on eviction; its bytes are ``checkpoint_bytes`` in the prefix
  stats).

Single process: the worker's :class:`~xllm_vmm.engine.layers.linear_attention.LinearStateCache`
is reached in place (``worker.runner.backend.state``); with several workers the
snapshots and restores become messages of the same step description.
"""

from __future__ import annotations

from typing import Any, Sequence

from xllm_vmm.kvcache.resident import SequenceSlots


class LinearStateManager:
    """Slots and checkpoints of one hybrid model (see the module docstring)."""

    def __init__(self, mgr: Any, state_cache: Any, *, max_seqs: int,
                 checkpoint_interval: int = 1) -> None:
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1 sequence slots, got {max_seqs}")
        if checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be >= 1 block, got {checkpoint_interval}")
        self.mgr = mgr
        self.cache = state_cache
        self.block_size: int = mgr.block_size
        self.slots = SequenceSlots("linear_state", max_seqs, state_cache.bytes_per_seq)
        state_cache.reserve(max_seqs)
        self.checkpoint_interval = checkpoint_interval
        self.checkpoints = bool(getattr(mgr, "enable_prefix_cache", False))
        self._slot: dict[str, int] = {}
        self._restore: dict[str, tuple[int, Any]] = {}  # request -> (start_pos, checkpoint)
        self._hits: dict[str, Any] = {}
        self.restored = 0
        self.saved = 0

    # -- what the scheduler calls (through LinearStateKVManager) --------------------------
    def on_lookup(self, request_id: str, hit: Any) -> None:
        self._hits[request_id] = hit

    def on_allocate(self, request_id: str, hit: Any) -> bool:
        """A fresh request takes a slot (False: none left, "not now")."""
        if request_id in self._slot:
            return True
        slot = self.slots.acquire()
        if slot is None:
            return False
        self._slot[request_id] = slot
        if hit is not None and hit.num_tokens > 0:
            if hit.checkpoint is None:
                self.release(request_id)
                raise RuntimeError(f"request {request_id!r}: a hybrid model's prefix hit of "
                                   f"{hit.num_tokens} tokens has no linear-state checkpoint "
                                   "(PC-02: the prefix cache must be built with hybrid=True)")
            self._restore[request_id] = (hit.num_tokens, hit.checkpoint)
        return True

    def release(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self.slots.release(slot)
        self._restore.pop(request_id, None)
        self._hits.pop(request_id, None)
        self.cache.take(request_id)  # snapshots nobody will commit

    def checkpoints_for(self, request_id: str) -> dict[int, tuple[Any, int]] | None:
        """The worker's snapshots of ``request_id`` as ``commit`` wants them (block index ->
        ``(checkpoint, nbytes)``)."""
        if not self.checkpoints:
            return None
        snaps = self.cache.take(request_id)
        if not snaps:
            return None
        nbytes = self.cache.bytes_per_seq
        self.saved += len(snaps)
        return {pos // self.block_size - 1: (snap, nbytes) for pos, snap in snaps.items()}

    # -- what the worker runs ---------------------------------------------------------------
    def annotate(self, step: Any) -> Any:
        """``step`` with every chunk's ``state_slot`` / ``state_restore`` / ``state_saves`` set
        (a new :class:`~xllm_vmm.engine.step.StepInput`)."""
        from dataclasses import replace

        from xllm_vmm.engine.step import StepInput

        every = self.block_size * self.checkpoint_interval
        chunks = []
        for c in step.chunks:
            slot = self._slot.get(c.request_id)
            if slot is None:
                raise RuntimeError(f"request {c.request_id!r} is computed without a linear-state "
                                   "slot: its allocate() did not go through the state manager")
            restore = None
            pending = self._restore.get(c.request_id)
            if pending is not None and pending[0] == c.start_pos:
                restore = pending[1]
                del self._restore[c.request_id]
                self.restored += 1
            elif c.start_pos > 0 and pending is not None:
                raise RuntimeError(f"request {c.request_id!r} resumes at {c.start_pos}, its "
                                   f"checkpoint is at {pending[0]}")
            end = c.start_pos + len(c.token_ids)
            saves = tuple(range((c.start_pos // every + 1) * every, end + 1, every)) \
                if self.checkpoints else ()
            chunks.append(replace(c, state_slot=slot, state_restore=restore, state_saves=saves))
        return StepInput.build(chunks, step.block_size)

    def stats(self) -> dict[str, int]:
        return {"linear_state_slots": self.slots.capacity,
                "linear_state_slots_used": self.slots.capacity - self.slots.available,
                "linear_state_reserved_bytes": self.slots.reserved_bytes,
                "linear_state_checkpoints_saved": self.saved,
                "linear_state_restores": self.restored}


class LinearStateKVManager:
    """The KV cache manager as the scheduler sees it, with the state manager's hooks on
    ``lookup`` / ``allocate`` / ``commit`` / ``free`` / ``drop``; everything else is the
    manager's own (attribute access falls through)."""

    def __init__(self, mgr: Any, state: LinearStateManager) -> None:
        self._mgr = mgr
        self.state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mgr, name)

    def lookup(self, request_id: str, token_ids: Sequence[int], mm_hashes: Sequence = (), *,
               cache_salt: str | None = None):
        hit = self._mgr.lookup(request_id, token_ids, mm_hashes, cache_salt=cache_salt)
        self.state.on_lookup(request_id, hit)
        return hit

    def allocate(self, request_id: str, num_new_tokens: int, *, hit: Any = None,
                 lookahead: int = 0, num_prompt_tokens: int | None = None):
        fresh = request_id not in self.state._slot
        if not self.state.on_allocate(request_id, hit):
            return None  # no state slot: "not now" (AD-03), nothing changed
        got = self._mgr.allocate(request_id, num_new_tokens, hit=hit, lookahead=lookahead,
                                 num_prompt_tokens=num_prompt_tokens)
        if got is None and fresh:
            self.state.release(request_id)
        return got

    def commit(self, request_id: str, num_computed_tokens: int, token_ids: Sequence[int]) -> None:
        self._mgr.commit(request_id, num_computed_tokens, token_ids,
                         checkpoints=self.state.checkpoints_for(request_id))

    def free(self, request_id: str) -> None:
        self._mgr.free(request_id)
        self.state.release(request_id)

    def drop(self, request_id: str) -> None:
        self._mgr.drop(request_id)
        if request_id not in self.state._slot:
            self.state._hits.pop(request_id, None)

    def stats(self) -> dict[str, Any]:
        return {**self._mgr.stats(), **self.state.stats()}


class LinearStateWorker:
    """The worker with every step annotated by the state manager first."""

    def __init__(self, worker: Any, state: LinearStateManager) -> None:
        self._worker = worker
        self.state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)

    def execute(self, step: Any) -> Any:
        return self._worker.execute(self.state.annotate(step))


def needs_linear_state(worker: Any) -> bool:
    """Whether the worker's model keeps resident linear state (a hybrid model)."""
    backend = getattr(getattr(worker, "runner", None), "backend", None)
    return getattr(backend, "state", None) is not None


def attach_linear_state(mgr: Any, worker: Any, *, max_seqs: int,
                        checkpoint_interval: int = 1) -> tuple[Any, Any]:
    """``(mgr, worker)`` for the scheduler and the engine: unchanged for models without linear
    state, else the wrapped pair over one :class:`LinearStateManager` with ``max_seqs`` slots
    (use the scheduler's ``max_seqs_per_batch``, which bounds the running requests)."""
    if not needs_linear_state(worker):
        return mgr, worker
    state = LinearStateManager(mgr, worker.runner.backend.state, max_seqs=max_seqs,
                               checkpoint_interval=checkpoint_interval)
    return LinearStateKVManager(mgr, state), LinearStateWorker(worker, state)


__all__ = ["LinearStateKVManager", "LinearStateManager", "LinearStateWorker",
           "attach_linear_state", "needs_linear_state"]
