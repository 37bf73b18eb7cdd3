"""The inputs of a sizing plan, as plain values (no flag parsing here).

:func:`xllm_vmm.planner.from_config.inputs_from_config` builds one from a resolved configuration
(the same sources as ``check-config``); tests and library users build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from xllm_vmm.planner.devices import GiB, PAGE_BYTES

#: Device memory used before the pool is sized, per worker, in elastic mode (the runtime
#: context, communication buffers and graph pools); override with ``--runtime-overhead``.
DEFAULT_RUNTIME_OVERHEAD_BYTES = 1 * GiB

MODES = ("physical", "fixed_vmm", "elastic_vmm")


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on besides the model. Units: bytes, tokens, sequences.

    ``workers`` is every worker of the service (one per device: the engine's world size,
    ``nnodes × len(devices)``); ``dp_size`` its data-parallel groups, each tensor parallel
    over :attr:`tp` workers (:mod:`xllm_vmm.config.parallel`).
    ``device_memory_bytes`` is the total memory of one device (one worker per device);
    ``host_memory_bytes`` the host RAM available for the host KV pool (None: not checked);
    ``context_len`` None means the model's ``max_position_embeddings``;
    ``execution_peak_bytes`` / ``runtime_overhead_bytes`` None means the documented defaults.
    """

    workers: int = 1
    dp_size: int = 1
    device_memory_bytes: int = 64 * GiB
    device_name: str = "ascend-910b-64g"
    page_bytes: int = PAGE_BYTES
    host_memory_bytes: int | None = None
    host_memory_source: str = "--host-memory"  # how host_memory_bytes is known (for HK-07)
    context_len: int | None = None
    block_size: int = 128
    kv_cache_dtype: str = "auto"
    max_memory_utilization: float = 0.8
    max_cache_size: int = 0
    vmm_memory_reserve_bytes: int = 0
    enable_vmm_kvcache: bool = False
    enable_vmm_weights: bool = False
    vmm_elastic: bool = False
    enable_prefix_cache: bool = True
    host_blocks_factor: float = 0.0
    max_seqs_per_batch: int = 200
    max_tokens_per_batch: int = 10240
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0
    speculative_algorithm: str = "MTP"
    execution_peak_bytes: int | None = None
    runtime_overhead_bytes: int | None = None

    @property
    def tp(self) -> int:
        """Workers of one data-parallel group (``workers // dp_size``): the model's KV heads,
        dense weights and MLP width are split this many ways."""
        return max(1, self.workers // max(1, self.dp_size))

    @property
    def mode(self) -> str:
        """``physical`` (KV VMM off), ``fixed_vmm`` or ``elastic_vmm``."""
        if not self.enable_vmm_kvcache:
            return "physical"
        return "elastic_vmm" if self.vmm_elastic else "fixed_vmm"

    @property
    def shared_pool(self) -> bool:
        """VMM-02: weights and KV cache share one VMM pool."""
        return self.enable_vmm_kvcache and self.enable_vmm_weights

    @property
    def mtp(self) -> bool:
        """MTP speculative decoding (the draft's cache is its own group, SD-01)."""
        return self.num_speculative_tokens > 0 and self.speculative_algorithm.upper() == "MTP"

    @property
    def host_offload(self) -> bool:
        """HK-01: completed blocks are retained in a preallocated host pool."""
        return self.enable_vmm_kvcache and self.enable_prefix_cache and self.host_blocks_factor > 1
