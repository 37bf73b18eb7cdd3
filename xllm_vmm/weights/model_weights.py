"""``ModelWeights``: one model instance's view of its weights, and its sleep state.

A ``ModelWeights`` is a read-only mapping of Hugging Face parameter names to tensors (tied
embeddings: ``lm_head.weight`` is absent when the checkpoint has none; the model decides, see
:attr:`ModelWeights.tie_word_embeddings`). Model code must use these tensors directly — never
copy them into new parameters — so that their addresses stay valid across sleep and wakeup.

States (the engine's own names):

- ``WAKEUP``: the tensors hold the checkpoint's bytes; compute may run.
- ``LIGHT_SLEEP``: the device pages are unmapped and their memory released (when no other
  awake instance shares them); a host copy stays; wakeup is a host-to-device copy.
- ``DEEP_SLEEP``: the host copy is dropped too (when no light sleeper shares it); wakeup reloads
  from the checkpoint files, refused if they changed since loading
  (:class:`~xllm_vmm.weights.errors.CheckpointChanged`).
- ``CLOSED``: after :meth:`ModelWeights.close`.

:meth:`ModelWeights.check_loaded` raises :class:`~xllm_vmm.weights.errors.WeightsNotLoaded`
in any state but ``WAKEUP``: a worker calls it before every step, so nothing is computed on
unmapped or stale memory (on the host driver an unmapped page is ``PROT_NONE``: a read is
SIGSEGV, not garbage). Sleep at the level the instance is in, or lower, and wakeup of an awake
instance are no-ops (idempotent). Sleep while requests run is the engine's to refuse: it passes
their number as ``busy`` and gets :class:`~xllm_vmm.weights.errors.SleepRefused`.

:meth:`ModelWeights.fork` gives another instance over the same physical pages (no byte mapped
or copied); pages and host copy are reference counted by the holders' states
(:mod:`xllm_vmm.weights.store`). Without weight VMM (loaded with ``pool=None``) sleep, wakeup
and fork raise :class:`~xllm_vmm.weights.errors.WeightVmmRequired` (W-02).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Union

from xllm_vmm.weights.errors import SleepRefused, WeightsNotLoaded, WeightVmmRequired
from xllm_vmm.weights.phases import PhaseClock

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from xllm_vmm.weights.checkpoint import Checkpoint
    from xllm_vmm.weights.store import WeightStore

__all__ = ["ModelWeights", "SleepReport", "WakeReport", "WAKEUP", "LIGHT_SLEEP", "DEEP_SLEEP",
           "CLOSED", "Busy"]

WAKEUP = "WAKEUP"
LIGHT_SLEEP = "LIGHT_SLEEP"
DEEP_SLEEP = "DEEP_SLEEP"
CLOSED = "CLOSED"
_LEVELS = {LIGHT_SLEEP: 1, DEEP_SLEEP: 2}

#: What ``busy`` may be: the number of running requests, or a function returning it.
Busy = Union[int, Callable[[], int], None]


@dataclass(frozen=True)
class SleepReport:
    """What a sleep did. ``bytes_freed``: device memory released (the pool's held bytes before
    minus after; 0 when another awake instance still uses the pages, or in a fixed pool), the
    other sleepable tenants' included when a :class:`~xllm_vmm.weights.sleep.SleepController`
    slept them too (``tenants_bytes_freed``: that part); ``host_bytes_freed``: host copy
    dropped; ``seconds``: wall time of the call, which returns only once the memory is gone;
    ``phases``: where those seconds went (:mod:`xllm_vmm.weights.phases`: ``unmap``,
    ``release``, ..., ``other``; they add up to ``seconds``)."""

    level: int
    state: str
    bytes_freed: int
    host_bytes_freed: int
    seconds: float
    tenants_bytes_freed: int = 0
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WakeReport:
    """What a wakeup did. ``source``: ``"host_copy"``, ``"checkpoint"``, ``"shared"`` (another
    awake instance had the pages mapped) or ``"none"`` (already awake); ``bytes_mapped``: device
    memory taken; ``seconds``: wall time; ``phases``: where it went
    (:mod:`xllm_vmm.weights.phases`: ``commit``, ``map``, ``copy``, ..., ``other``; they add
    up to ``seconds``)."""

    state: str
    source: str
    bytes_mapped: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)


def _busy_count(busy: Busy) -> int:
    if busy is None:
        return 0
    n = busy() if callable(busy) else busy
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"busy must be a count of running requests (int >= 0), got {n!r}")
    return n


class ModelWeights(Mapping):
    """See the module docstring. Build with :func:`xllm_vmm.weights.load_weights`."""

    def __init__(self, tensors: dict[str, "torch.Tensor"], checkpoint: "Checkpoint", *,
                 store: "WeightStore | None" = None) -> None:
        self._tensors = tensors
        self.checkpoint = checkpoint
        self._store = store
        self._state = WAKEUP
        self._in_use = 0  # steps inside using()
        if store is not None:
            store.holders.append(self)

    # -- mapping ------------------------------------------------------------------------
    def __getitem__(self, name: str) -> "torch.Tensor":
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    # identity, not Mapping's item-wise equality: two instances over the same tensors are
    # different instances (reference counting relies on it)
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    # -- facts --------------------------------------------------------------------------
    @property
    def model_dir(self) -> Path:
        return self.checkpoint.model_dir

    @property
    def tie_word_embeddings(self) -> bool | None:
        """``tie_word_embeddings`` of the model's config.json (None when it does not say)."""
        return self.checkpoint.tie_word_embeddings

    @property
    def vmm(self) -> bool:
        """True when the weights live in a VMM pool that allows sleep, wakeup and fork."""
        return self._store is not None and self._store.vmm

    @property
    def nbytes(self) -> int:
        """Bytes of the loaded tensors (after sharding and dtype conversion)."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def device_bytes(self) -> int:
        """Bytes of the pool region the tensors live in (whole pages); 0 without a pool."""
        return 0 if self._store is None else self._store.device_bytes

    @property
    def host_copy_bytes(self) -> int:
        """Bytes of the host copy now (shared by forks); 0 when none is kept."""
        return 0 if self._store is None else self._store.host_bytes

    @property
    def tenant(self) -> str | None:
        """The pool tenant that holds the weights (``weights``, ``weights.1``, ...)."""
        return None if self._store is None else self._store.tenant

    @property
    def state(self) -> str:
        return self._state

    def stats(self) -> dict:
        """A snapshot for status routes and metrics: ``state``, ``tenant``, ``tensors``,
        ``weight_bytes`` (tensors), ``device_bytes`` (the region), ``mapped_bytes`` (device
        memory under the region now), ``host_copy_bytes``, ``instances`` (sharing the pages,
        this one included; 1 without a pool)."""
        store = self._store
        mapped = 0
        if store is not None and not store.closed:
            mapped = len(store.pool.pages_in_use(store.region)) * store.region.page_bytes \
                if store.mapped else 0
        return {
            "state": self._state,
            "tenant": self.tenant,
            "tensors": len(self._tensors),
            "weight_bytes": self.nbytes,
            "device_bytes": self.device_bytes,
            "mapped_bytes": mapped,
            "host_copy_bytes": self.host_copy_bytes,
            "instances": 1 if store is None else len(store.holders),
        }

    def shares_pages_with(self, other: "ModelWeights") -> bool:
        return self._store is not None and self._store is other._store

    def check_loaded(self) -> None:
        """Raises :class:`WeightsNotLoaded` unless the instance is awake."""
        if self._state != WAKEUP:
            raise WeightsNotLoaded(self._state)

    @contextmanager
    def using(self) -> Iterator["ModelWeights"]:
        """``with w.using(): ...`` around a forward step: :meth:`check_loaded` on entry, and
        while inside, a sleep from another thread is refused (:class:`SleepRefused`) instead
        of unmapping pages under the step."""
        lock = self._store.lock if self._store is not None else None
        if lock is not None:
            with lock:
                self.check_loaded()
                self._in_use += 1
        else:
            self.check_loaded()
        try:
            yield self
        finally:
            if lock is not None:
                with lock:
                    self._in_use -= 1

    # -- sleep / wakeup / fork ------------------------------------------------------------
    def _require_vmm(self, action: str) -> "WeightStore":
        if self._state == CLOSED:
            raise WeightsNotLoaded(CLOSED)
        if self._store is None or not self._store.vmm:
            raise WeightVmmRequired(action)
        return self._store

    def sleep(self, level: int = 1, *, busy: Busy = None) -> SleepReport:
        """Light (``level=1``) or deep (``level=2``) sleep. ``busy``: running requests (a count
        or a function returning it); more than 0 refuses with :class:`SleepRefused`."""
        clock = PhaseClock()
        t0 = clock.started
        store = self._require_vmm("sleep")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (light: keep a host copy) or 2 (deep: "
                             f"reload from the checkpoint on wakeup), got {level!r}")
        n = _busy_count(busy)
        if n:
            raise SleepRefused(n)
        with store.lock:
            if self._in_use:
                raise SleepRefused(self._in_use, what="forward step")
            if _LEVELS.get(self._state, 0) >= level:
                seconds = time.perf_counter() - t0
                return SleepReport(level, self._state, 0, 0, seconds,
                                   phases=clock.finish(seconds))
            device, host = store.release_for_sleep(self, level, clock)
            self._state = LIGHT_SLEEP if level == 1 else DEEP_SLEEP
        seconds = time.perf_counter() - t0
        return SleepReport(level, self._state, device, host, seconds,
                           phases=clock.finish(seconds))

    def wake_up(self) -> WakeReport:
        """Back to ``WAKEUP``, all or nothing: on failure nothing stays mapped and the state is
        unchanged (:class:`~xllm_vmm.weights.errors.WakeupOutOfMemory` names the missing
        bytes). Idempotent."""
        clock = PhaseClock()
        t0 = clock.started
        store = self._require_vmm("wakeup")
        with store.lock:
            if self._state == WAKEUP:
                seconds = time.perf_counter() - t0
                return WakeReport(WAKEUP, "none", 0, seconds, phases=clock.finish(seconds))
            source, mapped = store.acquire_for_wake(self, clock)
            self._state = WAKEUP
        seconds = time.perf_counter() - t0
        return WakeReport(WAKEUP, source, mapped, seconds, phases=clock.finish(seconds))

    def fork(self) -> "ModelWeights":
        """Another instance over the same pages and host copy (nothing mapped or copied), in
        this instance's state."""
        store = self._require_vmm("fork")
        with store.lock:
            other = ModelWeights(self._tensors, self.checkpoint, store=store)
            other._state = self._state
        return other

    def close(self) -> None:
        """Drops this instance; the last instance over a region gives the pages, the host copy
        and the region back. The tensors must not be used afterwards. Idempotent."""
        if self._state == CLOSED:
            return
        if self._store is not None:
            with self._store.lock:
                self._store.close_holder(self)
                self._state = CLOSED
        else:
            self._state = CLOSED
        self._tensors = {}

    def __enter__(self) -> "ModelWeights":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"pool tenant {self.tenant!r}" if self._store is not None else "host tensors"
        return (f"ModelWeights({str(self.model_dir)!r}, {len(self._tensors)} tensors, "
                f"{self.nbytes} bytes, {where}, {self._state})")
