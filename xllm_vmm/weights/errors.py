"""Typed errors of the weights package. Every message says what was wrong, where it came from
and what to do; the engine and the server map them to their answers (the server: 503 for
:class:`WeightsNotLoaded`, 409 for :class:`SleepRefused`, 400 for :class:`WeightVmmRequired`).

The runtime rules W-02 and W-06 (``check-config --explain W-02``) are enforced here, with the
specification's own sentences (:data:`W02_SENTENCE`, :data:`W06_SENTENCE`). Their catalogue
entries live in :mod:`xllm_vmm.config.rules` (``RULES["W-02"]``, ``RULES["W-06"]``); this package
sits below the config package in the layer table and does not import it, so the sentences are
kept here too and a test checks that both homes quote the same specification text.
"""

from __future__ import annotations

__all__ = [
    "WeightsError", "CheckpointError", "CheckpointChanged", "WeightsNotLoaded",
    "WeightVmmRequired", "WeightsOutOfMemory", "WakeupOutOfMemory", "WakeupFailed",
    "SleepRefused",
    "ResidentPoolRequired", "W02_SENTENCE", "W06_SENTENCE",
]

#: Rule W-02, the specification's sentence (000).
W02_SENTENCE = "Model sleep, wakeup and fork require enable_vmm_weights=true."
#: Rule W-06, the specification's sentence (000).
W06_SENTENCE = ("PD KV transfer and remote weight transfer using Mooncake require a fully resident "
                "pool; use vmm_elastic=false and a positive max_memory_utilization.")


class WeightsError(RuntimeError):
    """Base of every error of :mod:`xllm_vmm.weights`."""


class CheckpointError(WeightsError, ValueError):
    """A checkpoint cannot be read as asked: missing files, a bad safetensors header or index,
    a shard hook answer out of range. ``source`` is the file (or directory) at fault."""

    def __init__(self, message: str, *, source: str, hint: str = "") -> None:
        self.source = source
        self.hint = hint
        text = f"{source}: {message}"
        if hint:
            text += f"; {hint}"
        super().__init__(text)


class CheckpointChanged(CheckpointError):
    """A deep-slept instance would reload from files that changed since it loaded them (size
    or modification time), so it would wake up with other weights: refused, still asleep."""


class WeightsNotLoaded(WeightsError):
    """The instance's weight tensors do not hold its weights now (it is asleep, or closed):
    nothing may compute on them. The server answers 503."""

    def __init__(self, state: str, *, what: str = "model") -> None:
        self.state = state
        super().__init__(
            f"the {what}'s weights are not loaded (state {state}): wake the instance up "
            "(POST /wake_up, or LLMEngine.wake_up()) before running requests")


class WeightVmmRequired(WeightsError, ValueError):
    """W-02: sleep, wakeup or fork of weights that do not live in a VMM pool."""

    def __init__(self, action: str) -> None:
        self.action = action
        self.rule = "W-02"
        super().__init__(
            f"W-02: {action} refused: the weights are not in a VMM pool. {W02_SENTENCE} "
            "Start the server with --enable_vmm_weights=true (with --vmm_elastic=true for the "
            "memory to be given back while asleep)")


class ResidentPoolRequired(WeightsError, ValueError):
    """W-06: remote weight transfer (Mooncake) needs a fully resident pool."""

    def __init__(self, what: str, detail: str) -> None:
        self.rule = "W-06"
        super().__init__(f"W-06: {what} refused: {detail}. {W06_SENTENCE}")


class SleepRefused(WeightsError):
    """Sleep was asked while requests run (the engine passes their number), or while forward
    steps use the weights (``what="forward step"``, :meth:`ModelWeights.using`)."""

    def __init__(self, running: int, *, what: str = "request") -> None:
        self.running = running
        self.what = what
        noun = f"{what} is" if running == 1 else f"{what}s are"
        super().__init__(
            f"sleep refused: {running} {noun} running; wait for them to finish or abort them, "
            "or sleep with drain=true (waits until idle, up to a timeout)")


class WakeupFailed(WeightsError):
    """A wakeup could not restore the weights; everything it mapped was released and the
    instance is still asleep (``state``)."""

    def __init__(self, message: str, *, state: str) -> None:
        self.state = state
        super().__init__(f"wakeup failed, the instance stays {state}: {message}")


def _oom_text(needed: int, available: int, missing: int, page: int, cause: str) -> str:
    text = (f"the weights need {needed} bytes ({needed // page} pages) of device memory but "
            f"the pool could take {available} bytes: {missing} bytes missing")
    if cause:
        text += f" ({cause})"
    return text


class WeightsOutOfMemory(WeightsError):
    """Not enough device memory for the weights' pages; nothing stays mapped.
    ``needed_bytes``: the weights' pages; ``available_bytes``: what the pool could take when
    it failed; ``missing_bytes`` = needed − available (at least one page)."""

    def __init__(self, action: str, *, needed_bytes: int, available_bytes: int,
                 page_bytes: int, cause: str = "") -> None:
        self.action = action
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.missing_bytes = max(page_bytes, needed_bytes - available_bytes)
        super().__init__(
            f"{action} failed: " + _oom_text(needed_bytes, available_bytes, self.missing_bytes,
                                             page_bytes, cause)
            + "; free device memory or size the pool for the weights")


class WakeupOutOfMemory(WeightsOutOfMemory, WakeupFailed):
    """:class:`WeightsOutOfMemory` of a wakeup: the instance stays asleep (``state``)."""

    def __init__(self, *, needed_bytes: int, available_bytes: int, page_bytes: int, state: str,
                 cause: str = "") -> None:
        self.action = "wakeup"
        self.state = state
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.missing_bytes = max(page_bytes, needed_bytes - available_bytes)
        WeightsError.__init__(
            self, f"wakeup failed, the instance stays {state}: "
            + _oom_text(needed_bytes, available_bytes, self.missing_bytes, page_bytes, cause)
            + "; free device memory (sleep another instance, lower max_cache_size of the KV "
              "cache, raise the quota) and wake up again")
