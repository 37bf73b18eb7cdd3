"""Model weights as a tenant of the VMM pool: loading, light and deep sleep, wakeup, fork.

One way in: :func:`load_weights` -> :class:`ModelWeights` (a mapping of parameter names to
tensors with ``sleep``/``wake_up``/``fork``/``check_loaded``/``close``);
:class:`SleepController` composes the weights with other sleepable tenants (the KV cache
manager) for the engine. Typed errors in :mod:`xllm_vmm.weights.errors`. Importing this package
imports no torch; loading does.
"""

from xllm_vmm.weights.checkpoint import ShardSpec
from xllm_vmm.weights.errors import (CheckpointChanged, CheckpointError, ResidentPoolRequired,
                                     SleepRefused, WakeupFailed, WakeupOutOfMemory,
                                     WeightsError, WeightsNotLoaded, WeightsOutOfMemory,
                                     WeightVmmRequired)
from xllm_vmm.weights.loader import load_weights, region_bytes
from xllm_vmm.weights.model_weights import (CLOSED, DEEP_SLEEP, LIGHT_SLEEP, WAKEUP,
                                            ModelWeights, SleepReport, WakeReport)
from xllm_vmm.weights.runtime_rules import require_resident_pool, require_weight_vmm
from xllm_vmm.weights.sleep import SleepController, Sleepable, wait_idle

__all__ = [
    "load_weights", "region_bytes", "ModelWeights", "ShardSpec", "SleepReport", "WakeReport",
    "WAKEUP", "LIGHT_SLEEP", "DEEP_SLEEP", "CLOSED",
    "WeightsError", "CheckpointError", "CheckpointChanged", "WeightsNotLoaded",
    "WeightVmmRequired", "WakeupFailed", "WakeupOutOfMemory", "WeightsOutOfMemory",
    "SleepRefused",
    "ResidentPoolRequired", "SleepController", "Sleepable", "wait_idle",
    "require_weight_vmm", "require_resident_pool",
]
